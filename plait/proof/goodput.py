"""Goodput: what one dead rank costs, with replica groups (torchft) and with a restart from a checkpoint.

    python -m plait.proof.goodput --out /tmp/goodput

The same 4 ranks train the debug model twice, and one rank is SIGKILLed once its job has done
`kill_at` steps:
- restart: HSDP (dp_replicate 2 x dp_shard 2) under torchrun --max-restarts 1, checkpoints every
  `interval` steps: every rank restarts and resumes from the newest checkpoint, and the steps
  since it are trained again;
- groups: two replica groups of two FSDP2 ranks (fault_tolerance, --max_restarts 1 per group):
  the other group goes on alone and the restarted one heals from it.
Seconds lost: how much later than a step's usual time the job next finishes a step it had not
finished before, from the moment of the kill. Step times are read as the metrics rows appear.
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from plait import jsonl
from plait.arguments import parse
from plait.proof.soak import workers

JOB = ["--training.threads", "1", "--training.seq_len", "64", "--training.global_batch_size", "4",
       "--data.vocab_size", "512", "--training.mixed_precision_param", "float32", "--metrics.log_interval", "1"]


@dataclass
class GoodputArgs:
    out: str
    """working folder"""
    steps: int = 100
    """steps of each job (group 0 must not finish before the killed group is back: ~10 s on a CPU)"""
    kill_at: int = 12
    """kill once the job has finished this many steps"""
    interval: int = 5
    """the restart run's checkpoint interval"""


def killer(job: subprocess.Popen, metrics: Path, kill_at: int, parts: tuple[str, ...]) -> tuple[dict[int, float], float]:
    """Wait for `metrics` to reach step `kill_at`, SIGKILL the rank whose command line and
    environment hold `parts` (`soak.workers`), then record when each new step first appears until
    the job ends. Returns ({step: seconds since start when first seen}, seconds of the kill)."""
    start, seen, killed = time.monotonic(), {}, None
    while job.poll() is None:
        rows = jsonl.rows(metrics) if metrics.exists() else []
        for row in rows:
            seen.setdefault(row["step"], time.monotonic() - start)
        if killed is None and max(seen, default=0) >= kill_at and (ranks := workers(job.pid, *parts)):
            os.kill(ranks[0], signal.SIGKILL)
            killed = time.monotonic() - start
        time.sleep(0.02)
    if job.returncode != 0 or killed is None:
        raise SystemExit(f"goodput: the job failed ({job.returncode}) or no rank matched {parts!r}")
    return seen, killed


def run(out: Path, flags: list[str], watched: str, args: GoodputArgs, parts: tuple[str, ...]) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    job = subprocess.Popen([sys.executable, "-m", "plait", "train", *JOB, "--training.steps", str(args.steps),
                            "--max_restarts", "1", "--metrics.jsonl", str(out / "metrics.jsonl"), *flags],
                           stdout=open(out / "log.txt", "w"), stderr=subprocess.STDOUT)
    seen, killed = killer(job, out / watched, args.kill_at, parts)
    rows = jsonl.rows(out / watched)
    usual = statistics.median(row["step_time"] for row in rows)
    done = max(step for step, t in seen.items() if t <= killed)
    lost = seen[done + 1] - killed - usual
    # The restarted attempt's start-up line: "N of M steps to go" (it resumed after step M - N)
    starts = [line.split(" steps to go")[0].split()[-3:] for line in (out / "log.txt").read_text().splitlines()
              if line.startswith("plait: start-up") and " steps to go" in line]
    resumed = max(int(total) - int(left) for left, _, total in starts)
    return {"steps trained again": done - resumed if resumed else 0, "seconds lost": lost, "usual step (s)": usual,
            "steps with a group missing": sum(1 for row in rows if row.get("replicas", 2) < 2 and row["step"] > done)}


def main(argv: list[str] | None = None) -> int:
    args = parse(GoodputArgs, sys.argv[1:] if argv is None else argv, "python -m plait.proof.goodput")
    out = Path(args.out)
    restart = run(out / "restart", ["--nproc", "4", "--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "2",
                                    "--checkpoint.folder", str(out / "restart" / "ck"), "--checkpoint.interval",
                                    str(args.interval)], "metrics.jsonl", args, ("\x00RANK=3\x00",))
    groups = run(out / "groups", ["--nproc", "2", "--fault_tolerance.enable", "--fault_tolerance.groups", "2"],
                 "metrics.group-0.jsonl", args, ("replica_id\x001\x00", "\x00RANK=1\x00"))
    print(f"goodput: one rank of 4 SIGKILLed after step {args.kill_at} of {args.steps} (debug model, CPU)\n")
    print("| | restart from a checkpoint (every " + str(args.interval) + " steps) | replica groups (torchft) |")
    print("|---|---|---|")
    for key in restart:
        print(f"| {key} | {restart[key]:.3g} | {groups[key]:.3g} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
