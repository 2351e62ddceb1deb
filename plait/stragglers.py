"""Slow ranks: the rank that makes the others wait, found from when each rank arrived at each
collective (torch's flight recorder, plait/collectives.py, records the time a rank calls one).

Every `metrics.log_interval` steps each rank reads the collectives it called since the last
check; rank 0 lines them up by process group and sequence number. A collective completes when
its last rank arrives, so each rank waited (last arrival - its own arrival) in it: summed over
the interval, that is the rank's collective wait, and the interval's wall time minus it is its
compute. Where the same rank's compute is over the median rank's by MARGIN (25%) and by at least
MIN_S in TIMES checks running (2: a moment's noise, a descheduled process, is not a slow rank),
one line names it (host, rank, local rank), once until it is slow no more; every check's row has
`slowest_rank` and `slowest_rank_margin` (its compute over the median's, - 1).

Arrival times are each host's wall clock: ranks on one host compare exactly; across hosts the
clocks' skew (NTP keeps it well under a millisecond on a cluster's network) is counted as wait.
Reading the recorder costs about 25 ms per 2,000 entries (no stacks), once per log interval.
"""

from __future__ import annotations

import os
import socket
import statistics
import time

import torch.distributed as dist

from plait.collectives import trace

MARGIN, MIN_S, TIMES = 0.25, 0.05, 2


def arrivals(since_ns: int) -> dict[tuple[str, int], int]:
    """{(process group, sequence number): when this rank called it} for collectives since `since_ns`."""
    entries = (trace(stacks=False) or {}).get("entries", [])
    return {("/".join(map(str, e["process_group"])), e["collective_seq_id"]): e["time_created_ns"]
            for e in entries if not e.get("is_p2p") and e["time_created_ns"] > since_ns}


def waits(per_rank: list[dict]) -> list[float]:
    """Each rank's seconds of waiting for a later rank, over the collectives every rank of their
    group recorded."""
    total = [0.0] * len(per_rank)
    for key in set().union(*per_rank):
        seen = {r: times[key] for r, times in enumerate(per_rank) if key in times}
        last = max(seen.values())
        for r, t in seen.items():
            total[r] += (last - t) / 1e9
    return total


class SlowRanks:
    """`enabled`: not under a pipeline, whose stages' work differs by design (plan's split points)."""

    def __init__(self, interval: int, enabled: bool):
        self.interval, self.enabled = interval, enabled and dist.get_world_size() > 1
        self.since_ns, self.since = time.time_ns(), time.perf_counter()
        self.me = {"host": socket.gethostname(), "local_rank": int(os.environ.get("LOCAL_RANK", "0"))}
        self.streak = (None, 0)  # (the rank over the margin at the last checks, how many checks running)

    def check(self, step: int) -> dict:
        """Every rank calls it each step; every `interval` steps it gathers (a collective) and rank 0
        returns the slowest rank's columns (and prints the line where it is slow)."""
        if not self.enabled or step % self.interval:
            return {}
        now_ns, wall = time.time_ns(), time.perf_counter() - self.since
        mine = {**self.me, "arrivals": arrivals(self.since_ns)}
        self.since_ns, self.since = now_ns, time.perf_counter()
        gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        if gathered is None:
            return {}
        compute = [wall - w for w in waits([g["arrivals"] for g in gathered])]
        median = statistics.median(compute)
        slowest = max(range(len(compute)), key=compute.__getitem__)
        margin = compute[slowest] / median - 1 if median > 0 else 0.0
        slow = margin > MARGIN and compute[slowest] - median > MIN_S
        self.streak = (slowest, self.streak[1] + 1 if self.streak[0] == slowest else 1) if slow else (None, 0)
        if self.streak[1] == TIMES:
            who = gathered[slowest]
            print(f"plait: step {step}: rank {slowest} (host {who['host']}, local rank {who['local_rank']}) is slow: "
                  f"its compute {compute[slowest]:.2f} s over the last {self.interval} steps against the median "
                  f"rank's {median:.2f} s (+{margin:.0%}, {TIMES} checks running); the other ranks waited for it in "
                  "their collectives",
                  flush=True)
        return {"slowest_rank": slowest, "slowest_rank_margin": margin}
