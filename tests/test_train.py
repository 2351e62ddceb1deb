"""End-to-end behaviour of `plait train`: metrics, reproducibility, and failing loudly."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, TINY, descendants, environ, losses, run_plait

REQUIRED = {"step", "loss", "grad_norm", "lr", "tokens_per_sec", "mfu", "memory_gib"}


def test_metrics_rows_tensorboard_and_reproducibility(tmp_path):
    args = ["--training.steps", "12", "--debug.deterministic", "--metrics.tensorboard", str(tmp_path / "tb")]
    first, proc = run_plait(tmp_path, *args)
    second, _ = run_plait(tmp_path, *args)
    assert [row["step"] for row in first] == list(range(1, 13))
    assert REQUIRED <= set(first[0])
    assert all(row["tokens_per_sec"] > 0 and 0 < row["mfu"] <= 1 and row["memory_gib"] > 0 for row in first)
    assert losses(first) == losses(second), "two identical runs must be bitwise identical"
    # One step's loss is one batch of 4 x 64 tokens (noise ~0.1), so the means of 3 steps: measured
    # a fall of 0.25 with plait's data order, 0.31 with the order before it.
    first3, last3 = sum(losses(first)[:3]) / 3, sum(losses(first)[-3:]) / 3
    assert last3 < first3 - 0.15, "the loss must fall"
    warmup_lrs = [row["lr"] for row in first[:2]]
    assert warmup_lrs[0] < warmup_lrs[1]  # linear warmup
    assert "single device" in proc.stdout and "step     1" in proc.stdout
    check_progress_and_summary(tmp_path, first, proc)
    # The second run started afresh in the same TensorBoard folder: each step is there once.
    assert tensorboard_steps(tmp_path / "tb") == list(range(1, 13))


def tensorboard_steps(folder) -> list[int]:
    """The steps of the loss in `folder`'s event files, as the files hold them and as TensorBoard
    reads them (it hides the events a restarted run's purge_step covers): they must agree."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    in_files = [event.step for path in sorted(folder.glob("events.out.tfevents.*"))
                for event in EventFileLoader(str(path)).Load()
                if event.HasField("summary") and event.summary.value[0].tag == "loss"]
    accumulator = EventAccumulator(str(folder))
    accumulator.Reload()
    assert [event.step for event in accumulator.Scalars("loss")] == in_files
    return in_files


def check_progress_and_summary(tmp_path, rows: list[dict], proc) -> None:
    """Of a 12-step run with log_interval 5: every printed line has an ETA and the mean speed since
    the line before; the last step is always printed; the run ends with a summary, printed and in
    <metrics>.summary.json."""
    assert re.search(r"^plait: start-up \d+\.\d s ", proc.stdout, re.M), proc.stdout
    lines = {int(m[1]): m[0] for m in re.finditer(r"^step +(\d+) \|.*$", proc.stdout, re.M)}
    assert list(lines) == [1, 5, 10, 12], proc.stdout
    tokens_per_step = 4 * 64
    for first, last in ((1, 1), (2, 5), (6, 10), (11, 12)):
        shown = float(re.search(r"\| +(\d+) tok/s", lines[last])[1])
        mean = (last - first + 1) * tokens_per_step / sum(row["step_time"] for row in rows[first - 1:last])
        assert abs(shown - mean) <= 0.5 + 1e-6 * mean, (last, shown, mean)
        assert re.search(r"\| eta \d+:\d\d:\d\d$", lines[last]), lines[last]
    assert lines[12].endswith("eta 0:00:00")

    summary = json.loads((tmp_path / "metrics-0.summary.json").read_text())
    sequences = int(re.search(r"\| (\d+) sequences of 64 tokens", proc.stdout)[1])
    assert summary["step"] == 12 and summary["steps_run"] == 12 and summary["loss"] == rows[-1]["loss"]
    assert summary["tokens"] == 12 * tokens_per_step and summary["val_loss"] is None and summary["checkpoint"] is None
    assert summary["sources"] == [{"source": "the bundled corpus", "sequences": 48, "epochs": 48 / sequences}]
    assert summary["mean_over_steps"] == [2, 12]  # the first step's warm-up left out
    assert summary["tokens_per_sec"] == pytest.approx(11 * tokens_per_step / sum(r["step_time"] for r in rows[1:]))
    assert summary["first_step_s"] == rows[0]["step_time"] and 0 < summary["startup_s"] < summary["wall_time_s"]
    assert f"plait: done: step 12 | loss {rows[-1]['loss']:.4f} | 3,072 tokens ({48 / sequences:.2f} epochs of " \
           "the bundled corpus)" in proc.stdout
    assert re.search(r"^plait: time: .* \| [\d,]+ tok/s, mfu [\d.]+% \(mean over steps 2-12, the first step's "
                     r"warm-up left out\)$", proc.stdout, re.M), proc.stdout
    assert "plait: no checkpoint saved" in proc.stdout


def test_nan_loss_stops_with_the_step_and_no_update(tmp_path):
    rows, proc = run_plait(tmp_path, "--training.steps", "30", "--training.lr", "1e12", "--training.warmup_steps", "0",
                           "--training.max_norm", "0", check=False)
    assert proc.returncode == 1
    message = proc.stderr.strip().splitlines()[-1]
    assert message.startswith("plait: error: step ") and "not finite" in message
    failed_step = int(message.split("step ")[1].split(":")[0])
    assert [row["step"] for row in rows] == list(range(1, failed_step))


def test_missing_data_file_fails_before_training(tmp_path):
    rows, proc = run_plait(tmp_path, "--data.path", str(tmp_path / "missing.txt"), check=False)
    assert proc.returncode == 2 and rows == []
    assert proc.stderr.strip().splitlines()[-1].startswith("plait: error: data.path:")


@pytest.mark.slow
def test_a_dead_rank_ends_the_job_instead_of_hanging(tmp_path):
    """kill -9 one rank mid-run: torchrun tears the job down and reports failure."""
    command = [sys.executable, "-m", "plait", "train", "--nproc", "2", *TINY, "--training.steps", "100000",
               "--metrics.log_interval", "1", "--comm.timeout_seconds", "30"]
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        for line in proc.stdout:
            if line.startswith("step     3"):
                break
        workers = [pid for pid in descendants(proc.pid) if "\0RANK=" in environ(pid)]
        assert len(workers) == 2, workers
        os.kill(workers[1], signal.SIGKILL)
        start = time.monotonic()
        assert proc.wait(timeout=90) != 0
        print(f"job ended {time.monotonic() - start:.1f}s after the kill")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
