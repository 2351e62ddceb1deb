"""How a job dies on a cluster, and what it loses: nothing.

- Preemption: a scheduler's SIGTERM (or SIGUSR1) to the whole job at a random step: every rank
  finishes the step, one complete checkpoint of it is written, every process is gone within the
  grace period, and the restarted job reproduces the remaining steps bitwise.
- A save that fails (a full disk): one line, the older checkpoint intact, resumed bitwise.
- A hung rank: the others fail within comm.timeout_seconds, naming the collective and the step.
- A damaged checkpoint (a truncated or bit-flipped shard, a newer plait's format): one line at
  start-up, untouched.
"""

import json
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, TINY, descendants, losses, run_plait
from plait.launch import alive

pytestmark = pytest.mark.slow
STEPS = ["--training.steps", "12"]
FSDP2 = ["--parallelism.dp_shard", "2"]
GRACE = 30  # torchrun's agent sends SIGKILL 30 s after forwarding SIGTERM; so does Slurm's default KillWait


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    rows, _ = run_plait(tmp_path_factory.mktemp("straight"), *STEPS, *FSDP2, nproc=2)
    return losses(rows)


def start_until_step(command: list[str], step: int) -> tuple[subprocess.Popen, list[str]]:
    """Start `command` in a process group of its own; return once it printed step `step`'s line."""
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    out = []
    for line in proc.stdout:
        out.append(line)
        if line.startswith(f"step {step:5d}"):
            break
    return proc, out


def rank_pid(proc: subprocess.Popen, rank: int) -> int:
    [pid] = [p for p in descendants(proc.pid) if f"\0RANK={rank}\0" in "\0" + open(f"/proc/{p}/environ").read()]
    return pid


def signal_at_random_step(command: list[str], signum: int) -> tuple[int, str, int, float]:
    """Run `command` in a process group of its own; at a random step (3-8) send `signum` to the
    whole group, as a scheduler does. Returns (that step, the output, exit code, seconds to end)."""
    at = random.randint(3, 8)
    proc, out = start_until_step(command, at)
    try:
        everyone = [proc.pid, *descendants(proc.pid)]
        sent = time.perf_counter()
        os.killpg(proc.pid, signum)
        out += proc.stdout.readlines()
        code = proc.wait(timeout=GRACE)
        while any(alive(pid) for pid in everyone) and time.perf_counter() - sent < GRACE:
            time.sleep(0.1)
        return at, "".join(out), code, time.perf_counter() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.parametrize("launcher", ["plait", "torchrun"])
def test_sigterm_saves_the_step_and_the_restart_is_bitwise(tmp_path, uninterrupted, launcher):
    """Under `plait train --nproc 2` every step is a checkpoint step (interval 1): the signal's
    save finds the step saved already, on every rank alike. Exit codes: 128 + 15 from plait's
    launcher, 1 from a bare torchrun (its agent dies of a SignalException; docs/clusters.md)."""
    folder, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    interval = "1" if launcher == "plait" else "100"
    train = [*TINY, *STEPS, *FSDP2, "--checkpoint.folder", str(folder), "--checkpoint.interval", interval,
             "--metrics.log_interval", "1", "--metrics.jsonl", str(metrics)]
    start = [sys.executable, "-m", "plait", "train", "--nproc", "2"] if launcher == "plait" else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "plait", "train"]
    at, out, code, seconds = signal_at_random_step([*start, *train], signal.SIGTERM)
    done = [json.loads(line)["step"] for line in metrics.read_text().splitlines()][-1]
    print(f"\n{launcher}: SIGTERM at step {at}, saved step {done}, every process gone after {seconds:.1f}s")
    assert seconds < GRACE and code == (128 + signal.SIGTERM if launcher == "plait" else 1), out[-3000:]
    # The signal lands while a step after `at` runs: how many steps after depends on how long the
    # test took to read step `at`'s line (a busy machine: two or more). The step it lands in saves.
    assert at <= done < int(STEPS[-1])
    saved = range(1, done + 1) if launcher == "plait" else [done]
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith("step-")) == sorted(f"step-{s}" for s in saved)
    assert all((folder / f"step-{s}" / "plait.json").exists() for s in saved)
    assert "SaveFailed" not in out and "overwriting" not in out
    assert launcher == "torchrun" or "Traceback" not in out  # torchrun's agent prints its SignalException's
    assert f"plait: stopped on SIGTERM after step {done}: saved {folder / f'step-{done}'}" in out
    resumed, proc = run_plait(tmp_path, *STEPS, *FSDP2, "--checkpoint.folder", str(folder), nproc=2, metrics=metrics)
    assert f"resumed from {folder / f'step-{done}'}" in proc.stdout
    assert losses(resumed) == uninterrupted


