"""The links between ranks: the collectives a job runs, at growing sizes, reported as
nccl-tests reports them, with their results checked; and every pair's point-to-point latency.

nccl-tests' definitions (github.com/NVIDIA/nccl-tests, doc/PERFORMANCE.md): S is the operation's
whole buffer in bytes (all-gather: the gathered output; reduce-scatter: the input) and t its
time; algorithm bandwidth algbw = S / t; bus bandwidth busbw = algbw x 2(n-1)/n for all-reduce
and x (n-1)/n for all-gather, reduce-scatter and all-to-all: the bytes each link carries, which
compares with the link's speed whatever n is.
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist

from plait.doctor.machine import gather
from plait.doctor.report import FAIL, PASS, WARN, Check, rank_list
from plait.plan.calibration import BUS_FACTOR
from plait.plan.timing import synchronize

MiB = 1 << 20
SIZES = [MiB << (2 * i) for i in range(6)]  # 1 MiB to 1 GiB, x4
SLOW_PAIR = 4.0  # a pair whose latency is over 4x the median pair's


def collective(name: str, size: int, group, device: torch.device):
    """(run it once, check the last result) for `name` on an fp32 buffer of `size` bytes. Each
    rank's input is a function of its rank, so the exact result is known everywhere (the values
    are small integers: every summation order gives the same fp32 bits)."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    count = size // 4 // n * n
    if name == "all_reduce":
        buffer = torch.empty(count, device=device)

        def run():
            buffer.fill_(rank + 1)
            dist.all_reduce(buffer, group=group)
        return run, lambda: bool((buffer == n * (n + 1) / 2).all())
    if name == "all_gather":
        source = torch.full((count // n,), float(rank + 1), device=device)
        out = torch.empty(count, device=device)
        expected = torch.arange(1, n + 1, device=device, dtype=torch.float32).repeat_interleave(count // n)
        return lambda: dist.all_gather_single(out, source, group=group), lambda: torch.equal(out, expected)
    if name == "reduce_scatter":
        source = torch.full((count,), float(rank + 1), device=device)
        out = torch.empty(count // n, device=device)
        return (lambda: dist.reduce_scatter_single(out, source, group=group),
                lambda: bool((out == n * (n + 1) / 2).all()))
    # all_to_all: chunk j of rank r's input goes to rank j, as chunk r of its output
    source = (rank * n + torch.arange(n, device=device, dtype=torch.float32)).repeat_interleave(count // n)
    out = torch.empty(count, device=device)
    expected = (torch.arange(n, device=device, dtype=torch.float32) * n + rank).repeat_interleave(count // n)
    return lambda: dist.all_to_all_single(out, source, group=group), lambda: torch.equal(out, expected)


def agree(value: float, op, group, device: torch.device) -> float:
    """One number every rank of `group` holds: the MAX of their times (a collective ends when its
    last rank does) or the MIN of their limits, so every rank takes the same decisions."""
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=op, group=group)
    return float(tensor.item())


def memory_cap(device: torch.device) -> int:
    """The largest buffer to try: a quarter of the free memory (each size holds input and output)."""
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // ranks_here
    return free // 4


def measure(name: str, group, device: torch.device, seconds: float, cap: int) -> dict:
    """Sizes from 1 MiB up, x4, while the next size fits the time left and `cap`; at each, one
    warm-up, then repeats (at least 2) within its share of the time, then a check of the result.
    Every decision rests on times all ranks agree on (their maximum), so all take it alike."""
    n = dist.get_world_size(group)
    rows, correct, spent = [], True, 0.0
    for size in SIZES:
        if size > cap or (rows and rows[-1]["seconds"] * 4 * 3 > seconds - spent):
            break
        start = time.perf_counter()
        run, check = collective(name, size, group, device)
        run()
        synchronize(device)
        times = []
        while len(times) < 2 or (sum(times) < seconds / len(SIZES) and len(times) < 20):
            dist.barrier(group=group)
            begin = time.perf_counter()
            run()
            synchronize(device)
            times.append(agree(time.perf_counter() - begin, dist.ReduceOp.MAX, group, device))
        correct = correct and check()
        spent += agree(time.perf_counter() - start, dist.ReduceOp.MAX, group, device)  # with set-up, warm-up
        t = statistics.median(times)
        algbw = size / t
        rows.append({"bytes": size, "seconds": t, "algbw": algbw, "busbw": algbw * BUS_FACTOR[name](n)})
    return {"sizes": rows, "wrong_ranks": [rank for rank, wrong in enumerate(gather(not correct)) if wrong]}


def node_group(local_world: int):
    """This rank's node's group (torchrun numbers a node's ranks consecutively), or None on one node."""
    world = dist.get_world_size()
    if local_world >= world or world % local_world:
        return None
    mine, _ = dist.new_subgroups(group_size=local_world)
    return mine


def collective_checks(device: torch.device, seconds: float, node) -> list[Check]:
    """Each collective over the world, and within each node at once (`node`: this rank's node's
    group, None on one node)."""
    groups = [("world", None)] + ([("within a node", node)] if node is not None else [])
    cap = int(agree(memory_cap(device), dist.ReduceOp.MIN, None, device))
    checks = []
    for where, group in groups:
        for name in BUS_FACTOR:
            result = measure(name, group, device, seconds / len(BUS_FACTOR) / len(groups), cap)
            largest = result["sizes"][-1]
            text = (f"busbw {largest['busbw'] / 1e9:.3g} GB/s (algbw {largest['algbw'] / 1e9:.3g}) at "
                    f"{largest['bytes'] // MiB} MiB, {result['sizes'][0]['busbw'] / 1e9:.3g} GB/s at 1 MiB")
            wrong = result["wrong_ranks"]
            if wrong:
                text = f"wrong results on {rank_list(wrong)}; " + text
            checks.append(Check(f"network: {name} ({where}, {dist.get_world_size(group)} ranks)", text,
                                "results exact", FAIL if wrong else PASS, wrong, result))
    return checks


def pairings(world: int) -> list[list[tuple[int, int]]]:
    """Rounds in which every rank meets one partner, every pair meeting once (the circle method)."""
    players = list(range(world)) + ([None] if world % 2 else [])
    rounds = []
    for _ in range(len(players) - 1):
        half = len(players) // 2
        rounds.append([(min(a, b), max(a, b)) for a, b in zip(players[:half], reversed(players[half:]))
                       if None not in (a, b)])
        players = [players[0], players[-1], *players[1:-1]]
    return rounds


def ping_pong(partner: int, device: torch.device, repeats: int = 12) -> float:
    """Half the median round trip of an 8-byte message with `partner` (the lower rank serves)."""
    message, rank = torch.zeros(2, device=device), dist.get_rank()
    trips = []
    for _ in range(repeats):
        begin = time.perf_counter()
        if rank < partner:
            dist.send(message, partner)
            dist.recv(message, partner)
        else:
            dist.recv(message, partner)
            dist.send(message, partner)
        synchronize(device)
        trips.append(time.perf_counter() - begin)
    return statistics.median(trips[2:]) / 2


def latency_check(device: torch.device) -> Check:
    rank, latencies = dist.get_rank(), {}
    for pairs in pairings(dist.get_world_size()):
        for a, b in pairs:
            if rank in (a, b):
                latencies[(a, b)] = ping_pong(b if rank == a else a, device)
        dist.barrier()
    measured = {}
    for mine in gather(latencies):  # both ends measured a pair: keep the slower view
        for pair, seconds in mine.items():
            measured[pair] = max(seconds, measured.get(pair, 0.0))
    median = statistics.median(measured.values())
    slow = sorted(pair for pair, seconds in measured.items() if seconds > SLOW_PAIR * median)
    text = f"median {median * 1e6:.0f} us over {len(measured)} pairs, worst {max(measured.values()) * 1e6:.0f} us"
    if slow:
        text += "; slow: " + ", ".join(f"ranks {a}-{b} {measured[(a, b)] * 1e6:.0f} us" for a, b in slow)
    return Check("network: point-to-point latency", text, f"every pair <= {SLOW_PAIR:g}x the median",
                 WARN if slow else PASS, sorted({r for pair in slow for r in pair}),
                 {"seconds_per_pair": {f"{a}-{b}": s for (a, b), s in measured.items()}})
