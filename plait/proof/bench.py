"""`plait bench`: layouts x precisions measured side by side in one invocation.

Each row is a real `plait train` run (under torchrun for world > 1) on the same model, data and
batch. The yardsticks for plait's overhead are the plainest PyTorch loops (plait/proof/baseline.py):
`raw_pytorch` (plait's model), `transformers` (transformers' model of the same config.json) and
`raw_fsdp2` (plait's model under bare fully_shard at the distributed rows' world). Per row and
precision: tokens/s and MFU (medians over the steps after warm-up), tokens/s over the raw loop's in
the same precision (compiled: also rank 0's graph breaks and recompiles), peak memory, the exact
memory of parameters + gradients + optimizer state on rank 0, and the collectives rank 0 issues per
step, counted in a profiler trace of one extra step after the measured ones. Not a warm-up step: the
profiler's buffers stay resident once freed, so on a CPU they would raise the peak memory of every
later step (by about 1 GiB on small). Machines are noisy: only ratios between rows of one invocation
mean much, and `--rounds` runs the rows in turn several times and keeps each row's median.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import typing
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import torch

from plait.arguments import parse
from plait.compile_report import counts, rank_path
from plait.config import ConfigError, Data
from plait.data import build_tokenizer
from plait.flavor_names import Flavor
from plait.hardware import device_name, linear_shapes, native_bf16, peak_flops, pick_device
from plait.models.flavors import model_args
from plait.models.transformer import linear_weight_shapes
from plait.proof.bench_rows import (ATTENTION_TWINS, COMPILABLE, DENSE_TWINS, ENVIRONMENT, PREDICTED, RAW,
                                   STATE_REFERENCES, Row, applies, gpus_missing, layouts)
from plait.proof.bench_table import DTYPES, hardware_line, markdown
from plait.proof.trace import eager_fraction, idle_fractions, phase_seconds, summarise



@dataclass
class BenchConfig:
    rows: tuple[Row, ...] = typing.get_args(Row)
    """layouts to measure (tp rows use nproc ranks for TP alone, 2 x nproc with data parallelism)"""
    flavor: Flavor | None = None
    """model.flavor of every row; default: small, and on a GPU llama3_1b as well"""
    steps: int = 6
    """optimizer steps per row; the first `warmup` are not measured"""
    warmup: int = 2
    """steps excluded from the medians (allocation, first-touch, lazy init)"""
    seq_len: int = 256
    global_batch_size: int = 8
    nproc: int = 2
    """world size of the distributed rows"""
    attention_mask: Literal["causal", "document"] = "causal"
    """model.attention_mask of every row, the raw loop's too (its random tokens hold few end-of-text tokens,
    but a mask costs SDPA the same whatever it masks)"""
    threads: int = 0
    """CPU threads per rank; 0 = cores / ranks, so every row uses the whole machine"""
    out: str = ""
    """also write the tables as JSON (FILE.json, every number) and markdown (FILE.md)"""
    compile: bool = False
    """also measure the raw loops, the single device and FSDP2 with each block compiled (a compiled tok/s column)"""
    rounds: int = 1
    """run every row this many times, the rows in turn each round, and report per row the median of
    its rounds (on a noisy machine 3 rounds steady the ratios between rows)"""
    calibration: str = ""
    """plait doctor --json FILE of this machine: each row also gets plait plan's predicted tokens/s from it"""
    precisions: tuple[Literal["float32", "bfloat16"], ...] = DTYPES
    """compute dtypes every row runs in (on a GPU, bfloat16 alone saves the fp32 runs no one trains in)"""
    emulated_bf16: Literal["skip", "run"] = "skip"
    """where the device has no bf16 matmul units (e.g. AVX2-only CPUs, 150-280x slower in bf16): skip = measure
    fp32 only and say so in the table; run = measure the bf16 rows anyway"""




def flavors(cfg: BenchConfig) -> list[str]:
    if cfg.flavor:
        return [cfg.flavor]
    # small is a CPU-sized model; on a GPU it measures launch overhead more than the layouts.
    return ["small", "llama3_1b"] if torch.cuda.is_available() else ["small"]




