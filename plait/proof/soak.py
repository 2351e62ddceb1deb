"""Soak: kill a training job at random moments, restart it each time, until it finishes.

    python -m plait.proof.soak --cycles 20 --out /tmp/soak

Each cycle starts the same world-2 job (FSDP2, debug model, 500 steps, checkpoints every 20,
keeping the latest 3), waits a random time, then ends it one of three ways: SIGKILL of the whole
job, SIGKILL of one rank (the other must end by itself), or SIGTERM to the whole job
(preemption: a save, then exit). After each cycle every checkpoint that has a manifest must
load; the finished job's per-step losses must equal an uninterrupted run's. Prints the counts.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from plait import jsonl
from plait.arguments import parse

JOB = ["--training.threads", "1", "--training.seq_len", "64", "--training.global_batch_size", "4",
       "--data.vocab_size", "512", "--training.mixed_precision_param", "float32", "--training.steps", "500",
       "--parallelism.dp_shard", "2", "--metrics.log_interval", "1"]


@dataclass
class SoakArgs:
    out: str
    """working folder"""
    cycles: int = 20
    """kill/restart cycles before the job is let finish"""
    seed: int = 0
    """for the kill moments and kinds"""


def train(extra: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "plait", "train", "--nproc", "2", *JOB, *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def workers(pid: int, *parts: str) -> list[int]:
    """The ranks (RANK in their environment) below `pid` whose command line and environment, each
    NUL-separated and NUL-led, hold every one of `parts` (say "\0RANK=1\0")."""
    from plait.launch import descendants

    return [p for p in descendants(pid) if "\0RANK=" in (text := _read(p, "cmdline") + _read(p, "environ"))
            and all(part in text for part in parts)]


def _read(pid: int, name: str) -> str:
    try:
        return "\0" + Path(f"/proc/{pid}/{name}").read_text()
    except OSError:
        return ""


def complete_checkpoints_load(folder: Path) -> tuple[int, int]:
    """(checkpoints with a manifest, those of them that do not load)."""
    from plait.checkpoint.manifest import check_compatible, manifest_model, read_manifest
    from plait.checkpoint.digests import verify
    from plait.config import ConfigError

    complete = [p for p in folder.glob("step-*") if read_manifest(p) is not None]
    bad = 0
    for p in complete:
        try:
            check_compatible(p, manifest_model(read_manifest(p), p, "soak"), "soak")
            verify(p, read_manifest(p), "soak")
        except ConfigError:
            bad += 1
    return len(complete), bad


def main(argv: list[str] | None = None) -> int:
    args = parse(SoakArgs, sys.argv[1:] if argv is None else argv, "python -m plait.proof.soak")
    rng, out = random.Random(args.seed), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    reference = out / "reference.jsonl"
    if not reference.exists():
        assert train(["--metrics.jsonl", str(reference)]).wait() == 0
    folder, metrics = out / "ckpt", out / "soak.jsonl"
    subprocess.run(["rm", "-rf", str(folder), str(metrics)], check=True)
    job = ["--checkpoint.folder", str(folder), "--checkpoint.interval", "20", "--checkpoint.keep_latest_k", "3", "--metrics.jsonl", str(metrics)]
    kinds, checked, corrupt = {"job SIGKILL": 0, "rank SIGKILL": 0, "job SIGTERM": 0}, 0, 0
    for cycle in range(args.cycles):
        proc = train(job)
        time.sleep(rng.uniform(5, 25))
        kind = rng.choice(list(kinds))
        kinds[kind] += 1
        if kind == "rank SIGKILL" and (ranks := workers(proc.pid)):
            os.kill(rng.choice(ranks), signal.SIGKILL)
        else:
            os.killpg(proc.pid, signal.SIGKILL if kind == "job SIGKILL" else signal.SIGTERM)
        try:
            proc.wait(timeout=90)
        finally:
            for pid in workers(proc.pid):
                os.kill(pid, signal.SIGKILL)
        n, bad = complete_checkpoints_load(folder)
        checked, corrupt = checked + n, corrupt + bad
        print(f"cycle {cycle + 1}: {kind}, {n} complete checkpoints, {bad} that do not load", flush=True)
    assert train(job).wait() == 0
    losses = {r["step"]: r["loss"] for r in jsonl.rows(metrics)}
    expected = {r["step"]: r["loss"] for r in jsonl.rows(reference)}
    print(f"soak: {args.cycles} kill/restart cycles ({', '.join(f'{k} {v}' for k, v in kinds.items())}); "
          f"{checked} complete checkpoints checked, {corrupt} corrupt; final losses "
          f"{'equal' if losses == expected else 'DIFFER'} to the uninterrupted run's ({len(losses)} steps)")
    return 0 if corrupt == 0 and losses == expected else 1


if __name__ == "__main__":
    sys.exit(main())
