"""`plait bench-context`: long sequences side by side, sequence length x (CP1, and each cp degree
in each cp kind: all-gather, Ulysses) x attention window (full, or sliding windows in every
block) x (causal, document mask), on one model (default `small`, optionally cut to fewer
blocks), fp32.

Each cell is a real `plait train` run (`plait bench`'s runner) of one sequence per step: tokens/s
(the median after warm-up), rank 0's peak memory (on a CPU its peak RSS: the process, its state
and its activations), and the activations `plait plan` predicts for rank 0 (checked against the
dtype probe's measurement in tests/test_plan.py), with CP2's share of CP1's and the document
mask's cost against causal at the same length, and a window's against full attention. Machines are noisy: compare within one table.
"""

from __future__ import annotations

import itertools
import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from plait.arguments import parse, parse_args
from plait.checks import check_options
from plait.flavor_names import Flavor
from plait.plan import model_shape
from plait.plan.memory import activation_bytes
from plait.proof.bench import BenchConfig, run_row

MASKS = ("causal", "document")


@dataclass
class ContextBenchConfig:
    flavor: Flavor = "small"
    seq_lens: tuple[int, ...] = (1024, 2048, 4096, 8192)
    cps: tuple[int, ...] = (1, 2)
    """cp degrees (each a run of that many ranks; cp > 1 in every kind)"""
    kinds: tuple[Literal["allgather", "ulysses"], ...] = ("allgather", "ulysses")
    windows: tuple[int, ...] = (0,)
    """attention windows (model.sliding_window, in every block); 0 = full attention"""
    n_layers: int = 0
    """blocks of the model; 0 = the flavor's (fewer make long sequences affordable on a CPU)"""
    steps: int = 4
    """optimizer steps per cell; the first `warmup` are not measured"""
    warmup: int = 2
    threads: int = 0
    """CPU threads per rank; 0 = cores / ranks"""
    out: str = ""
    """also write every number as JSON"""


def flags(cfg: ContextBenchConfig, cp: int, kind: str, window: int) -> list[str]:
    return ["--parallelism.cp", str(cp), "--parallelism.dp_shard", "1", "--parallelism.cp_kind", kind,
            "--model.n_layers", str(cfg.n_layers), "--model.max_seq_len", str(max(cfg.seq_lens)),
            "--model.sliding_window", str(window)]


def predicted_activations(cfg: ContextBenchConfig, seq_len: int, cp: int, kind: str, window: int, mask: str) -> int:
    job = check_options(parse_args(["--model.flavor", cfg.flavor, "--training.seq_len", str(seq_len),
                                    "--training.global_batch_size", "1", *flags(cfg, cp, kind, window),
                                    "--model.attention_mask", mask, "--training.mixed_precision_param", "float32"]), cp)
    return activation_bytes(model_shape(job), job, None, 4)


def measure(cfg: ContextBenchConfig) -> list[dict]:
    cells = []
    with tempfile.TemporaryDirectory() as tmp:
        for seq_len in cfg.seq_lens:
            layouts = [(cp, kind) for cp in cfg.cps for kind in (cfg.kinds if cp > 1 else ("allgather",))]
            for (cp, kind), window, mask in itertools.product(layouts, cfg.windows, MASKS):
                bench = BenchConfig(flavor=cfg.flavor, steps=cfg.steps, warmup=cfg.warmup, seq_len=seq_len,
                                    global_batch_size=1, threads=cfg.threads, attention_mask=mask)
                label = "-" if cp == 1 else kind
                print(f"bench-context: seq {seq_len}, cp {cp} {label}, window {window}, {mask} ...", file=sys.stderr,
                      flush=True)
                row = run_row(bench, cfg.flavor, f"cp{cp}", cp, flags(cfg, cp, kind, window), "float32",
                              Path(tmp) / f"{seq_len}-{cp}-{kind}-{window}-{mask}")
                activations = predicted_activations(cfg, seq_len, cp, kind, window, mask)
                cells.append({"seq_len": seq_len, "cp": cp, "kind": label, "window": window, "mask": mask,
                              "tokens_per_sec": row["tokens_per_sec"], "memory_gib": row["memory_gib"],
                              "state_gib": row["state_gib"], "activations_gib": activations / 2**30})
    return cells


def markdown(cells: list[dict]) -> str:
    at = {(c["seq_len"], c["cp"], c["kind"], c["window"], c["mask"]): c for c in cells}
    lines = ["| seq_len | cp | kind | window | mask | tokens/s | vs causal | vs full attention | peak memory GiB "
             "(rank 0) | document vs causal | activations GiB (plan) | activations vs CP1 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        causal = at[c["seq_len"], c["cp"], c["kind"], c["window"], "causal"]
        full = at.get((c["seq_len"], c["cp"], c["kind"], 0, c["mask"]))
        cp1 = at.get((c["seq_len"], 1, "-", c["window"], c["mask"]))
        share = f"{c['activations_gib'] / cp1['activations_gib']:.3f}" if cp1 else "-"
        versus_full = f"{c['tokens_per_sec'] / full['tokens_per_sec']:.2f}x" if full else "-"
        lines.append(f"| {c['seq_len']} | {c['cp']} | {c['kind']} | {c['window'] or 'full'} | {c['mask']} | "
                     f"{c['tokens_per_sec']:.0f} | {c['tokens_per_sec'] / causal['tokens_per_sec']:.2f}x | "
                     f"{versus_full} | {c['memory_gib']:.2f} | {c['memory_gib'] / causal['memory_gib']:.3f} | "
                     f"{c['activations_gib']:.2f} | {share} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    cfg = parse(ContextBenchConfig, argv, "plait bench-context")
    cells = measure(cfg)
    print(markdown(cells))
    if cfg.out:
        Path(cfg.out).write_text(json.dumps(cells, indent=1))
    return 0
