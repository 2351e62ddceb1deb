"""The best time of a call on a device: what every speed plan uses was measured with (the doctor's,
`plait plan --device cpu`'s, the host's beside a GPU)."""

from __future__ import annotations

import time

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(run, device: torch.device, seconds: float, at_least: int = 2) -> float:
    """The best time of `run` repeated within `seconds` (at least `at_least` times, after a warm-up)."""
    run()
    synchronize(device)
    best, spent, repeats = float("inf"), 0.0, 0
    while repeats < at_least or spent < seconds:
        begin = time.perf_counter()
        run()
        synchronize(device)
        elapsed = time.perf_counter() - begin
        best, spent, repeats = min(best, elapsed), spent + elapsed, repeats + 1
    return best
