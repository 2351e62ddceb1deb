"""A run that says what went wrong: loss spikes warned of, skipped or rolled back
(plait/stability.py), the first module of a non-finite value named (plait/nonfinite.py), the
rank a hung job waits for (plait/collectives.py, `plait why-hung`), and z-loss in a layout.

Faults are planted by tests/inject/sitecustomize.py (PLAIT_FAULT) in every process of the job.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from conftest import LAYOUTS, ROOT, STEPS, TINY, launch

INJECT = str(ROOT / "tests" / "inject")


def faulty(tmp_path, fault: str, nproc: int, *args: str):
    """`plait train` with `fault` planted; (metric rows, completed process)."""
    env = {"PLAIT_FAULT": fault, "PYTHONPATH": os.pathsep.join(filter(None, [INJECT, os.environ.get("PYTHONPATH")]))}
    metrics = tmp_path / "metrics.jsonl"
    proc = launch(["train", *TINY, *args, "--metrics.jsonl", str(metrics)], nproc, 300, env=env, forked=True)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    return rows, proc


def saved_state(folder) -> dict:
    dcp_to_torch_save(folder, folder.with_suffix(".pt"))
    return torch.load(folder.with_suffix(".pt"), weights_only=False)


def flat(state, prefix=""):
    if isinstance(state, dict):
        return {k: v for key, value in state.items() for k, v in flat(value, f"{prefix}{key}.").items()}
    return {prefix: state}


@pytest.mark.parametrize("policy", ["warn", "skip", "rollback"])
def test_a_spike_is_named_in_a_line_and_a_row_and_skip_and_rollback_undo_it(tmp_path, policy):
    """The last step's (22nd) loss x 1000, and its gradient, at world 2 (FSDP2): one line names the
    step, the values and their thresholds, its metrics row has them, and no other step is called
    a spike. skip: the weights and optimizer state saved after step 22 are bitwise those after
    step 21 (no update; every rank judged the same reduced values); rollback (checkpoints every 20
    steps): bitwise those of step 20 (step 21's update undone too); both while the schedule and
    the data went on (the manifests' positions); warn: step 22 updated the weights."""
    saved = 20 if policy == "rollback" else 21
    rows, proc = faulty(tmp_path, "spike:22", 2, "--training.steps", "22", "--training.spike_policy", policy,
                        "--checkpoint.folder", str(tmp_path / "ck"), "--checkpoint.interval", str(saved))
    assert proc.returncode == 0, proc.stderr[-3000:]
    spikes = [line for line in proc.stdout.splitlines() if ": spike: " in line]
    assert len(spikes) == 1 and spikes[0].startswith("plait: step 22: spike: loss "), spikes
    row = rows[21]
    assert row["step"] == 22 and row["loss"] > row["loss_spike_threshold"] > rows[20]["loss"]
    assert row["grad_norm"] > row["grad_norm_spike_threshold"]
    assert [r["step"] for r in rows if "loss_spike_threshold" in r or "skipped" in r] == [22]
    assert ("skipped" in row) == (policy != "warn")
    assert row.get("rolled_back_to") == (20 if policy == "rollback" else None)
    assert {"warn": "trained on", "skip": "skipped: no update", "rollback": "step-20's weights"}[policy] in spikes[0]
    before, after = (flat(saved_state(tmp_path / "ck" / f"step-{s}")) for s in (saved, 22))
    same = [torch.equal(before[name], after[name]) for name in before if isinstance(before[name], torch.Tensor)]
    assert all(same) if policy != "warn" else not all(same)
    manifests = [json.loads((tmp_path / "ck" / f"step-{s}" / "plait.json").read_text()) for s in (saved, 22)]
    assert [m["loader"]["step"] for m in manifests] == [saved, 22]
    assert [m["scheduler"]["last_epoch"] for m in manifests] == [saved, 22]
    kept = [len(m["spikes"]["loss"]) for m in manifests]
    assert kept[1] - kept[0] == 22 - saved - 1  # (the steps between joined the history; the spike did not)


def test_a_nan_in_one_weight_is_traced_to_its_module_before_the_run_stops(tmp_path):
    """One NaN in layers.1's query projection (rank 0's shard, FSDP2 at world 2): the run stops at
    step 1 as before, after one line naming that module as the first whose output is not finite,
    (the gradients follow from it); the report, every rank's findings, is in checkpoint.folder."""
    _, proc = faulty(tmp_path, "nan:layers.1.attention.wq.weight", 2, "--training.steps", "3",
                     "--checkpoint.folder", str(tmp_path / "ck"))
    assert proc.returncode != 0 and "step 1: loss nan" in proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if "the first non-finite value" in line]
    assert len(lines) == 1, proc.stdout
    assert "the output of layers.1.attention.wq (NaN; rank 0, micro-batch 0, row 0, 1 read from " in lines[0]
    assert "gradients: non-finite from it" in lines[0]
    report = json.loads((tmp_path / "ck" / "nonfinite-step-1.json").read_text())
    assert [r["forward"]["module"] for r in report["ranks"]] == ["layers.1.attention.wq"] * 2


def test_a_nan_made_in_backward_is_traced_to_the_parameter_it_reached_first(tmp_path):
    """Forward finite, a NaN gradient arriving at layers.1's w2 (FSDP2, world 2): no module's
    output is named, and the gradients' first non-finite parameter is that layer's weight."""
    _, proc = faulty(tmp_path, "nan_grad:layers.1.feed_forward.w2", 2, "--training.steps", "2")
    assert proc.returncode != 0
    line = next(line for line in proc.stdout.splitlines() if "the first non-finite value" in line)
    assert "no module's output (forward ran finite again)" in line, line
    assert "backward made the first non-finite one at layers.1.feed_forward.w2.weight (rank 0;" in line, line


def test_an_inf_input_is_traced_to_the_embedding_and_the_row_it_was_read_from(tmp_path):
    """The embedding of one token of row 1 made inf (one process): the line names the embedding
    as the first non-finite output, the row, and the shard, tokens and documents that row was read from; the
    report is beside metrics.jsonl where there is no checkpoint.folder."""
    _, proc = faulty(tmp_path, "inf_input", 1, "--training.steps", "2")
    assert proc.returncode != 0
    line = next(line for line in proc.stdout.splitlines() if "the first non-finite value" in line)
    rows = re.search(r"the output of tok_embeddings \(inf; rank 0, micro-batch 0, row ([\d, ]+) read from", line)
    assert rows and 1 in map(int, rows[1].split(", ")), line  # (and rows where the same token is)
    assert re.search(r" read from \S+ tokens \d+-\d+ \(documents \d+-\d+\)", line), line  # (a shard of the corpus)
    assert (tmp_path / "nonfinite-step-1.json").is_file()  # (no checkpoint.folder: beside metrics.jsonl)


@pytest.mark.parametrize("layout, bound", [("tp", 1e-6), ("pp", 0.0)])
def test_z_loss_trains_every_layout_as_the_single_device(train_once, layout, bound):
    """z-loss (1e-2, 100x PaLM's, so that it moves the weights) under TP (vocabulary-sharded
    log-sum-exps) and a pipeline (recorded on the last stage): the losses and z_loss of 6 steps
    equal the single device's within the parity matrix's bounds, relative: TP's fp32 1e-6 (each
    row-wise matmul's reduction split in two; measured 7.4e-8 loss, 2.0e-7 z_loss), the pipeline
    bitwise (the same micro-batches in the same order); z-loss changed the losses."""
    z = ["--training.z_loss", "1e-2"]
    world, args = LAYOUTS[layout]
    reference, _ = train_once(1, *STEPS, *LAYOUTS["single"][1], *z)
    rows, _ = train_once(world, *STEPS, *args, *z)
    plain, _ = train_once(1, *STEPS, *LAYOUTS["single"][1])
    for name in ("loss", "z_loss"):
        assert max(abs(a[name] / b[name] - 1) for a, b in zip(rows, reference)) <= bound, name
    assert reference[0]["loss"] == plain[0]["loss"] and reference[-1]["loss"] != plain[-1]["loss"]


def why_hung(folder) -> list[str]:
    proc = subprocess.run([sys.executable, "-m", "plait", "why-hung", str(folder)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def test_a_stuck_rank_is_named_with_the_collective_the_others_wait_in(tmp_path):
    """Rank 1 stops for good at step 3 (FSDP2, world 2, comm.timeout_seconds 10): rank 0 times
    out in its next collective, dumps its last collectives and asks rank 1 to (rank 1's main thread
    is stuck; a thread of its own answers); `plait why-hung` names rank 1 as behind, and the
    all-gather rank 0 waits in with the line of plait that called it."""
    _, proc = faulty(tmp_path, "stall:3", 2, "--training.steps", "6", "--checkpoint.folder", str(tmp_path / "ck"),
                     "--comm.timeout_seconds", "10")
    assert proc.returncode != 0 and f"plait why-hung {tmp_path / 'ck'}" in proc.stderr, proc.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "ck" / "collectives").iterdir()) == ["rank-0.json", "rank-1.json"]
    lines = why_hung(tmp_path / "ck")
    assert lines[0] == "plait: why-hung: 2 dumps (rank 0: collective timeout at step 3)", lines
    verdict = next(line for line in lines if "behind" in line)
    assert re.search(r"rank 1 \(\S+\) behind: last collective #\d+ .*; ranks \[0\] wait in #\d+ gloo:all_gather "
                     r"\(\d+ Float\) from step.py:\d+ accumulate", verdict), verdict


def test_a_healthy_run_dumped_on_a_signal_has_no_rank_behind(tmp_path):
    """Every rank of a run that trains on (FSDP2, world 2, its slow-rank check's gather every
    step) sends itself SIGUSR2 at step 3: each dumps while training goes on, the run ends as
    usual, and `plait why-hung` says of every group that no rank is behind (ranks caught a
    collective or two apart are a run in flight; a gather's root and leaves differ in sizes)."""
    rows, proc = faulty(tmp_path, "usr2:3", 2, "--training.steps", "4", "--metrics.log_interval", "1")
    assert proc.returncode == 0 and len(rows) == 4, proc.stderr[-3000:]
    lines = why_hung(tmp_path)  # (no checkpoint.folder: beside metrics.jsonl)
    assert lines[0] == "plait: why-hung: 2 dumps (signal SIGUSR2)" and len(lines) > 1, lines
    assert all("no rank is behind" in line for line in lines[1:]), lines


def entry(seq: int, op: str, line: int) -> dict:
    return {"collective_seq_id": seq, "profiling_name": op, "input_sizes": [[4]], "input_dtypes": ["Float"],
            "process_group": ["0", "default_pg"], "time_created_ns": 0, "timeout_ms": 10_000, "is_p2p": False,
            "frames": [{"name": "f", "filename": "/x/plait/step.py", "line": line}]}


def test_ranks_that_called_different_collectives_are_shown_where_they_went_apart():
    """Same sizes, another line of plait (one rank left a collective out and called the next one
    in its place, which gloo pairs without a word): the first number where they differ is named
    with both callers."""
    from plait.why_hung import verdicts

    dumps = {r: {"rank": r, "host": "h", "world_size": 2, "time_ns": 20 * 10**9, "why": "x",
                 "trace": {"entries": [entry(1, "gloo:all_reduce", 10), entry(2, "gloo:all_reduce", 20 + r)]}}
             for r in (0, 1)}
    assert verdicts(dumps) == ["group 0/default_pg: the ranks went apart at collective #2: rank 0: #2 gloo:all_reduce "
                               "(4 Float) from step.py:20 f; rank 1: #2 gloo:all_reduce (4 Float) from step.py:21 f"]


def test_a_slow_rank_is_named_within_two_log_intervals(tmp_path):
    """Rank 1 sleeps 1 s at the start of every step (FSDP2, world 2, a log interval of 2 steps):
    rank 0 waits for it in every collective, and at the second check (step 4) one line names rank
    1 with its host and local rank; each check's row has the slowest rank and its margin. (A debug
    step takes well under the sleep on any CPU here, so rank 1's compute is over rank 0's by far
    more than the 25% margin.)"""
    rows, proc = faulty(tmp_path, "slow:1", 2, "--training.steps", "6", "--metrics.log_interval", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    slow = [line for line in proc.stdout.splitlines() if " is slow: " in line]
    assert len(slow) == 1 and re.match(r"plait: step 4: rank 1 \(host \S+, local rank 1\) is slow: ", slow[0]), slow
    assert [(r["step"], r["slowest_rank"]) for r in rows if "slowest_rank" in r] == [(2, 1), (4, 1), (6, 1)]


def test_waits_are_what_each_rank_spent_waiting_for_the_last_to_arrive():
    """Three ranks, two collectives of one group and one of another that rank 2 is not in: each
    waits (last arrival - its own) where it took part."""
    from plait.stragglers import waits

    s = 10**9
    arrivals = [{("0/default_pg", 1): 0, ("0/default_pg", 2): 5 * s, ("1/dp", 1): 7 * s},
                {("0/default_pg", 1): 1 * s, ("0/default_pg", 2): 5 * s, ("1/dp", 1): 9 * s},
                {("0/default_pg", 1): 3 * s, ("0/default_pg", 2): 6 * s}]
    assert waits(arrivals) == [3 + 1 + 2, 2 + 1 + 0, 0 + 0]