def test_a_signal_on_the_last_step_exits_143_and_is_never_restarted(tmp_path):
    """SIGTERM to `plait train --nproc 2 --max-restarts 3` alone (a container runtime signals only
    the first process) while step 7 of 8 saves: the job stops after step 8, the last step and a
    checkpoint step, saved once, exits 128 + 15, and torchrun's agent restarts nothing."""
    folder = tmp_path / "c"
    command = [sys.executable, "-m", "plait", "train", "--nproc", "2", "--max-restarts", "3", *TINY,
               "--training.steps", "8", *FSDP2, "--checkpoint.folder", str(folder), "--checkpoint.interval", "1",
               "--metrics.log_interval", "1"]
    proc, out = start_until_step(command, 7)
    try:
        everyone = [proc.pid, *descendants(proc.pid)]
        sent = time.perf_counter()
        os.kill(proc.pid, signal.SIGTERM)
        out += proc.stdout.readlines()
        code = proc.wait(timeout=GRACE)
        seconds = time.perf_counter() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = "".join(out)
    assert code == 128 + signal.SIGTERM, out[-3000:]
    assert f"plait: stopped on SIGTERM after step 8: saved {folder / 'step-8'}" in out
    assert "will restart" not in out and "Traceback" not in out and "overwriting" not in out
    assert (folder / "step-8" / "plait.json").exists() and not any(alive(pid) for pid in everyone)
    print(f"\nSIGTERM to the launcher on the last step: exit {code}, every process gone after {seconds:.1f}s")


def test_the_launchers_exit_code_is_what_one_process_would_return():
    """(torchrun's code, the signal the launcher got, what the last attempt's workers reported)."""
    from plait.launch import exit_code

    term = 128 + signal.SIGTERM
    assert exit_code(1, 0, [1, 0], 2) == 1  # no signal: torchrun's verdict on its workers
    assert exit_code(1, signal.SIGTERM, [term, term], 2) == term  # preempted: torchrun says 1 regardless
    assert exit_code(1, signal.SIGTERM, [], 2) == term  # signalled before any worker could report
    assert exit_code(1, signal.SIGTERM, [term, 1], 2) == 1  # a rank's save failed on the way out
    assert exit_code(1, signal.SIGTERM, [0, 0], 2) == 0  # the signal came after the last step
    assert exit_code(1, signal.SIGTERM, [0], 2) == term  # one rank finished, the other never said


def test_sigusr1_without_a_checkpoint_folder_says_nothing_was_saved(tmp_path):
    # (SIGUSR1 also dumps the collectives beside the metrics: here, not into the repository)
    command = [sys.executable, "-m", "plait", "train", *TINY, *STEPS, "--metrics.log_interval", "1",
               "--metrics.jsonl", str(tmp_path / "metrics.jsonl")]
    at, out, code, _ = signal_at_random_step(command, signal.SIGUSR1)
    assert code == 128 + signal.SIGUSR1
    assert out.strip().splitlines()[-1].startswith("plait: stopped on SIGUSR1 after step ")
    assert "nothing saved (no checkpoint.folder)" in out


