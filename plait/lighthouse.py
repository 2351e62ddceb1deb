"""Where replica groups meet (fault_tolerance, plait/parallel/replica_groups.py): torchft's
lighthouse, which forms each step's quorum of the groups alive. `plait lighthouse` runs one for
groups started elsewhere (one torchrun job per group, on any machines that reach it); `plait train`
with fault_tolerance.enable and no lighthouse given starts one here and every group on this machine."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from dataclasses import dataclass

from plait.config import JobConfig
from plait.parallel.replica_groups import quiet_torchft
from plait.preemption import handled


def start(min_replicas: int, port: int = 0):
    quiet_torchft()
    from torchft.coordination import LighthouseServer

    return LighthouseServer(bind=f"[::]:{port}", min_replicas=min_replicas)


def launch_groups(argv: list[str], cfg: JobConfig) -> int:
    """A lighthouse, then fault_tolerance.groups copies of this `plait train` command, each its
    replica group (`--nproc` ranks under torchrun where nproc > 1 or max_restarts asks for it).
    The exit code: the first group's that failed, else 0."""
    ft = cfg.fault_tolerance
    server = start(ft.min_replicas)
    print(f"plait: lighthouse at {server.address()}: {ft.groups} replica groups of {cfg.nproc} rank(s), a step "
          f"needs {ft.min_replicas}", flush=True)
    jobs = [subprocess.Popen([sys.executable, "-m", "plait", "train", *argv, "--fault_tolerance.replica_id", str(i),
                              "--fault_tolerance.lighthouse", server.address()], start_new_session=True)
            for i in range(ft.groups)]  # (their own sessions: a terminal's Ctrl-C reaches them once, forwarded)
    for sig in handled():  # a preemption of the job is every group's: each saves and stops
        signal.signal(sig, lambda signum, frame: [job.send_signal(signum) for job in jobs if job.poll() is None])
    try:
        codes = [job.wait() for job in jobs]
    finally:
        server.shutdown()
    return next((code for code in codes if code), 0)


@dataclass
class LighthouseConfig:
    port: int = 29510
    """port to listen on (every address); groups reach it as http://THIS_HOST:PORT"""
    min_replicas: int = 1
    """a quorum needs at least this many replica groups"""


def serve(cfg: LighthouseConfig) -> int:
    """Run until SIGINT or SIGTERM."""
    server = start(cfg.min_replicas, cfg.port)
    print(f"plait: lighthouse at {server.address()} (min_replicas {cfg.min_replicas}): pass it to every group as "
          f"--fault_tolerance.lighthouse, or as $TORCHFT_LIGHTHOUSE", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.shutdown()
    return 0
