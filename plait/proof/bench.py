"""`plait bench`: layouts x precisions measured side by side in one invocation.

Each row is a real `plait train` run (under torchrun for world > 1) on the same model, data
and batch, and `raw_pytorch` is the plainest PyTorch loop of the same model
(plait/proof/baseline.py): the yardstick for plait's overhead. Per row and precision: tokens/s and
MFU (medians over the steps after warm-up), tokens/s over the raw loop's in the same precision,
peak memory, the exact memory of parameters + gradients + optimizer state on rank 0, and the
collectives rank 0 issues per step, counted in a profiler trace of one extra step after the
measured ones. Not a warm-up step: the profiler's buffers stay resident once freed, so on a CPU
they would raise the peak memory of every later step (by about 1 GiB on small). Machines are noisy:
only ratios between rows of one invocation mean much.
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
from plait.config import ConfigError, Data, Flavor
from plait.data import build_tokenizer
from plait.hardware import device_name, linear_shapes, native_bf16, peak_flops, pick_device
from plait.model import FLAVORS, linear_weight_shapes, model_args
from plait.proof.trace import idle_fractions, phase_seconds, summarise

Row = Literal["raw_pytorch", "single", "ddp", "ddp_classic", "fsdp2", "simple_fsdp", "simple_fsdp_compiled",
              "fsdp2_compiled", "fsdp2_ac_selective", "fsdp2_ac_full", "tp", "ddp_tp", "fsdp2_tp", "simple_fsdp_tp",
              "pp", "pp_fsdp2", "cp", "single_float8", "fsdp2_float8", "fsdp2_float8_rowwise", "fsdp2_float8_compiled",
              "ep", "dense_twin", "single_muon", "fsdp2_muon"]
PP_MICROBATCHES = 4
DTYPES = ("float32", "bfloat16")
# row: the rows holding the whole state it divides (in order of preference). Sharding holds
# 1/world of DDP's state per rank; a pipeline stage 1/pp of the single device's.
STATE_REFERENCES = {"fsdp2": ("ddp", "ddp_classic"), "simple_fsdp": ("ddp", "ddp_classic"), "pp": ("single",)}
# float8 row: the same layout without float8, the row its tokens/s are compared with.
FLOAT8_REFERENCES = {"single_float8": "single", "fsdp2_float8": "fsdp2", "fsdp2_float8_rowwise": "fsdp2",
                     "fsdp2_float8_compiled": "fsdp2_compiled"}
# Muon rows: the AdamW row of the same layout, whose optimizer step they are compared with.
MUON_REFERENCES = {"single_muon": "single", "fsdp2_muon": "fsdp2"}
# A mixture of experts' dense model of equal active parameters (the dense_twin row), beside its FSDP2 and EP rows.
DENSE_TWINS = {"small_moe": "small_moe_dense"}


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
    emulated_bf16: Literal["skip", "run"] = "skip"
    """where the device has no bf16 matmul units (e.g. AVX2-only CPUs, 150-280x slower in bf16): skip = measure
    fp32 only and say so in the table; run = measure the bf16 rows anyway"""


def layouts(nproc: int) -> dict[str, tuple[str, int, list[str]]]:
    """row: (description, world size, extra flags); every row runs in fp32 and in bf16."""
    n = str(nproc)
    tp = ["--parallelism.tp", "2"]
    pp = ["--parallelism.pp", "2", "--parallelism.pp_microbatches", str(PP_MICROBATCHES)]
    simple = ["--parallelism.dp_backend", "simple_fsdp", "--parallelism.dp_shard", n]
    float8 = ["--training.float8", "tensorwise"]
    return {
        "raw_pytorch": ("raw PyTorch loop (no plait)", 1, []),
        "single": ("single device", 1, []),
        "ddp": ("DDP (fully_shard, replicate mesh)", nproc, ["--parallelism.dp_replicate", n]),
        "ddp_classic": ("DDP (classic, autocast)", nproc, ["--parallelism.dp_backend", "ddp", "--parallelism.dp_replicate",
                                                          n, "--training.mixed_precision_mode", "autocast"]),
        "fsdp2": ("FSDP2", nproc, ["--parallelism.dp_shard", n]),
        "simple_fsdp": ("SimpleFSDP fully_shard", nproc, simple),
        "simple_fsdp_compiled": ("SimpleFSDP fully_shard, compiled", nproc, [*simple, "--compile.enable"]),
        "fsdp2_compiled": ("FSDP2, compiled", nproc, ["--parallelism.dp_shard", n, "--compile.enable"]),
        **{f"fsdp2_ac_{mode}": (f"FSDP2, AC {mode}", nproc, ["--parallelism.dp_shard", n,
                                                            "--activation_checkpoint.mode", mode])
           for mode in ("selective", "full")},
        "tp": ("TP2", 2, tp),
        "ddp_tp": (f"DDP{n}+TP2", 2 * nproc, ["--parallelism.dp_replicate", n, "--parallelism.dp_shard", "1", *tp]),
        "fsdp2_tp": (f"FSDP2({n})+TP2", 2 * nproc, ["--parallelism.dp_shard", n, *tp]),
        "simple_fsdp_tp": (f"SimpleFSDP({n})+TP2", 2 * nproc, [*simple, *tp]),
        "pp": (f"PP2 (1f1b, {PP_MICROBATCHES} micro-batches)", 2, pp),
        "pp_fsdp2": (f"PP2+FSDP2({n})", 2 * nproc, [*pp, "--parallelism.dp_shard", n]),
        "cp": ("CP2 (each sequence over 2 ranks)", 2, ["--parallelism.cp", "2", "--parallelism.dp_shard", "1"]),
        "single_float8": ("single device, float8 tensorwise", 1, float8),
        "fsdp2_float8": ("FSDP2, float8 tensorwise (float8 all-gather)", nproc, ["--parallelism.dp_shard", n, *float8]),
        "fsdp2_float8_rowwise": ("FSDP2, float8 rowwise", nproc,
                                 ["--parallelism.dp_shard", n, "--training.float8", "rowwise"]),
        "fsdp2_float8_compiled": ("FSDP2, float8 tensorwise, compiled", nproc,
                                  ["--parallelism.dp_shard", n, *float8, "--compile.enable"]),
        # mixtures of experts only: experts split over the FSDP2 ranks; the dense twin as FSDP2
        "ep": (f"EP{n} over FSDP2({n})", nproc, ["--parallelism.dp_shard", n, "--parallelism.ep", n]),
        "dense_twin": ("FSDP2, the dense twin (equal active parameters)", nproc, ["--parallelism.dp_shard", n]),
        "single_muon": ("single device, Muon", 1, ["--optimizer.name", "muon"]),
        "fsdp2_muon": ("FSDP2, Muon", nproc, ["--parallelism.dp_shard", n, "--optimizer.name", "muon"]),
    }


def applies(key: str, flavor: str) -> str:
    """Why a row does not apply to a flavor, or "" when it does."""
    if key == "ep" and not FLAVORS[flavor].n_experts:
        return "it needs a mixture of experts (e.g. --flavor small_moe)"
    if key == "dense_twin" and flavor not in DENSE_TWINS:
        return f"only {', '.join(DENSE_TWINS)} has a dense twin"
    return ""


def flavors(cfg: BenchConfig) -> list[str]:
    if cfg.flavor:
        return [cfg.flavor]
    # small is a CPU-sized model; on a GPU it measures launch overhead more than the layouts.
    return ["small", "llama3_1b"] if torch.cuda.is_available() else ["small"]


def gpus_missing(world: int) -> bool:
    """A GPU machine with fewer GPUs than ranks cannot run the row (one GPU per rank)."""
    return torch.cuda.is_available() and torch.cuda.device_count() < world


def run_row(cfg: BenchConfig, flavor: str, key: str, world: int, flags: list[str], dtype: str, folder: Path) -> dict:
    """One training run: its medians and peaks, state memory and collectives per step."""
    folder.mkdir(parents=True)
    if key == "raw_pytorch":
        # plait's single-device row has dp 1, so micro-batch = global batch: the same one forward.
        command = [sys.executable, "-m", "plait.proof.baseline", "--flavor", flavor, "--steps", str(cfg.steps),
                   "--seq_len", str(cfg.seq_len), "--batch_size", str(cfg.global_batch_size), "--dtype", dtype,
                   "--threads", str(cfg.threads), "--attention_mask", cfg.attention_mask]
    else:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"] \
            if world > 1 else [sys.executable]
        profiled = str(cfg.steps + 1)
        command = [*launcher, "-m", "plait", "train", "--model.flavor", flavor, "--training.steps", profiled,
                   "--training.seq_len", str(cfg.seq_len), "--training.global_batch_size", str(cfg.global_batch_size),
                   "--training.warmup_steps", "1", "--training.mixed_precision_param", dtype,
                   "--training.threads", str(cfg.threads), "--metrics.jsonl", str(folder / "metrics.jsonl"),
                   "--profiling.enable", "--profiling.start_step", profiled, "--profiling.steps", "1",
                   "--profiling.folder", str(folder / "trace"), "--model.attention_mask", cfg.attention_mask, *flags]
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"bench row failed: {' '.join(command)}\n{proc.stderr[-3000:]}")
    lines = proc.stdout if key == "raw_pytorch" else (folder / "metrics.jsonl").read_text()
    rows = [json.loads(line) for line in lines.splitlines() if line.startswith("{")]
    measured = [r for r in rows if cfg.warmup < r["step"] <= cfg.steps]
    return {"tokens_per_sec": statistics.median(r["tokens_per_sec"] for r in measured),
            # None where the peak proved untrustworthy (plait.metrics.Utilisation): no number beats a wrong one.
            "mfu": None if None in (mfus := [r["mfu"] for r in measured]) else statistics.median(mfus),
            "memory_gib": max(r["memory_gib"] for r in measured),
            "state_gib": rows[0]["state_gib"],
            **(collectives(folder / "trace") if key != "raw_pytorch" else
               {"collectives_per_step": 0.0, "bookkeeping_collectives_per_step": 0.0}),
            "optimizer_seconds": phase_seconds(folder / "trace", "optimizer") if key != "raw_pytorch" else None,
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
    dtypes = DTYPES if native or cfg.emulated_bf16 == "run" else DTYPES[:1]
    return {"device": device_name(device), "native_bf16": native, "why": why, "threads": threads, "dtypes": dtypes,
            "peak_tflops": {dtype: peak_flops(device, getattr(torch, dtype), shapes).flops / 1e12 for dtype in dtypes}}


def bench(cfg: BenchConfig) -> dict:
    if cfg.steps <= cfg.warmup:
        raise ConfigError(f"steps: must exceed warmup ({cfg.warmup}), got {cfg.steps}")
    table, machine = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for flavor in flavors(cfg):
            machine[flavor] = hardware(cfg, flavor)
            print(f"bench: {hardware_line(machine[flavor])}", file=sys.stderr, flush=True)
            for key in cfg.rows:
                name, world, flags = layouts(cfg.nproc)[key]
                if why := applies(key, flavor) or (f"it needs {world} GPUs" if gpus_missing(world) else ""):
                    print(f"bench: {name} skipped: {why}", file=sys.stderr, flush=True)
                    continue
                if key == "dense_twin":
                    flags = [*flags, "--model.flavor", DENSE_TWINS[flavor]]
                row = {"flavor": flavor, "key": key, "layout": name, "world": world}
                try:
                    for dtype in machine[flavor]["dtypes"]:
                        print(f"bench: {flavor}, {name}, {dtype} ...", file=sys.stderr, flush=True)
                        folder = Path(tmp) / f"{flavor}-{key}-{dtype}"
                        for metric, value in run_row(cfg, flavor, key, world, flags, dtype, folder).items():
                            row[f"{dtype}_{metric}"] = value
                except (RuntimeError, ConfigError) as e:  # one broken row must not cost the others' measurements
                    print(f"bench: {name} FAILED, left out of the table:\n{e}", file=sys.stderr, flush=True)
                    continue
                if "bfloat16_tokens_per_sec" in row:
                    row["bf16_speedup"] = row["bfloat16_tokens_per_sec"] / row["float32_tokens_per_sec"]
                print(f"bench: {name}: " + ", ".join(f"{row[f'{dtype}_tokens_per_sec']:.0f} tok/s {dtype}"
                                                     for dtype in machine[flavor]["dtypes"]), file=sys.stderr, flush=True)
                table.append(row)
    add_vs_raw(table)
    add_ac_effect(table)
    return {"settings": asdict(cfg), "hardware": machine, "rows": table, "state_ratios": state_ratios(table)}


def hardware_line(machine: dict) -> str:
    peaks = ", ".join(f"{dtype} {tflops:.3g}" for dtype, tflops in machine["peak_tflops"].items())
    return (f"hardware: {machine['device']} | native bf16: {'yes' if machine['native_bf16'] else 'no'} "
            f"({machine['why']}) | {machine['threads']} threads per single-device row | peak TFLOP/s of this "
            f"flavor's fastest linear layer: {peaks}")


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


def ac_cell(row: dict, dtype: str) -> str:
    if f"{dtype}_ac_saved_gib" not in row:
        return "-"
    return f"{row[f'{dtype}_ac_saved_gib']:+.2f} GiB saved, {row[f'{dtype}_ac_speed']:.2f}x tok/s"


def state_ratios(table: list[dict]) -> list[dict]:
    """State memory per rank of each sharded or pipelined layout over that of the layout holding
    it whole (fp32 runs; bf16 holds the same fp32 parameters, gradients and AdamW state)."""
    ratios = []
    for flavor in dict.fromkeys(r["flavor"] for r in table):
        rows = {r["key"]: r for r in table if r["flavor"] == flavor}
        for key, references in STATE_REFERENCES.items():
            reference = next((rows[k] for k in references if k in rows), None)
            if reference and key in rows:
                ratios.append({"flavor": flavor, "world": rows[key]["world"], "layout": rows[key]["layout"],
                               "reference": reference["layout"],
                               "ratio": rows[key]["float32_state_gib"] / reference["float32_state_gib"]})
    return ratios


def bubble_line(row: dict, dtype: str) -> str:
    """A pipeline row's measured idle share per rank (outside forward and backward: the bubble,
    plus the optimizer and bookkeeping every layout has) next to the schedule's ideal bubble."""
    stages = 2
    ideal = (stages - 1) / (PP_MICROBATCHES + stages - 1)
    idle = ", ".join(f"rank {rank} {100 * share:.0f}%" for rank, share in sorted(row[f"{dtype}_idle"].items()))
    return f"{row['layout']} {dtype}: idle {idle}; ideal bubble (p-1)/(m+p-1) = {100 * ideal:.0f}%"


