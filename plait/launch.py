"""`plait train --nproc N` on one machine: torchrun's agent started by plait, signals forwarded
to it once, each worker's exit code collected (torchrun's agent reports only its own), and every
process of the job ended with the launcher (the workers run in sessions of their own)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import time
import typing
from pathlib import Path


def end_worker(code: int) -> typing.NoReturn:
    """End a training process whose work is done: its files are written and closed and its
    process group destroyed (after a barrier). Under `plait train --nproc` its exit code is left
    for the launcher first (torchrun's agent reports only its own, which after a signal is 1
    whatever the workers did). The interpreter's teardown is skipped: torch 2.13's C++
    destructors at exit occasionally abort a gloo process ('terminate called without an active
    exception', exit -6; seen in about 1 of 40 world-2 runs here), which torchrun takes for a
    failed worker (and --max-restarts would restart a finished job)."""
    if folder := os.environ.get(EXIT_CODES):
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        Path(folder, f"{attempt}-rank-{os.environ.get('RANK', '0')}").write_text(str(code))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


EXIT_CODES = "PLAIT_EXIT_CODES"  # the folder where workers leave their exit codes for launch_local


def die_with_parent() -> None:
    """Under `plait train --nproc`: end this process (torchrun's agent, or a worker) when the one
    that started it dies. They run in sessions of their own, so a SIGKILL to the launcher's
    process group (a timeout, an IDE's stop) reaches none of them: left running, the job would go
    on saving into the folder the next run resumes from. (Linux's parent-death signal; elsewhere
    nothing.)"""
    parent = os.getppid()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent:  # (it died before the signal was set)
        os._exit(128 + signal.SIGKILL)


def launch_local(argv: list[str], nproc: int, max_restarts: int, subcommand: str = "train") -> int:
    """`plait train --nproc N` (or `plait doctor --nproc N`): the same job under torchrun on this
    machine, with the exit code one process would have: 128 + the signal after a preemption, 1
    after an error, 0 done."""
    # torchrun would read a passed-through `--nproc` as an abbreviation of its own option.
    worker_argv, skip = [], False
    for i, arg in enumerate(argv):
        if skip or arg.startswith("--nproc="):
            skip = False
            continue
        skip = arg == "--nproc"
        if not skip:
            worker_argv.append(arg)
    from plait.preemption import handled

    # The signals the workers handle: torchrun's agent handles SIGUSR1 too (by default it would
    # die of it before its workers save), and leaves one this process ignores ignored.
    signals = handled()
    command = [sys.executable, "-m", "plait.torchrun", "--standalone", f"--nproc-per-node={nproc}",
               f"--max-restarts={max_restarts}", f"--signals-to-handle={','.join(sig.name for sig in signals)}",
               "-m", "plait", subcommand, *worker_argv]
    with tempfile.TemporaryDirectory(prefix="plait-exit-") as codes:
        torchrun, signum = _run_forwarding_signals(command, {**os.environ, EXIT_CODES: codes}, signals)
        attempts: dict[int, list[int]] = {}
        for path in Path(codes).iterdir():
            attempts.setdefault(int(path.name.split("-")[0]), []).append(int(path.read_text()))
    return exit_code(torchrun, signum, attempts[max(attempts)] if attempts else [], nproc)


def _run_forwarding_signals(command: list[str], env: dict, signals: tuple[int, ...]) -> tuple[int, int]:
    """Run torchrun and wait for it and for the workers it had; a stopping signal meanwhile goes
    to its agent, which forwards it to the workers and, shutting down, never restarts them (a
    container runtime signals only this process, a closed terminal sends SIGHUP to it; repeats
    change nothing). A second Ctrl-C kills the job at once, as it ends one process. The agent
    runs in a session of its own, as its workers do: a terminal's Ctrl-C reaches it only from
    here, after this process has counted it, so a second Ctrl-C is never taken for a first one
    (both could reach this process before it had run its handler once). The handlers are in
    place before the agent starts: a signal while it starts is passed on as soon as it has (one
    before, and it never starts). Returns (torchrun's exit code, the signal: SIGINT after a
    second Ctrl-C, or 0)."""
    received: list[int] = []
    workers: list[int] = []
    job: list[subprocess.Popen] = []  # once started

    def act(n: int) -> None:
        """What the n-th signal received does to the started job."""
        signum, agent = received[n], job[0].pid
        if n == 0:
            workers.extend(descendants(agent))
            with contextlib.suppress(ProcessLookupError):
                os.kill(agent, signum)
        elif signum == signal.SIGINT and received[:n + 1].count(signal.SIGINT) == 2:
            for pid in [agent, *workers, *descendants(agent)]:  # the agent first: it sees no worker die
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def forward(signum, frame):
        received.append(signum)
        if job:
            act(len(received) - 1)

    previous = {sig: signal.signal(sig, forward) for sig in signals}
    try:
        if not received:
            job.append(subprocess.Popen(command, env=env, start_new_session=True))
            for n in range(len(received)):  # (those that came while it started; a repeat changes nothing)
                act(n)
            job[0].wait()
            # torchrun can return while its workers still save (a repeated signal ends its wait
            # early): the job ends when its last worker does.
            while any(alive(pid) for pid in workers):
                time.sleep(0.1)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return job[0].returncode if job else 0, signal.SIGINT if received.count(signal.SIGINT) > 1 else (received or [0])[0]


def exit_code(torchrun: int, signum: int, reported: list[int], nproc: int) -> int:
    """The job's exit code: torchrun's, unless a signal stopped it; then what the workers of the
    last attempt reported."""
    if not signum:
        return torchrun
    if errors := [c for c in reported if 0 < c < 128]:
        return errors[0]  # a save that failed on the way out, say: as one process would say
    if len(reported) == nproc and not any(reported):
        return 0  # the signal came after the last step: the job is done
    return 128 + signum


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (torchrun's workers are its children), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    found, stack = [], [pid]
    while stack:
        kids = children.get(stack.pop(), [])
        found += kids
        stack += kids
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited
