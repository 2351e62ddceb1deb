"""Preemption: SIGTERM or SIGUSR1 (what Slurm, Kubernetes and torchrun send before they kill a
job), SIGINT (Ctrl-C), SIGHUP (a closed terminal) or SIGQUIT make every rank finish the current
step, save a checkpoint and stop.

The handler only records the signal, so a repeated signal (schedulers signal every process, and
torchrun's agent forwards its own SIGTERM to the workers) cannot interrupt anything (Ctrl-C
aside, below). Ranks are signalled at different moments, so they agree through one all-reduce
per step of the signal number (MAX, 4 bytes), run beside the loss's: all stop after the same step.

Ctrl-C is a person waiting, who may not want to wait for a save: the first one says what will
happen, and a second one takes SIGINT's default action, which ends the process at once, also in
the middle of a C call where no Python handler would run. torchrun's agent forwards a signal to
its workers only once, so a second SIGINT reaches a worker only when something signals it directly.
"""

from __future__ import annotations

import os
import signal

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
NOTICE = ("plait: SIGINT: stopping after this step (saving it where checkpoint.folder is set); "
          "Ctrl-C again to stop at once, without saving\n")


def handled() -> tuple[signal.Signals, ...]:
    """SIGNALS but those this process was started ignoring, which stay ignored: `nohup` ignores
    SIGHUP so that a run outlives its terminal, a shell ignores SIGINT in its background jobs."""
    return tuple(sig for sig in SIGNALS if signal.getsignal(sig) != signal.SIG_IGN)


class Preempted(Exception):
    """The run stopped early on a signal, after saving (or saying why it could not)."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum  # the shell's code for "ended by this signal": not a finished run


class Preemption:
    def __init__(self, device: torch.device):
        self.signum = 0
        self.flag = torch.zeros(1, device=device)
        self.previous = {sig: signal.signal(sig, self._record) for sig in handled()}

    def _record(self, signum, frame) -> None:
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            if os.environ.get("RANK", "0") == "0":
                os.write(2, NOTICE.encode())  # not print: the interrupted code may be inside one
        self.signum = self.signum or signum

    def agree(self) -> None:
        """All-reduce (MAX) the signal number this rank received (0: none) over every rank."""
        self.flag.fill_(self.signum)
        dist.all_reduce(self.flag, op=dist.ReduceOp.MAX)

    def agreed_signal(self) -> int:
        """After `agree`: the largest signal number any rank had received (0: none)."""
        return int(self.flag.item())

    def close(self) -> None:
        """The handlers as they were, SIGINT's too unless a first Ctrl-C came: a second one while
        the run closes still ends it at once (a KeyboardInterrupt there printed that nothing was
        saved, after the step's save)."""
        for sig, handler in self.previous.items():
            if not (sig == signal.SIGINT and signal.getsignal(sig) == signal.SIG_DFL):
                signal.signal(sig, handler)
