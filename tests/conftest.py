"""Shared helpers: run the real `plait` CLI (under torchrun for world > 1) and read its metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# One thread per rank in every run that is compared: the thread count changes summation order.
TINY = ["--training.threads", "1", "--training.seq_len", "64", "--training.global_batch_size", "4",
        "--training.warmup_steps", "2", "--data.vocab_size", "512"]


@pytest.fixture(scope="session", autouse=True)
def plait_cache(tmp_path_factory):
    """One tokenizer/token cache for the whole session, isolated from the user's."""
    cache = tmp_path_factory.mktemp("plait-cache")
    os.environ["PLAIT_CACHE"] = str(cache)
    return cache


def run_plait(tmp_path: Path, *args: str, nproc: int = 1, check: bool = True, timeout: float = 300):
    """Run `plait train` with `args`; returns (per-step metric rows, completed process)."""
    metrics = tmp_path / f"metrics-{len(list(tmp_path.glob('metrics-*')))}.jsonl"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] \
        if nproc > 1 else [sys.executable]
    command = [*launcher, "-m", "plait", "train", *TINY, *args, "--metrics.jsonl", str(metrics)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(command)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr[-4000:]}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    return rows, proc


def losses(rows: list[dict]) -> list[float]:
    return [row["loss"] for row in rows]


def max_abs_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and a, (len(a), len(b))
    return max(abs(x - y) for x, y in zip(a, b))


def descendants(pid: int) -> list[int]:
    """All processes below `pid`, from /proc (torchrun's workers are grandchildren)."""
    children = {}
    for stat in os.listdir("/proc"):
        if stat.isdigit():
            try:
                ppid = int(open(f"/proc/{stat}/stat").read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(stat))
    stack, found = [pid], []
    while stack:
        kids = children.get(stack.pop(), [])
        found += kids
        stack += kids
    return sorted(found)


def environ(pid: int) -> str:
    try:
        return "\0" + open(f"/proc/{pid}/environ").read()
    except OSError:
        return ""