def float8_lines(rows: list[dict], dtypes: list[str]) -> list[str]:
    """Each float8 row's tokens/s against the same layout without float8, per compute dtype."""
    by_key = {r["key"]: r for r in rows}
    lines = []
    for key, reference in FLOAT8_REFERENCES.items():
        if key in by_key and reference in by_key:
            ratios = ", ".join(f"{by_key[key][f'{d}_tokens_per_sec'] / by_key[reference][f'{d}_tokens_per_sec']:.2f}x "
                               f"({d})" for d in dtypes)
            lines.append(f"{by_key[key]['layout']} vs {by_key[reference]['layout']}: {ratios} tokens/s")
    return lines


def moe_lines(rows: list[dict], dtypes: list[str]) -> list[str]:
    """A mixture of experts' EP row and its dense twin against its FSDP2 row (tokens/s)."""
    by_key = {r["key"]: r for r in rows}
    if "fsdp2" not in by_key:
        return []
    return [f"{by_key[key]['layout']} vs FSDP2 (mixture of experts): " + ", ".join(
        f"{by_key[key][f'{d}_tokens_per_sec'] / by_key['fsdp2'][f'{d}_tokens_per_sec']:.2f}x ({d})" for d in dtypes)
        + " tokens/s" for key in ("ep", "dense_twin") if key in by_key]


