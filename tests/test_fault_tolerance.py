"""Replica groups under torchft (fault_tolerance.*): the groups train as HSDP does, and a group
that dies mid-run leaves the others training, comes back, heals and ends bitwise equal to them.

Both runs go through the user's path: `plait train --nproc 2 --fault_tolerance.enable` starts a
lighthouse and two groups, each torchrun with two FSDP2 ranks."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import ROOT, STEPS, TINY, layout_run, losses, max_abs_diff
from plait.checkpoint.offline import load_full_state_dict
from plait.cli import main
from plait.launch import descendants
from plait.models.flavors import model_args
from plait.proof.replica_soak import rows
from plait.proof.soak import workers

pytest.importorskip("torchft")

GROUPS = ["--fault_tolerance.enable", "--fault_tolerance.groups", "2"]


def train_groups(out: Path, *args: str, timeout: float = 300) -> subprocess.Popen:
    command = [sys.executable, "-m", "plait", "train", *TINY, "--nproc", "2", *GROUPS, "--metrics.jsonl",
               str(out / "metrics.jsonl"), *args]
    return subprocess.Popen(command, cwd=ROOT, stdout=open(out / "log.txt", "w"), stderr=subprocess.STDOUT)


@pytest.mark.parametrize("flags, message", [
    (["--fault_tolerance.replica_id", "2"], "fault_tolerance.replica_id: 2 must be in [0, groups=2)"),
    (["--fault_tolerance.min_replicas", "3"], "fault_tolerance.min_replicas: 3 must be in [1, groups=2]"),
    (["--parallelism.dp_backend", "ddp"], "allowed inside a group: dp_backend fsdp2"),
    (["--parallelism.dp_replicate", "1", "--parallelism.pp", "2", "--nproc", "2"], "pp 2"),
], ids=["replica_id", "min_replicas", "ddp", "pp"])
def test_bad_fault_tolerance_options_fail_at_start_up_naming_the_option(flags, message, capsys):
    assert main(["train", *TINY, *GROUPS, *flags]) == 2
    assert message in capsys.readouterr().err


def test_a_group_without_a_lighthouse_is_refused_before_any_process_group(monkeypatch, capsys):
    """Under torchrun (RANK set) a group has nobody to start a lighthouse: it must be given one, and
    one that answers (only rank 0 talks to it: the others would wait for it until a timeout)."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    assert main(["train", *TINY, *GROUPS]) == 2
    assert "fault_tolerance.lighthouse: the groups need a lighthouse" in capsys.readouterr().err
    with socket.socket() as unused:  # a port nobody listens on once this closes
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    assert main(["train", *TINY, *GROUPS, "--fault_tolerance.lighthouse", f"http://127.0.0.1:{port}"]) == 2
    assert f"fault_tolerance.lighthouse: http://127.0.0.1:{port} does not answer" in capsys.readouterr().err


@pytest.mark.slow
def test_two_groups_of_two_fsdp2_ranks_train_as_hsdp_2x2_and_a_whole_job_restart_resumes_exactly(tmp_path,
                                                                                                  train_once):
    """With every group in every step, the groups are HSDP's replicas: each unit's reduce-scattered
    gradient averaged across groups by torchft, where HSDP all-reduces it over dp_replicate.
    Bound: the HSDP row's own against one device (1e-6, fp32 reordered sums: the groups' average
    is summed by torchft, then divided; measured 4.8e-7). With the default min_replicas (1): a
    job's first quorum waits for every group, whichever starts first.
    Then the whole job again, as after losing every group: each group resumes from its own
    step-3 checkpoint (step 6's moved away), both resume together (not each alone, as a quorum
    of one would let them) and repeat steps 4-6 bit for bit, ending with the uninterrupted
    run's weights."""
    saves = ["--checkpoint.folder", str(tmp_path / "ck"), "--checkpoint.interval", "3"]
    job = train_groups(tmp_path, "--training.steps", "6", *saves)
    assert job.wait(timeout=300) == 0, (tmp_path / "log.txt").read_text()[-4000:]
    hsdp = losses(layout_run(train_once, "hsdp_w4")[0])
    for group in (0, 1):
        assert [row["replicas"] for row in rows(tmp_path, group)] == [2] * 6
        assert max_abs_diff(losses(rows(tmp_path, group)), hsdp) <= 1e-6
        shutil.move(tmp_path / "ck" / f"group-{group}" / "step-6", tmp_path / f"uninterrupted-{group}")
    again = tmp_path / "again"
    again.mkdir()
    job = train_groups(again, "--training.steps", "6", *saves)
    assert job.wait(timeout=300) == 0, (again / "log.txt").read_text()[-4000:]
    args = model_args("debug", 512)
    for group in (0, 1):
        resumed = rows(again, group)
        assert [(row["step"], row["replicas"]) for row in resumed] == [(4, 2), (5, 2), (6, 2)]
        assert losses(resumed) == losses(rows(tmp_path, group))[3:]
        final = load_full_state_dict(tmp_path / "ck" / f"group-{group}" / "step-6", args, "checkpoint")
        before = load_full_state_dict(tmp_path / f"uninterrupted-{group}", args, "checkpoint")
        assert final.keys() == before.keys()
        assert all(torch.equal(final[name], before[name]) for name in final)


