"""Each rank's last collectives, for a job that hangs: torch's flight recorder (a ring buffer of
the last BUFFER collectives of every process group, with sequence number, op, sizes, dtypes,
state and the Python stack that called it; NCCL and gloo both record in torch 2.13) switched on
before the process group exists, and dumped into the job's folder (`collectives/rank-R.json`)

- on a collective timeout, by each rank that timed out, which asks every other rank to (through
  the job's store, which each rank's thread looks at every second) and, once its error line is out,
  waits for their dumps before it exits (the store may live in it), and
- on SIGUSR1 or SIGUSR2, by every rank that receives it, even one whose main thread is stuck in a
  collective: Python's C-level signal handler writes the signal's number to a wakeup socket from
  whichever thread the signal lands on, and a thread of ours reads it and dumps. (SIGUSR1 is
  also preemption's: the run then saves and stops as before; SIGUSR2 only dumps.)

`plait why-hung FOLDER` (plait/why_hung.py) reads the dumps.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import select
import signal
import socket
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch.distributed as dist

BUFFER = 2000  # collectives kept per rank (an FSDP2 step of a large model calls a few hundred)
DUMPED_ON = (signal.SIGUSR1, signal.SIGUSR2)
ASKED, DUMPED = "plait/collectives/asked", "plait/collectives/dumped/"  # the store's keys
POLL_S, ASK_S = 1.0, 30.0  # how often a rank looks whether it is asked; how long the asking rank waits


def record() -> None:
    """Before the process group exists (the recorder is set up with it); a user's size is kept."""
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(BUFFER))


def trace(stacks: bool) -> dict | None:
    """This rank's recorder: its collectives (with their Python stacks); None where it has none."""
    from torch._C._distributed_c10d import _dump_fr_trace

    try:
        return pickle.loads(_dump_fr_trace(True, stacks, False))
    except RuntimeError:  # (no process group, or a recorder of size 0)
        return None


def dump(folder: Path, why: str) -> Path | None:
    """This rank's recorder, with its rank, host and why, as JSON in `folder`/collectives."""
    if (recorded := trace(stacks=True)) is None:
        return None
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    path = folder / "collectives" / f"rank-{rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    row = {"rank": rank, "host": socket.gethostname(), "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
           "world_size": dist.get_world_size() if dist.is_initialized() else 1, "why": why, "time_ns": time.time_ns(),
           "trace": recorded}
    part = path.with_suffix(".part")
    part.write_text(json.dumps(row, default=str))
    part.replace(path)  # (a reader never sees half a dump)
    return path


class Recorder:
    """A thread that dumps this rank's collectives into `folder` when SIGUSR1 or SIGUSR2 arrives,
    or when another rank asks (`ask_all`: a key in the job's store, looked at every POLL_S).
    Created in the main thread (set_wakeup_fd); a signal gets a no-op Python handler where it has
    none, so that it wakes the thread instead of ending the process."""

    def __init__(self, folder: Path):
        self.folder, self.answered, self.handlers = folder, None, {}
        self.reader, self.writer = socket.socketpair()
        self.writer.setblocking(False)
        self.previous = None
        if threading.current_thread() is threading.main_thread():  # (signals are the main thread's to set)
            for sig in DUMPED_ON:
                if signal.getsignal(sig) in (signal.SIG_DFL, None):  # (SIGUSR1 is preemption's already)
                    self.handlers[sig] = signal.signal(sig, lambda signum, frame: None)
            self.previous = signal.set_wakeup_fd(self.writer.fileno(), warn_on_full_buffer=False)
        self.store = dist.distributed_c10d._get_default_store() if dist.is_initialized() else None
        self.thread = threading.Thread(target=self._run, name="plait-collectives", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            if select.select([self.reader], [], [], POLL_S)[0]:
                data = self.reader.recv(64)
                if not data:  # closed
                    return
                if names := [signal.Signals(b).name for b in data if b in DUMPED_ON]:
                    self._dump(f"signal {'/'.join(names)}")
            elif self.store is not None:
                try:
                    if self.store.check([ASKED]) and (why := self.store.get(ASKED).decode()) != self.answered:
                        self.answered = why
                        self._dump(why)
                        self.store.set(f"{DUMPED}{dist.get_rank()}", why)
                except Exception:  # a store whose host has gone (rank 0 exited): asked no more, and said
                    self.store = None  # once (each try of a dead TCPStore logs a C++ warning of its own)

    def _dump(self, why: str) -> None:
        try:
            dump(self.folder, why)
        except OSError as e:  # (a full disk: said, and the run goes on)
            print(f"plait: the collectives' dump ({why}) could not be written to {self.folder}: {e}", file=sys.stderr,
                  flush=True)

    def ask_all(self, why: str) -> Callable[[], None]:
        """Dump here and ask every rank to; returns what waits (up to ASK_S) until each has, to be
        called once the error is said (a rank that is dead or stopped never answers)."""
        self._dump(why)
        if self.store is None:
            return lambda: None
        self.answered = why
        self.store.set(ASKED, why)
        self.store.set(f"{DUMPED}{dist.get_rank()}", why)
        keys, store = [f"{DUMPED}{r}" for r in range(dist.get_world_size())], self.store

        def wait() -> None:
            with contextlib.suppress(Exception):  # (past ASK_S: the dumps that came are what there is)
                store.wait(keys, timedelta(seconds=ASK_S))
        return wait

    def close(self) -> None:
        if self.previous is not None:
            signal.set_wakeup_fd(self.previous)
        for sig, handler in self.handlers.items():
            signal.signal(sig, handler)
        self.writer.close()  # (the thread dumps what is pending, its recv returns b"" and it ends)
        self.thread.join()
        self.reader.close()
