"""Ctrl-C (SIGINT), SIGHUP and SIGQUIT stop a run as SIGTERM does (tests/test_resilience.py):
the step is finished and saved, one line says so, the exit code is 128 + the signal; a second
Ctrl-C stops at once; `plait train --nproc` passes the signal to its job and waits for it, so no
process is left behind. Every wait here is for something the job does (a line, its end), never
for a time: a busy machine makes them slower, not different (a timeout is a hang guard only)."""

import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from contextlib import suppress
from pathlib import Path

import pytest

from conftest import ROOT, TINY, descendants

pytestmark = pytest.mark.slow
ENDLESS = ["--training.steps", "100000", "--metrics.log_interval", "1"]
HANG = 600  # a hang guard, not a measure: how long a job that does nothing more is waited for
# its sitecustomize.py, with PLAIT_HOLD, holds a rank's step after a first Ctrl-C until a signal ends it
INJECT = ROOT / "tests" / "inject"
# torchrun's agent waits for its workers as long as they take to stop (by default it sends SIGKILL
# 30 s after the signal: a cluster's grace period, not what is tested here): only plait ends them.
AGENT = {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(100 * HANG)}
TORCHRUN_LOG = re.compile(r"[DIWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\] ")  # torchrun's agent's own lines


def as_in_a_terminal() -> None:
    """SIGINT, SIGQUIT and SIGHUP at their default action, as a terminal's foreground job has
    them: a test suite run in the background (`pytest &` in a script, `nohup`) passes them on
    ignored, and a run keeps a signal it was started ignoring ignored (the last test here)."""
    for signum in (signal.SIGINT, signal.SIGQUIT, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)


class Job:
    """`plait train` in a process group of its own, its output read by a thread (a job whose
    processes outlive the launcher keeps the pipe open: reading must never block the test)."""

    def __init__(self, folder: Path, *args: str, nproc: int = 1, prefix: tuple[str, ...] = (), env: dict | None = None):
        launcher = ["--nproc", str(nproc)] if nproc > 1 else []
        command = [*prefix, sys.executable, "-m", "plait", "train", *launcher, *TINY, *ENDLESS,
                   "--checkpoint.folder", str(folder), "--checkpoint.interval", "100000", *args]
        self.proc = subprocess.Popen(command, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                     env={**os.environ, **AGENT, **(env or {})}, preexec_fn=as_in_a_terminal)
        self.lines: list[str] = []
        self.ended = False  # the output's end: no process of the job holds it any more
        self.more = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        # pid: a pidfd, of every process of the job seen. A pidfd names the process itself, never one
        # that reuses its pid, and polls readable once it has ended (exited: a zombie counts).
        self.processes: dict[int, int] = {}

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self.more:
                self.lines.append(line)
                self.more.notify_all()
        with self.more:
            self.ended = True
            self.more.notify_all()

    def wait_for(self, start: str) -> None:
        """Until the job prints a line starting with `start`; then notes its processes."""
        def printed():
            return any(line.startswith(start) for line in self.lines)

        with self.more:
            self.more.wait_for(lambda: printed() or self.ended, timeout=HANG)
            assert printed(), f"no {start!r} {'before the output ended' if self.ended else f'in {HANG} s'}:\n{self.output}"
        self.see()

    def see(self) -> None:
        for pid in [self.proc.pid, *descendants(self.proc.pid)]:
            if pid not in self.processes:
                with suppress(ProcessLookupError):
                    self.processes[pid] = os.pidfd_open(pid)

    def alive(self, within: float = 0) -> list[int]:
        """Those of the job's processes seen that are still running, each waited for up to `within` s
        (an exiting process closes its files, the output's pipe among them, before it has ended)."""
        deadline = time.monotonic() + within
        return [pid for pid, fd in self.processes.items()
                if not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]]

    def end(self) -> tuple[int | None, list[int]]:
        """(the exit code, None if it hung; the job's processes still running when it returned);
        then kills what is left and reads the job's output to its end."""
        self.see()  # (those started since the last line waited for)
        try:
            code = self.proc.wait(timeout=HANG)
        except subprocess.TimeoutExpired:
            code = None
        left = self.alive()
        for pid in left:  # orphans are in sessions of their own: one by one
            with suppress(ProcessLookupError):
                signal.pidfd_send_signal(self.processes[pid], signal.SIGKILL)
        self.proc.wait()
        self.reader.join(HANG)  # the last lines: the pipe ends when the last process holding it has
        for fd in self.processes.values():
            os.close(fd)
        self.processes.clear()
        return code, left

    @property
    def output(self) -> str:
        return "".join(self.lines)


