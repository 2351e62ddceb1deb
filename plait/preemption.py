"""Preemption: SIGTERM or SIGUSR1 (what Slurm, Kubernetes and torchrun send before they kill a
job) make every rank finish the current step, save a checkpoint and stop.

The handler only records the signal, so a repeated signal (schedulers signal every process, and
torchrun's agent forwards its own SIGTERM to the workers) cannot interrupt anything. Ranks are
signalled at different moments, so they agree through one all-reduce per step of the signal
number (MAX, 4 bytes), run beside the loss's: all stop after the same step.
"""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(Exception):
    """The run stopped early on a signal, after saving (or saying why it could not)."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum  # the shell's code for "ended by this signal": not a finished run


class Preemption:
    def __init__(self, device: torch.device):
        self.signum = 0
        self.flag = torch.zeros(1, device=device)
        self.previous = {sig: signal.signal(sig, self._record) for sig in SIGNALS}

    def _record(self, signum, frame) -> None:
        self.signum = self.signum or signum

    def agree(self) -> None:
        """All-reduce (MAX) the signal number this rank received (0: none) over every rank."""
        self.flag.fill_(self.signum)
        dist.all_reduce(self.flag, op=dist.ReduceOp.MAX)

    def agreed_signal(self) -> int:
        """After `agree`: the largest signal number any rank had received (0: none)."""
        return int(self.flag.item())

    def close(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