def test_a_failed_save_is_one_line_and_loses_nothing(tmp_path):
    """A file-size limit makes every write past 1 MiB fail as a full disk does (the checkpoint's
    shard is ~6 MiB): no mount needed, the same on every machine."""
    args, folder = ["--training.steps", "6", "--checkpoint.interval", "3"], ["--checkpoint.folder", str(tmp_path / "c")]
    straight, _ = run_plait(tmp_path, *args, *folder)
    shutil.rmtree(tmp_path / "c" / "step-6")  # back to the moment before the save that will fail
    limit = 2**20
    proc = subprocess.run([sys.executable, "-m", "plait", "train", *TINY, *args, *folder], cwd=ROOT, text=True,
                          capture_output=True, timeout=300,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"plait: error: checkpoint: saving {tmp_path / 'c' / 'step-6'} failed (") and \
        "a checkpoint of this job needs about 6 MiB" in last and "the checkpoints before it are intact" in last, last
    assert (tmp_path / "c/step-3/plait.json").exists() and not (tmp_path / "c/step-6/plait.json").exists()
    resumed, proc = run_plait(tmp_path, *args, *folder)
    assert f"resumed from {tmp_path / 'c' / 'step-3'}" in proc.stdout
    assert losses(resumed) == losses(straight)[3:]


def test_a_hung_rank_ends_the_job_naming_the_collective_and_the_step(tmp_path):
    """SIGSTOP: the rank neither answers nor dies. The other fails after comm.timeout_seconds with
    the line. torchrun would then give the stopped rank a fixed 30 s before SIGKILL (measured
    36-40 s to the end of the job; docs/clusters.md); the test resumes the rank instead of waiting that
    out, and the job ends at once."""
    timeout = 5
    command = [sys.executable, "-m", "plait", "train", "--nproc", "2", *TINY, "--training.steps", "1000",
               "--comm.timeout_seconds", str(timeout), "--metrics.log_interval", "1",
               "--metrics.jsonl", str(tmp_path / "metrics.jsonl")]  # (its collectives' dumps go beside it)
    proc, out = start_until_step(command, 3)
    try:
        hung = rank_pid(proc, 1)
        stopped = time.perf_counter()
        os.kill(hung, signal.SIGSTOP)
        for line in proc.stdout:
            out.append(line)
            if line.startswith("plait: error: step "):
                break
        seconds = time.perf_counter() - stopped
        os.kill(hung, signal.SIGCONT)
        out += proc.stdout.readlines()
        proc.wait(timeout=15)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    print(f"\nhung rank: the line came {seconds:.1f}s after SIGSTOP (comm.timeout_seconds={timeout})")
    errors = [line for line in out if line.startswith("plait: error: step ")]
    assert errors and f"did not complete within comm.timeout_seconds={timeout}: a rank stopped answering" in errors[0]
    assert "the collective " in errors[0] and proc.returncode != 0 and seconds < timeout + 5