def muon_lines(rows: list[dict], dtypes: list[str]) -> list[str]:
    """Each Muon row's optimizer step (rank 0, the profiled step) against AdamW's in the same layout."""
    by_key = {r["key"]: r for r in rows}
    return [f"{by_key[key]['layout']}: optimizer step " + ", ".join(
        f"{1e3 * by_key[key][f'{d}_optimizer_seconds']:.0f} ms vs AdamW's "
        f"{1e3 * by_key[reference][f'{d}_optimizer_seconds']:.0f} ms ({d})" for d in dtypes)
        for key, reference in MUON_REFERENCES.items() if key in by_key and reference in by_key]


def markdown(result: dict) -> str:
    cfg = result["settings"]
    lines = []
    for flavor in dict.fromkeys(r["flavor"] for r in result["rows"]):
        rows, machine = [r for r in result["rows"] if r["flavor"] == flavor], result["hardware"][flavor]
        lines += [hardware_line(machine), "", f"flavor {flavor}, seq {cfg['seq_len']}, global batch {cfg['global_batch_size']}, "
                  f"median of steps {cfg['warmup'] + 1}-{cfg['steps']}; state = parameters + gradients + optimizer "
                  f"state on rank 0; collectives per step on rank 0, loss and grad-norm reductions left out", ""]
        for dtype, short in zip(DTYPES, ("fp32", "bf16")):
            if dtype not in machine["dtypes"]:
                lines += [f"{short}: not measured, emulated on this device ({machine['why']}); "
                          "`plait bench --emulated_bf16 run` measures it anyway", ""]
                continue
            speedup = " vs fp32 |" if dtype == "bfloat16" else ""
            lines += [f"| layout | world | {short} tok/s | MFU | vs raw |{speedup} peak mem GiB | state GiB/rank "
                      f"| collectives/step | AC vs FSDP2 |",
                      "|---|---|---|---|---|---|---|---|---|" + "---|" * bool(speedup)]
            for r in rows:
                vs_raw, mfu = r[f"{dtype}_vs_raw"], r[f"{dtype}_mfu"]
                lines.append(f"| {r['layout']} | {r['world']} | {r[f'{dtype}_tokens_per_sec']:.0f} "
                             f"| {'n/a' if mfu is None else f'{100 * mfu:.1f}%'} | {'-' if vs_raw is None else f'{vs_raw:.2f}x'} |"
                             + (f" {r['bf16_speedup']:.2f}x |" if speedup else "")
                             + f" {r[f'{dtype}_memory_gib']:.2f} | {r[f'{dtype}_state_gib']:.3g} "
                             f"| {r[f'{dtype}_collectives_per_step']:g} | {ac_cell(r, dtype)} |")
            lines.append("")
        lines += [f"{s['layout']} state per rank / {s['reference']} state per rank at world {s['world']}: "
                  f"{s['ratio']:.2f}" for s in result["state_ratios"] if s["flavor"] == flavor]
        lines += [bubble_line(r, dtype) for r in rows for dtype in machine["dtypes"] if f"{dtype}_idle" in r]
        lines += float8_lines(rows, machine["dtypes"])
        lines += moe_lines(rows, machine["dtypes"])
        lines += muon_lines(rows, machine["dtypes"])
        lines.append("")
    return "\n".join(lines).rstrip()


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