def stopped_line(out: str, name: str, folder: Path) -> int:
    """The step of the one line a stopped run ends with (torchrun's agent may log its own after
    it: those lines are not the run's); checks its words and its saved folder."""
    last = [line for line in out.strip().splitlines() if not TORCHRUN_LOG.match(line)][-1]
    assert last.startswith(f"plait: stopped on {name} after step "), out[-3000:]
    step = int(last.split("after step ")[1].split(":")[0])
    assert last.endswith(f"saved {folder / f'step-{step}'}; run the same command again to resume from it"), last
    assert (folder / f"step-{step}" / "plait.json").exists()
    return step


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGQUIT])
def test_ctrl_c_saves_the_step_in_one_line(tmp_path, signum):
    """One process, the signal to its process group (Ctrl-C, Ctrl-\\ in a terminal) after step 3."""
    folder = tmp_path / "ckpt"
    job = Job(folder)
    try:
        job.wait_for("step     3")
        os.killpg(job.proc.pid, signum)
    finally:
        code, left = job.end()
    out = job.output
    assert code == 128 + signum and not left and "Traceback" not in out, out[-3000:]
    assert stopped_line(out, signal.Signals(signum).name, folder) > 3


@pytest.mark.parametrize("signum,whom", [(signal.SIGHUP, "launcher"), (signal.SIGINT, "group")])
def test_a_signal_to_the_launcher_stops_the_job_and_leaves_nothing_behind(tmp_path, signum, whom):
    """`plait train --nproc 2`: SIGHUP to the launcher alone (a closed terminal, `kill -HUP`), or
    SIGINT to its process group (Ctrl-C: the launcher; torchrun's agent and the workers are in
    sessions of their own, told by the launcher). The workers save, and the launcher returns once
    they are gone: none is left when it has."""
    folder = tmp_path / "ckpt"
    job = Job(folder, nproc=2)
    try:
        job.wait_for("step     3")
        (os.kill if whom == "launcher" else os.killpg)(job.proc.pid, signum)
    finally:
        code, left = job.end()
    out = job.output
    assert not left, f"processes left behind by the launcher: {left}\n{out[-3000:]}"
    assert code == 128 + signum and "Traceback" not in out, out[-3000:]
    assert stopped_line(out, signal.Signals(signum).name, folder) > 3


def test_a_sigkill_to_the_launcher_s_process_group_ends_the_whole_job(tmp_path):
    """SIGKILL to `plait train --nproc 2`'s process group (a timeout, an IDE's stop) reaches only
    the launcher: torchrun's agent and the workers, in sessions of their own, end because it did
    (their parent-death signal), so none goes on saving into the folder the next run resumes from.
    Waited for by the output's end: the pipe closes when the last process holding it has ended."""
    job = Job(tmp_path / "ckpt", nproc=2)
    try:
        job.wait_for("step     3")
        os.killpg(job.proc.pid, signal.SIGKILL)
        job.proc.wait()
        job.reader.join(HANG)
        left = job.alive(within=HANG)
        assert job.ended and left == [], f"left running: {left}\n{job.output[-3000:]}"
    finally:
        job.end()


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_second_ctrl_c_stops_at_once(tmp_path, nproc):
    """Ctrl-C after step 2, then Ctrl-C again once the first one's notice is out, the step it
    would finish held until then (tests/inject): nothing is saved, no line says the run was saved,
    no process is left when the job has returned; one process dies of the signal (exit -2: it
    ran no more Python), the launcher kills its job and returns 128 + 2."""
    folder = tmp_path / "ckpt"
    path = os.pathsep.join(filter(None, [str(INJECT), os.environ.get("PYTHONPATH")]))
    job = Job(folder, nproc=nproc, env={"PLAIT_HOLD": "1", "PYTHONPATH": path})
    try:
        job.wait_for("step     2")
        os.killpg(job.proc.pid, signal.SIGINT)
        job.wait_for("plait: SIGINT:")
        os.killpg(job.proc.pid, signal.SIGINT)
    finally:
        code, left = job.end()
    out = job.output
    assert code == (-signal.SIGINT if nproc == 1 else 128 + signal.SIGINT), out[-3000:]
    assert not left and "plait: stopped on" not in out and "Traceback" not in out, out[-3000:]
    assert not list(folder.glob("step-*/plait.json"))


def test_a_signal_the_run_was_started_ignoring_stays_ignored(tmp_path):
    """`nohup plait train --nproc 2`: SIGHUP (its terminal closing; here sent to every process)
    passes the launcher, torchrun's agent and the workers by; SIGTERM still stops the job."""
    folder = tmp_path / "ckpt"
    job = Job(folder, nproc=2, prefix=("nohup",))
    try:
        job.wait_for("step     3")
        for pid in job.alive():
            os.kill(pid, signal.SIGHUP)
        job.wait_for("step     8")
        os.kill(job.proc.pid, signal.SIGTERM)
    finally:
        code, left = job.end()
    out = job.output
    assert not left and code == 128 + signal.SIGTERM and "Traceback" not in out, out[-3000:]
    assert stopped_line(out, "SIGTERM", folder) > 8