def run_row(cfg: BenchConfig, flavor: str, key: str, world: int, flags: list[str], dtype: str, folder: Path,
            compiled: bool = False) -> dict:
    """One training run: its medians and peaks, state memory and collectives per step."""
    folder.mkdir(parents=True)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"] \
        if world > 1 else [sys.executable]
    if key in RAW:
        # plait's single-device row has dp 1, so micro-batch = global batch: the same one forward.
        command = [*launcher, "-m", "plait.proof.baseline", "--flavor", flavor, "--steps", str(cfg.steps),
                   "--seq_len", str(cfg.seq_len), "--batch_size", str(cfg.global_batch_size), "--dtype", dtype,
                   "--threads", str(cfg.threads), "--attention_mask", cfg.attention_mask, *RAW[key],
                   *["--compile"] * compiled]
    else:
        profiled = str(cfg.steps + 1)
        command = [*launcher, "-m", "plait", "train", "--model.flavor", flavor, "--training.steps", profiled,
                   "--training.seq_len", str(cfg.seq_len), "--training.global_batch_size", str(cfg.global_batch_size),
                   "--training.warmup_steps", "1", "--training.mixed_precision_param", dtype,
                   "--training.threads", str(cfg.threads), "--metrics.jsonl", str(folder / "metrics.jsonl"),
                   "--profiling.enable", "--profiling.start_step", profiled, "--profiling.steps", "1",
                   "--profiling.folder", str(folder / "trace"), "--model.attention_mask", cfg.attention_mask, *flags,
                   *(["--compile.enable", "--compile.report", str(folder / "compile.json")] if compiled else [])]
    proc = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **ENVIRONMENT.get(key, {})})
    if proc.returncode != 0:
        raise RuntimeError(f"bench row failed: {' '.join(command)}\n{proc.stderr[-3000:]}")
    lines = proc.stdout if key in RAW else (folder / "metrics.jsonl").read_text()
    rows = [json.loads(line) for line in lines.split("\n") if line.startswith("{")]  # "\n" only: plait/jsonl.py
    measured = [r for r in rows if cfg.warmup < r["step"] <= cfg.steps]
    if compiled:
        return {"compiled_tokens_per_sec": statistics.median(r["tokens_per_sec"] for r in measured),
                **({f"compiled_{k}": n for k, n in counts(rank_path(folder / "compile.json", 0)).items()} |
                   {"compiled_eager_fraction": eager_fraction(folder / "trace")}
                   if key not in RAW else {})}  # (rank 0's graph breaks, recompiles after step 2, time outside graphs)
    return {"tokens_per_sec": statistics.median(r["tokens_per_sec"] for r in measured),
            # None where the peak proved untrustworthy (plait.metrics.logger.Utilisation): no number beats a wrong one.
            "mfu": None if None in (mfus := [r["mfu"] for r in measured]) else statistics.median(mfus),
            "memory_gib": max(r["memory_gib"] for r in measured),
            "state_gib": rows[0]["state_gib"],
            **(collectives(folder / "trace") if key not in RAW else
               {"collectives_per_step": 0.0, "bookkeeping_collectives_per_step": 0.0}),
            "optimizer_seconds": phase_seconds(folder / "trace", "optimizer") if key not in RAW else None,
            **({"idle": idle_fractions(folder / "trace")} if key.startswith("pp") else {})}


def collectives(trace: Path) -> dict:
    """Rank 0's collectives per step: those of forward, backward and optimizer, and apart from
    them the bookkeeping between (the loss and grad-norm reductions), which every layout pays."""
    rows = summarise(trace, rank=0)
    return {"collectives_per_step": sum(r["calls_per_step"] for r in rows if r["phase"] != "step"),
            "bookkeeping_collectives_per_step": sum(r["calls_per_step"] for r in rows if r["phase"] == "step")}


def hardware(cfg: BenchConfig, flavor: str) -> dict:
    """The machine the table was measured on and the peaks its single-device rows divide by."""
    device = pick_device("auto")
    native, why = native_bf16(device)
    threads = cfg.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    args = model_args(flavor, build_tokenizer(Data()).get_vocab_size())
    shapes = linear_shapes(linear_weight_shapes(args), cfg.global_batch_size * cfg.seq_len)
    dtypes = [d for d in dict.fromkeys(cfg.precisions) if d == "float32" or native or cfg.emulated_bf16 == "run"]
    return {"device": device_name(device), "native_bf16": native, "why": why, "threads": threads, "dtypes": dtypes,
            "peak_tflops": {dtype: peak_flops(device, getattr(torch, dtype), shapes).flops / 1e12 for dtype in dtypes}}


