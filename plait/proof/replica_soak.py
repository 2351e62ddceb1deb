"""Soak of replica groups (fault_tolerance): kill random ranks of random groups, many times in one run.

    python -m plait.proof.replica_soak --out /tmp/replica-soak --kills 10

Two groups of two FSDP2 ranks train the debug model (each group restarted by torchrun up to
`kills` times, checkpoints every 20 steps). Every few seconds one rank of a random group is
SIGKILLed, unless that group is still coming back. The run must end by itself (no hang), and at
the last step both groups' checkpoints must hold the same weights, bit for bit. Prints the
kills, the heals and the steps a group was missing from.
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
from plait.proof.goodput import JOB
from plait.proof.soak import workers


@dataclass
class SoakArgs:
    out: str
    """working folder"""
    kills: int = 10
    """ranks to SIGKILL during the run"""
    steps: int = 600
    """steps of the run: long enough for every kill's group to come back (~10 s each on a CPU)"""
    seed: int = 0
    """for the moments, groups and ranks of the kills"""


def rows(out: Path, group: int) -> list[dict]:
    path = out / f"metrics.group-{group}.jsonl"
    return jsonl.rows(path) if path.exists() else []


def main(argv: list[str] | None = None) -> int:
    args = parse(SoakArgs, sys.argv[1:] if argv is None else argv, "python -m plait.proof.replica_soak")
    rng, out = random.Random(args.seed), Path(args.out)
    subprocess.run(["rm", "-rf", str(out)], check=True)
    out.mkdir(parents=True)
    job = subprocess.Popen([sys.executable, "-m", "plait", "train", *JOB, "--training.steps", str(args.steps),
                            "--nproc", "2", "--fault_tolerance.enable", "--fault_tolerance.groups", "2",
                            "--max_restarts", str(args.kills), "--metrics.jsonl", str(out / "metrics.jsonl"),
                            "--checkpoint.folder", str(out / "ck"), "--checkpoint.interval", "20"],
                           stdout=open(out / "log.txt", "w"), stderr=subprocess.STDOUT)
    kills, started = 0, time.monotonic()
    while kills < args.kills and job.poll() is None:
        time.sleep(rng.uniform(3, 8))
        group = rng.randrange(2)
        # A group still coming back (fewer than its 2 ranks, or not yet past its first step) is spared
        if len(ranks := workers(job.pid, f"replica_id\0{group}\0")) == 2 and rows(out, group):
            os.kill(rng.choice(ranks), signal.SIGKILL)
            kills += 1
            print(f"replica_soak: kill {kills} at {time.monotonic() - started:.0f} s: group {group}", flush=True)
    try:
        code = job.wait(timeout=900)
    except subprocess.TimeoutExpired:
        job.kill()
        print("replica_soak: HANG: the run did not end within 900 s of the last kill")
        return 1
    from plait.checkpoint.offline import load_full_state_dict
    from plait.checkpoint.manifest import manifest_model, read_manifest

    last = [out / "ck" / f"group-{g}" / f"step-{args.steps}" for g in (0, 1)]
    weights = [load_full_state_dict(p, manifest_model(read_manifest(p), p, "soak"), "soak") for p in last]
    equal = all(weights[0][name].equal(weights[1][name]) for name in weights[0])
    log = (out / "log.txt").read_text()
    missing = sum(1 for g in (0, 1) for row in rows(out, g) if row["replicas"] < 2)
    print(f"replica_soak: {kills} kills in {args.steps} steps, exit code {code}, {log.count('healed from a live')} "
          f"heals, {missing} group-steps with a group missing; final weights of the two groups "
          f"{'bitwise equal' if equal else 'DIFFER'} ({time.monotonic() - started:.0f} s)")
    return 0 if code == 0 and equal and kills == args.kills else 1


if __name__ == "__main__":
    sys.exit(main())