@pytest.mark.slow
def test_a_group_that_starts_alone_waits_for_the_others_then_trains_alone(tmp_path):
    """Group 0 of 2 started alone (the other never comes): its first quorum waits for every group
    up to quorum_timeout_seconds, saying so, then it trains alone (min_replicas 1) to the end."""
    from plait.lighthouse import start

    server = start(min_replicas=1)
    try:
        job = subprocess.run([sys.executable, "-m", "plait", "train", *TINY, *GROUPS, "--training.steps", "2",
                              "--fault_tolerance.replica_id", "0", "--fault_tolerance.lighthouse", server.address(),
                              "--fault_tolerance.quorum_timeout_seconds", "1", "--metrics.jsonl",
                              str(tmp_path / "metrics.jsonl")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    finally:
        server.shutdown()
    assert job.returncode == 0, job.stderr[-4000:]
    assert "replica group 0 waits for every replica group at its first step (1 of 2 here" in job.stdout
    assert "replica group 0: 1 of 2 groups came within 1 s (fault_tolerance.quorum_timeout_seconds)" in job.stdout
    assert [(row["step"], row["replicas"]) for row in rows(tmp_path, 0)] == [(1, 1), (2, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("inside, row, bound", [
    (["--parallelism.dp_shard", "1", "--parallelism.tp", "2"], "ddp_tp", 0.0),
    (["--parallelism.dp_shard", "1", "--parallelism.cp", "2"], "cp_fsdp2", 1e-6),
    (["--model.flavor", "debug_moe", "--parallelism.ep", "2"], "ep2_hsdp_moe", 1e-6),
], ids=["tp", "cp", "ep"])
def test_a_layout_inside_each_group_trains_as_its_replicated_row(tmp_path, train_once, inside, row, bound):
    """Each group's own layout, two groups of two ranks, against the parity matrix's world-4 row
    that replicates it. TP2: DDP2 x TP2 bit for bit (the groups' average is one sum of two
    gradients halved, as DDP's all-reduce of two). CP2: FSDP2 over dp_shard 2 x cp 2 shards 4 ways
    where each group shards 2 ways (fp32 sums reordered: 4.8e-7 measured, the HSDP row's 1e-6).
    EP2 over FSDP2(2): HSDP 2x2 with EP2, the experts' gradients averaged too (4.8e-7 measured)."""
    job = train_groups(tmp_path, *STEPS, "--fault_tolerance.min_replicas", "2", *inside)
    assert job.wait(timeout=300) == 0, (tmp_path / "log.txt").read_text()[-4000:]
    for group in (0, 1):
        assert max_abs_diff(losses(rows(tmp_path, group)), losses(layout_run(train_once, row)[0])) <= bound


@pytest.mark.slow
def test_the_cross_group_average_runs_in_the_reduce_dtype_asked(tmp_path):
    """Groups of one rank: fully_shard at degree 1 reduces nothing itself, so every backward
    all-reduce is torchft's cross-group average, one per FSDP2 unit (debug: 2 blocks and the
    root), in bf16 as mixed_precision_reduce asks."""
    probe = tmp_path / "probe.json"
    job = subprocess.run([sys.executable, "-m", "plait", "train", *TINY, *GROUPS, "--training.steps", "1",
                          "--fault_tolerance.min_replicas", "2", "--training.mixed_precision_reduce", "bfloat16",
                          "--debug.dtype_probe", str(probe)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert job.returncode == 0, job.stderr[-4000:]
    for group in (0, 1):
        records = json.loads((tmp_path / f"probe.group-{group}.json").read_text())
        reduced = [(r["op"], r["dtypes"], r["count"]) for r in records
                   if r["phase"] == "backward" and r["kind"] == "collective"]
        assert reduced == [("allreduce_", "bfloat16", 3)]


def kill_rank(job: subprocess.Popen, group: int, rank: int) -> None:
    """SIGKILL `rank` of replica group `group` (a torchrun worker below the launcher)."""
    ranks = workers(job.pid, f"replica_id\0{group}\0", f"\0RANK={rank}\0")
    assert ranks, f"no rank {rank} of group {group} below {job.pid}"
    os.kill(ranks[0], signal.SIGKILL)


@pytest.mark.slow
def test_a_killed_group_leaves_the_other_training_then_heals_and_ends_bitwise_equal(tmp_path):
    """SIGKILL rank 1 of group 1 once both groups have taken part in step 5. Group 0 goes on
    (alone, replicas 1, once the lighthouse gives up on group 1) while torchrun restarts group 1
    (--max_restarts 1), which heals from group 0 at its first quorum and trains with it again
    (replicas 2): the first checkpoint both groups save after the heal holds the same weights, bit
    for bit. The run has more steps than it could finish: the test ends it once both groups saved
    that checkpoint, so however long the restart takes here, group 0 is still training."""
    interval = 20
    job = train_groups(tmp_path, "--training.steps", "1000000", "--max_restarts", "1", "--checkpoint.folder",
                       str(tmp_path / "ck"), "--checkpoint.interval", str(interval))

    def wait_for(event) -> None:  # (a hang guard only: minutes, never part of what is asserted)
        deadline = time.monotonic() + 600
        while not event():
            assert job.poll() is None and time.monotonic() < deadline, (tmp_path / "log.txt").read_text()[-4000:]
            time.sleep(0.05)

    try:
        wait_for(lambda: any(row["step"] >= 5 and row["replicas"] == 2 for row in rows(tmp_path, 1)))
        kill_rank(job, group=1, rank=1)
        wait_for(lambda: "healed from a live replica group" in (tmp_path / "log.txt").read_text())
        wait_for(lambda: rows(tmp_path, 1) != [])  # (the restarted group's metrics begin where it healed)
        healed_at = rows(tmp_path, 1)[0]["step"]
        saved = interval * (healed_at // interval + 1)  # the first save after the heal
        wait_for(lambda: all((tmp_path / "ck" / f"group-{g}" / f"step-{saved}" / "plait.json").is_file() for g in (0, 1)))
    finally:
        for pid in [*descendants(job.pid), job.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        job.wait()
    log = (tmp_path / "log.txt").read_text()
    first = rows(tmp_path, 0)
    # Group 0 never stopped: every step from its first (1, or the one it healed at where group 1 started first)
    assert [row["step"] for row in first] == list(range(first[0]["step"], first[-1]["step"] + 1))
    assert healed_at > 5 and f"healed from a live replica group: continuing at step {healed_at}" in log
    # From the step both groups first took part (the first group up trains alone until the other
    # heals in) until the kill (group 1 may finish a step or two after it was seen at step 5) both
    # took part; then group 0 trained alone, unless group 1 was back before the lighthouse gave up
    # on it (5 s): then group 0's next quorum waited for it instead
    joined = next(row["step"] for row in first if row["replicas"] == 2)
    before_heal = [row["replicas"] for row in first if joined <= row["step"] < healed_at]
    assert before_heal == sorted(before_heal, reverse=True) and set(before_heal) <= {1, 2}
    assert all(row["replicas"] == 2 for row in first if healed_at <= row["step"] <= saved)
    args = model_args("debug", 512)
    weights = [load_full_state_dict(tmp_path / "ck" / f"group-{g}" / f"step-{saved}", args, "checkpoint")
               for g in (0, 1)]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][name], weights[1][name]) for name in weights[0])
    shutil.rmtree(tmp_path / "ck")  # (a checkpoint every 20 steps of group 0's many: not kept for pytest's history)