def predicted_tokens_per_sec(cfg: BenchConfig, flavor: str, world: int, flags: list[str], dtype: str) -> float:
    """What `plait plan` predicts for a row's run with the doctor's calibration (one machine: one node)."""
    from plait.arguments import parse_args
    from plait.checks import check_options
    from plait.plan import model_shape
    from plait.plan.calibration import from_doctor
    from plait.plan.search import predict_job

    job = check_options(parse_args(["--model.flavor", flavor, "--training.seq_len", str(cfg.seq_len),
                                    "--training.global_batch_size", str(cfg.global_batch_size),
                                    "--training.mixed_precision_param", dtype, "--training.threads", str(cfg.threads),
                                    "--model.attention_mask", cfg.attention_mask, *flags]), world)
    row = predict_job(model_shape(job), job, world, float("inf"), from_doctor(cfg.calibration), world)
    return row.tokens_per_second_per_device * world


def measure(cfg: BenchConfig, flavor: str, key: str, dtypes: tuple[str, ...], folder: Path) -> dict:
    """One run of a row in each precision (compiled as well where asked): {dtype_metric: value}."""
    name, world, flags = layouts(cfg.nproc)[key]
    if key in ("dense_twin", "attention_twin"):
        flags = [*flags, "--model.flavor", {**DENSE_TWINS, **ATTENTION_TWINS}[flavor]]
    row = {}
    for dtype in dtypes:
        print(f"bench: {flavor}, {name}, {dtype} ...", file=sys.stderr, flush=True)
        row.update({f"{dtype}_{metric}": value for metric, value in
                    run_row(cfg, flavor, key, world, flags, dtype, folder / dtype).items()})
        if cfg.calibration and key in PREDICTED:
            row[f"{dtype}_predicted_tokens_per_sec"] = predicted_tokens_per_sec(cfg, flavor, world, flags, dtype)
        if cfg.compile and key in COMPILABLE:
            print(f"bench: {flavor}, {name}, {dtype}, compiled ...", file=sys.stderr, flush=True)
            row.update({f"{dtype}_{metric}": value for metric, value in run_row(
                cfg, flavor, key, world, flags, dtype, folder / f"{dtype}-compiled", compiled=True).items()})
    return row


def across_rounds(runs: list[dict]) -> dict:
    """One row from its rounds: the median of their speeds, the highest of their peaks, the rest
    (state, collectives: the same every round) from the first."""
    row = dict(runs[0])
    for metric in row:
        values = [run[metric] for run in runs]
        if metric.endswith(("tokens_per_sec", "_mfu")) and None not in values:
            row[metric] = statistics.median(values)
        elif metric.endswith("memory_gib"):
            row[metric] = max(values)
    if len(runs) > 1:
        row["rounds_tokens_per_sec"] = {metric: [run[metric] for run in runs] for metric in row
                                        if metric.endswith("tokens_per_sec")}
    return row


def bench(cfg: BenchConfig) -> dict:
    if cfg.steps <= cfg.warmup:
        raise ConfigError(f"steps: must exceed warmup ({cfg.warmup}), got {cfg.steps}")
    if cfg.rounds < 1:
        raise ConfigError(f"rounds: must be at least 1, got {cfg.rounds}")
    if not cfg.precisions:
        raise ConfigError("precisions: name at least one; allowed: float32, bfloat16")
    table, machine, spec = [], {}, layouts(cfg.nproc)
    start_load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        for flavor in flavors(cfg):
            machine[flavor] = hardware(cfg, flavor)
            print(f"bench: {hardware_line(machine[flavor])}", file=sys.stderr, flush=True)
            keys = []
            for key in cfg.rows:
                name, world, _ = spec[key]
                why = applies(key, flavor, cfg.attention_mask) or (f"it needs {world} GPUs" if gpus_missing(world) else "")
                if why:
                    print(f"bench: {name} skipped: {why}", file=sys.stderr, flush=True)
                else:
                    keys.append(key)
            # Round by round, every row once per round: a slow spell of a noisy machine then
            # slows each row's runs alike instead of all runs of one row.
            runs = {key: [] for key in keys}
            for round_ in range(cfg.rounds):
                for key in list(runs):  # the rows that have not failed
                    try:
                        runs[key].append(measure(cfg, flavor, key, machine[flavor]["dtypes"],
                                                 Path(tmp) / f"{flavor}-{key}-{round_}"))
                    except (RuntimeError, ConfigError) as e:  # one broken row must not cost the others' measurements
                        print(f"bench: {spec[key][0]} FAILED, left out of the table:\n{e}",
                              file=sys.stderr, flush=True)
                        del runs[key]
            for key, rounds in runs.items():
                name, world, _ = spec[key]
                row = {"flavor": flavor, "key": key, "layout": name, "world": world, **across_rounds(rounds)}
                if "bfloat16_tokens_per_sec" in row and "float32_tokens_per_sec" in row:
                    row["bf16_speedup"] = row["bfloat16_tokens_per_sec"] / row["float32_tokens_per_sec"]
                print(f"bench: {name}: " + ", ".join(f"{row[f'{dtype}_tokens_per_sec']:.0f} tok/s {dtype}"
                                                     for dtype in machine[flavor]["dtypes"]), file=sys.stderr, flush=True)
                table.append(row)
    add_vs_raw(table)
    add_ac_effect(table)
    return {"settings": asdict(cfg), "hardware": machine, "rows": table, "state_ratios": state_ratios(table),
            "load": load(cfg, start_load, [spec[row["key"]][1] for row in table])}


