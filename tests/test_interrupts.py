"""Ctrl-C (SIGINT), SIGHUP and SIGQUIT stop a run as SIGTERM does (tests/test_resilience.py):
the step is finished and saved, one line says so, the exit code is 128 + the signal; a second
Ctrl-C stops at once; `plait train --nproc` passes the signal to its job and waits for it, so no
process is left behind."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import ROOT, TINY, descendants
from plait.cli import alive

pytestmark = pytest.mark.slow
ENDLESS = ["--training.steps", "100000", "--metrics.log_interval", "1"]
SLOW_STEPS = ["--training.global_batch_size", "64", "--training.seq_len", "128"]  # ~1 s: room for a second Ctrl-C
GRACE = 30  # as in test_resilience: what torchrun's agent and Slurm give a job before SIGKILL


class Job:
    """`plait train` in a process group of its own, its output read by a thread (a job whose
    processes outlive the launcher keeps the pipe open: reading must never block the test)."""

    def __init__(self, folder: Path, *args: str, nproc: int = 1, prefix: tuple[str, ...] = ()):
        launcher = ["--nproc", str(nproc)] if nproc > 1 else []
        command = [*prefix, sys.executable, "-m", "plait", "train", *launcher, *TINY, *ENDLESS,
                   "--checkpoint.folder", str(folder), "--checkpoint.interval", "100000", *args]
        self.proc = subprocess.Popen(command, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True).start()
        self.everyone: list[int] = []

    def wait_for(self, start: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not any(line.startswith(start) for line in self.lines):
            assert time.monotonic() < deadline and self.proc.poll() is None, f"no {start!r} in:\n{self.output}"
            time.sleep(0.01)
        self.everyone = sorted({*self.everyone, self.proc.pid, *descendants(self.proc.pid)})

    def end(self) -> tuple[int | None, float]:
        """(the exit code, seconds until every process of the job was gone); kills what is left."""
        begin = time.monotonic()
        try:
            code = self.proc.wait(timeout=GRACE)
        except subprocess.TimeoutExpired:
            code = None
        while any(alive(pid) for pid in self.everyone) and time.monotonic() - begin < GRACE:
            time.sleep(0.05)
        seconds = time.monotonic() - begin
        for pid in self.everyone:  # orphans (today's bug) are in sessions of their own: one by one
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait()
        time.sleep(0.2)  # the reader's last lines
        return code, seconds

    @property
    def output(self) -> str:
        return "".join(self.lines)


def stopped_line(out: str, name: str, folder: Path) -> int:
    """The step of the one line a stopped run ends with; checks its words and its saved folder."""
    last = out.strip().splitlines()[-1]
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
        code, _ = job.end()
    out = job.output
    assert code == 128 + signum and "Traceback" not in out, out[-3000:]
    assert stopped_line(out, signal.Signals(signum).name, folder) > 3


@pytest.mark.parametrize("signum,whom", [(signal.SIGHUP, "launcher"), (signal.SIGINT, "group")])
def test_a_signal_to_the_launcher_stops_the_job_and_leaves_nothing_behind(tmp_path, signum, whom):
    """`plait train --nproc 2`: SIGHUP to the launcher alone (a closed terminal, `kill -HUP`), or
    SIGINT to its process group (Ctrl-C: the launcher and torchrun's agent; the workers are in
    sessions of their own). The workers save, and the launcher returns once they are gone."""
    folder = tmp_path / "ckpt"
    job = Job(folder, nproc=2)
    try:
        job.wait_for("step     3")
        (os.kill if whom == "launcher" else os.killpg)(job.proc.pid, signum)
    finally:
        code, seconds = job.end()
    out = job.output
    print(f"\n{signal.Signals(signum).name} to the {whom}: exit {code}, every process gone after {seconds:.1f}s")
    assert seconds < GRACE, f"processes left behind: {out[-3000:]}"
    assert code == 128 + signum and "Traceback" not in out, out[-3000:]
    assert stopped_line(out, signal.Signals(signum).name, folder) > 3


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_second_ctrl_c_stops_at_once(tmp_path, nproc):
    """Ctrl-C after step 2 (steps of ~1 s), then Ctrl-C again once the first one's notice is out:
    nothing more is saved, no line says the run was saved, every process is gone at once; exit
    130 (one process dies of the signal, the launcher kills its job and returns 128 + 2)."""
    folder = tmp_path / "ckpt"
    job = Job(folder, *SLOW_STEPS, nproc=nproc)
    try:
        job.wait_for("step     2")
        os.killpg(job.proc.pid, signal.SIGINT)
        job.wait_for("plait: SIGINT:", timeout=30)
        os.killpg(job.proc.pid, signal.SIGINT)
    finally:
        code, seconds = job.end()
    out = job.output
    print(f"\nsecond Ctrl-C, nproc {nproc}: exit {code}, every process gone after {seconds:.1f}s")
    assert code == (-signal.SIGINT if nproc == 1 else 128 + signal.SIGINT), out[-3000:]
    assert seconds < 10 and "plait: stopped on" not in out and "Traceback" not in out, out[-3000:]
    assert not list(folder.glob("step-*/plait.json"))


def test_a_signal_the_run_was_started_ignoring_stays_ignored(tmp_path):
    """`nohup plait train --nproc 2`: SIGHUP (its terminal closing) passes the launcher, torchrun's
    agent and the workers by; SIGTERM still stops the job."""
    folder = tmp_path / "ckpt"
    job = Job(folder, nproc=2, prefix=("nohup",))
    try:
        job.wait_for("step     3")
        os.killpg(job.proc.pid, signal.SIGHUP)
        job.wait_for("step     8")
        os.kill(job.proc.pid, signal.SIGTERM)
    finally:
        code, seconds = job.end()
    out = job.output
    assert seconds < GRACE and code == 128 + signal.SIGTERM and "Traceback" not in out, out[-3000:]
    assert stopped_line(out, "SIGTERM", folder) > 8