def test_a_killed_rank_under_max_restarts_resumes_and_finishes_bitwise(tmp_path, uninterrupted):
    """`plait train --nproc 2 --max-restarts 1`: SIGKILL of rank 1 after step 5; torchrun brings the
    job back, it resumes from step-3 and its per-step losses equal the uninterrupted run's."""
    metrics = tmp_path / "m.jsonl"
    command = [sys.executable, "-m", "plait", "train", "--nproc", "2", "--max-restarts", "1", *TINY, *STEPS, *FSDP2,
               "--checkpoint.folder", str(tmp_path / "c"), "--checkpoint.interval", "3", "--metrics.log_interval", "1",
               "--metrics.jsonl", str(metrics)]
    proc, out = start_until_step(command, 5)
    try:
        os.kill(rank_pid(proc, 1), signal.SIGKILL)
        out += proc.stdout.readlines()
        assert proc.wait(timeout=180) == 0, "".join(out)[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert f"resumed from {tmp_path / 'c' / 'step-3'}" in "".join(out)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 13)) and losses(rows) == uninterrupted


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_agents_with_the_c10d_rendezvous_are_one_job(tmp_path, train_once):
    """Two torchrun agents of 2 ranks each, as two machines would run them (docs/clusters.md):
    one job of world 4, per-step losses bitwise those of one agent with 4 ranks (HSDP 2x2)."""
    from conftest import LAYOUTS, layout_run

    reference = losses(layout_run(train_once, "hsdp_w4")[0])
    port, metrics = free_port(), tmp_path / "m.jsonl"
    agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "plait-test",
             "-m", "plait", "train", *TINY, "--training.steps", "6", *LAYOUTS["hsdp_w4"][1], "--metrics.jsonl", str(metrics)]
    agents = [subprocess.Popen(agent, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True) for _ in range(2)]
    try:
        outputs = [a.communicate(timeout=240)[0] for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
    assert [a.returncode for a in agents] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    assert "HSDP" in "".join(outputs) and "dp_replicate': 2, 'dp_shard': 2" in "".join(outputs)
    assert losses([json.loads(line) for line in metrics.read_text().splitlines()]) == reference


def test_a_truncated_checkpoint_is_one_line_at_start_up_and_is_not_touched(tmp_path):
    folder = ["--checkpoint.folder", str(tmp_path / "c"), "--checkpoint.interval", "3"]
    run_plait(tmp_path, "--training.steps", "3", *folder)
    shard = tmp_path / "c" / "step-3" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-100])
    before = {p.name: p.read_bytes() for p in shard.parent.iterdir()}
    _, proc = run_plait(tmp_path, "--training.steps", "6", *folder, check=False)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"plait: error: checkpoint.folder: {shard} is truncated ({len(before[shard.name])} bytes), its checkpoint's "
        f"metadata needs {len(before[shard.name]) + 100} bytes: the checkpoint is damaged; move {shard.parent} away to "
        "resume from the one before it"]
    assert {p.name: p.read_bytes() for p in shard.parent.iterdir()} == before


def test_a_bit_flipped_shard_is_found_at_resume_and_is_not_touched(tmp_path):
    """Written by an asynchronous save at world 2 (digests hashed in the background); at resume
    rank 1 hashes __0_0.distcp (the files are shared out), and both ranks stop on its verdict."""
    folder = ["--checkpoint.folder", str(tmp_path / "c"), "--checkpoint.interval", "2", "--checkpoint.async_mode",
              "async", *FSDP2]
    run_plait(tmp_path, "--training.steps", "2", *folder, nproc=2)
    shard = tmp_path / "c" / "step-2" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x04  # one bit, in the middle of the tensors
    shard.write_bytes(data)
    before = {p.name: p.read_bytes() for p in shard.parent.iterdir()}
    _, proc = run_plait(tmp_path, "--training.steps", "4", *folder, nproc=2, check=False)
    line = (f"plait: error: checkpoint.folder: {shard} does not match the sha256 its manifest recorded at save time: "
            f"the checkpoint is damaged; move {shard.parent} away to resume from the one before it")
    assert proc.returncode != 0 and proc.stderr.count(line) == 2, proc.stderr[-3000:]  # once per rank
    assert "step     3" not in proc.stdout
    assert {p.name: p.read_bytes() for p in shard.parent.iterdir()} == before


def test_a_checkpoint_of_a_newer_format_is_one_line(tmp_path):
    folder = ["--checkpoint.folder", str(tmp_path / "c"), "--checkpoint.interval", "2"]
    run_plait(tmp_path, "--training.steps", "2", *folder)
    manifest = tmp_path / "c" / "step-2" / "plait.json"
    saved = json.loads(manifest.read_text())
    assert saved["format"] == 1 and saved["plait"]
    manifest.write_text(json.dumps({**saved, "format": 2, "plait": "9.0"}))
    _, proc = run_plait(tmp_path, "--training.steps", "4", *folder, check=False)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"plait: error: checkpoint.folder: {manifest.parent} was written by plait 9.0 in checkpoint format 2; this plait "
        f"({saved['plait']}) reads formats up to 1: upgrade plait to resume it"]