def load(cfg: BenchConfig, start: float, worlds: list[int]) -> dict:
    """The machine's 1-minute load average at the start and at the end, next to its cores and the
    most the bench's own ranks make (ranks x threads each, as plait train and the raw loops set
    them): what the end holds beyond that, or the start holds at all, is other work."""
    cores = os.cpu_count() or 1  # the load average counts the whole system's runnable threads
    own = max((world * (cfg.threads or max(1, cores // world)) for world in worlds), default=cores)
    return {"cores": cores, "start": start, "end": os.getloadavg()[0], "own": max(own, cores)}


def add_vs_raw(table: list[dict]) -> None:
    """tokens/s over the raw loop's of the same flavor and precision: < 1 is slower than raw PyTorch."""
    raw = {r["flavor"]: r for r in table if r["key"] == "raw_pytorch"}
    for r in table:
        for dtype in DTYPES:
            base = raw.get(r["flavor"])
            if f"{dtype}_tokens_per_sec" in r:
                r[f"{dtype}_vs_raw"] = r[f"{dtype}_tokens_per_sec"] / base[f"{dtype}_tokens_per_sec"] if base else None


def add_ac_effect(table: list[dict]) -> None:
    """Activation-checkpointing rows against FSDP2 without it: peak memory saved, tokens/s ratio."""
    plain = {r["flavor"]: r for r in table if r["key"] == "fsdp2"}
    for r in table:
        base = plain.get(r["flavor"])
        for dtype in DTYPES:
            if r["key"].startswith("fsdp2_ac_") and base and f"{dtype}_tokens_per_sec" in r:
                r[f"{dtype}_ac_saved_gib"] = base[f"{dtype}_memory_gib"] - r[f"{dtype}_memory_gib"]
                r[f"{dtype}_ac_speed"] = r[f"{dtype}_tokens_per_sec"] / base[f"{dtype}_tokens_per_sec"]


def state_ratios(table: list[dict]) -> list[dict]:
    """State memory per rank of each sharded or pipelined layout over that of the layout holding
    it whole (fp32 runs; bf16 holds the same fp32 parameters, gradients and AdamW state)."""
    ratios = []
    for flavor in dict.fromkeys(r["flavor"] for r in table):
        rows = {r["key"]: r for r in table if r["flavor"] == flavor}
        for key, references in STATE_REFERENCES.items():
            reference = next((rows[k] for k in references if k in rows), None)
            state = next((f"{d}_state_gib" for d in DTYPES if f"{d}_state_gib" in rows.get(key, {})), None)
            if reference and key in rows and state in reference:
                ratios.append({"flavor": flavor, "world": rows[key]["world"], "layout": rows[key]["layout"],
                               "reference": reference["layout"],
                               "ratio": rows[key][state] / reference[state]})
    return ratios


def main(argv: list[str]) -> int:
    cfg = parse(BenchConfig, argv, "plait bench")
    result = bench(cfg)
    text = markdown(result)
    print(text)
    if cfg.out:
        Path(cfg.out).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.out).with_suffix(".json").write_text(json.dumps(result, indent=1))
        Path(cfg.out).with_suffix(".md").write_text(text + "\n")
    return 0
