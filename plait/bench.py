"""`plait bench`: layouts x precisions measured side by side in one invocation.

Each row is a real `plait train` run (under torchrun for world > 1) on the same model, data
and batch; tokens/s is the median over the steps after warm-up. Machines are noisy, so only
ratios between rows of the same invocation mean much.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import tyro

from plait.config import ConfigError


Row = Literal["single", "ddp", "ddp_classic", "fsdp2", "tp", "ddp_tp", "fsdp2_tp", "simple_fsdp",
              "simple_fsdp_compiled", "fsdp2_compiled"]


@dataclass
class BenchConfig:
    rows: tuple[Row, ...] = ("single", "ddp", "ddp_classic", "fsdp2")
    """layouts to measure (tp rows use nproc ranks for TP alone, 2 x nproc with data parallelism)"""
    flavor: str = "small"
    """model.flavor of every row"""
    steps: int = 6
    """optimizer steps per row; the first `warmup` are not measured"""
    warmup: int = 2
    """steps excluded from the medians (allocation, first-touch, lazy init)"""
    seq_len: int = 256
    global_batch_size: int = 8
    nproc: int = 2
    """world size of the distributed rows"""
    threads: int = 0
    """CPU threads per rank; 0 = cores / ranks, so every row uses the whole machine"""
    out: str = ""
    """also write the table as JSON (FILE.json) and markdown (FILE.md)"""


def layouts(nproc: int) -> dict[str, tuple[str, int, list[str]]]:
    """row: (description, world size, extra flags); every row runs in fp32 and in bf16."""
    n = str(nproc)
    tp = ["--parallelism.tp", "2"]
    return {
        "single": ("single device", 1, []),
        "ddp": ("DDP (fully_shard, replicate mesh)", nproc, ["--parallelism.dp_replicate", n]),
        "ddp_classic": ("DDP (classic, autocast)", nproc, ["--parallelism.dp_backend", "ddp", "--parallelism.dp_replicate",
                                                          n, "--training.mixed_precision_mode", "autocast"]),
        "fsdp2": ("FSDP2", nproc, ["--parallelism.dp_shard", n]),
        "tp": ("TP2", 2, tp),
        "ddp_tp": (f"DDP{n}+TP2", 2 * nproc, ["--parallelism.dp_replicate", n, "--parallelism.dp_shard", "1", *tp]),
        "fsdp2_tp": (f"FSDP2({n})+TP2", 2 * nproc, ["--parallelism.dp_shard", n, *tp]),
        "simple_fsdp": ("SimpleFSDP fully_shard", nproc, ["--parallelism.dp_backend", "simple_fsdp",
                                                          "--parallelism.dp_shard", n]),
        "simple_fsdp_compiled": ("SimpleFSDP fully_shard, compiled", nproc,
                                 ["--parallelism.dp_backend", "simple_fsdp", "--parallelism.dp_shard", n,
                                  "--compile.enable"]),
        "fsdp2_compiled": ("FSDP2, compiled", nproc, ["--parallelism.dp_shard", n, "--compile.enable"]),
    }


def run_row(cfg: BenchConfig, world: int, flags: list[str], dtype: str, folder: Path) -> dict:
    metrics = folder / f"{len(list(folder.iterdir()))}.jsonl"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"] \
        if world > 1 else [sys.executable]
    command = [*launcher, "-m", "plait", "train", "--model.flavor", cfg.flavor, "--training.steps", str(cfg.steps),
               "--training.seq_len", str(cfg.seq_len), "--training.global_batch_size", str(cfg.global_batch_size),
               "--training.warmup_steps", "1", "--training.mixed_precision_param", dtype,
               "--training.threads", str(cfg.threads), "--metrics.jsonl", str(metrics), *flags]
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"bench row failed: {' '.join(command)}\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()][cfg.warmup:]
    return {"tokens_per_sec": statistics.median(r["tokens_per_sec"] for r in rows),
            "mfu": statistics.median(r["mfu"] for r in rows),
            "memory_gib": max(r["memory_gib"] for r in rows)}


def bench(cfg: BenchConfig) -> list[dict]:
    if cfg.steps <= cfg.warmup:
        raise ConfigError(f"steps: must exceed warmup ({cfg.warmup}), got {cfg.steps}")
    table = []
    with tempfile.TemporaryDirectory() as folder:
        for key in cfg.rows:
            name, world, flags = layouts(cfg.nproc)[key]
            row = {"layout": name, "world": world}
            try:
                for dtype in ("float32", "bfloat16"):
                    print(f"bench: {name}, {dtype} ...", file=sys.stderr, flush=True)
                    for metric, value in run_row(cfg, world, flags, dtype, Path(folder)).items():
                        row[f"{dtype}_{metric}"] = value
            except RuntimeError as e:  # one broken row must not cost the others' measurements
                print(f"bench: {name} FAILED, left out of the table:\n{e}", file=sys.stderr, flush=True)
                continue
            row["bf16_speedup"] = row["bfloat16_tokens_per_sec"] / row["float32_tokens_per_sec"]
            print(f"bench: {name}: {row['float32_tokens_per_sec']:.0f} tok/s fp32, "
                  f"{row['bfloat16_tokens_per_sec']:.0f} tok/s bf16", file=sys.stderr, flush=True)
            table.append(row)
    return table


def markdown(table: list[dict], cfg: BenchConfig) -> str:
    lines = [f"flavor {cfg.flavor}, seq {cfg.seq_len}, global batch {cfg.global_batch_size}, "
             f"median of steps {cfg.warmup + 1}-{cfg.steps}",
             "",
             "| layout | world | fp32 tok/s | fp32 MFU | bf16 tok/s | bf16 MFU | bf16/fp32 | peak mem GiB (bf16) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in table:
        lines.append(f"| {r['layout']} | {r['world']} | {r['float32_tokens_per_sec']:.0f} | {100 * r['float32_mfu']:.1f}% "
                     f"| {r['bfloat16_tokens_per_sec']:.0f} | {100 * r['bfloat16_mfu']:.1f}% | {r['bf16_speedup']:.2f}x "
                     f"| {r['bfloat16_memory_gib']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    cfg = tyro.cli(BenchConfig, args=argv, prog="plait bench", use_underscores=True)
    table = bench(cfg)
    text = markdown(table, cfg)
    print(text)
    if cfg.out:
        Path(cfg.out).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.out).with_suffix(".json").write_text(json.dumps(table, indent=1))
        Path(cfg.out).with_suffix(".md").write_text(text + "\n")
    return 0
