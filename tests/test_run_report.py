"""What a run reports beyond its steps: validation as soon as there is a validation set, the
summary of a resumed run (its checkpoint, the command to export it), TensorBoard with each step
once after a resume, and a validation set too small for eval_steps naming the value that fits."""

import json
import re
import shutil

from conftest import launch, run_plait, validation_text
from test_train import tensorboard_steps


def test_validation_by_default_and_a_resumed_runs_summary_and_tensorboard(tmp_path):
    (tmp_path / "val.txt").write_text(validation_text())
    folder, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    args = ["--training.steps", "13", "--data.val_path", str(tmp_path / "val.txt"), "--checkpoint.folder", str(folder),
            "--checkpoint.interval", "5", "--metrics.tensorboard", str(tmp_path / "tb")]
    rows, _ = run_plait(tmp_path, *args, metrics=metrics)
    # No training.eval_interval: about ten evaluations (every ceil(13 / 10) = 2 steps) and the last step.
    assert [row["step"] for row in rows if "val_loss" in row] == [2, 4, 6, 8, 10, 12, 13]

    shutil.rmtree(folder / "step-13")  # as if the run had died after step 13, before its save
    resumed, proc = run_plait(tmp_path, *args, metrics=metrics)
    assert "resumed from" in proc.stdout and [row["step"] for row in resumed] == list(range(1, 14))
    assert tensorboard_steps(tmp_path / "tb") == list(range(1, 14))  # steps 11-13 once, the resumed run's

    summary = json.loads((tmp_path / "metrics.summary.json").read_text())
    last = resumed[-1]
    assert (summary["step"], summary["steps_run"], summary["loss"]) == (13, 3, last["loss"])
    assert (summary["val_loss"], summary["val_step"]) == (last["val_loss"], 13)
    assert summary["mean_over_steps"] == [12, 13] and summary["tokens"] == 13 * 4 * 64
    assert summary["checkpoint"] == str(folder / "step-13")
    export = summary["next"]["export"]
    assert export == f"plait export --checkpoint {folder / 'step-13'} --out hf-step-13"
    assert f"plait: last checkpoint {folder / 'step-13'}: export it with `{export}`" in proc.stdout
    assert re.search(rf"^plait: done: step 13 \| loss {last['loss']:.4f} \| val_loss {last['val_loss']:.4f} "
                     r"\(step 13\) \| 3,328 tokens", proc.stdout, re.M), proc.stdout
    # The command works as printed (writing its folder here rather than in the working directory).
    command = export.split()[1:-1] + [str(tmp_path / "hf")]
    assert launch(command, 1, timeout=120, forked=True).returncode == 0
    assert (tmp_path / "hf" / "config.json").exists()


def test_a_small_validation_set_is_evaluated_on_the_batches_it_holds(tmp_path, capsys):
    """eval_steps beyond the set: each evaluation measures the global batches it holds, as one
    line says (issue 62: it was refused, and the fix repeated on every command); a set of fewer
    sequences than one global batch is one line."""
    from plait.cli import main

    (tmp_path / "val.txt").write_text(validation_text())
    val = ["--data.val_path", str(tmp_path / "val.txt"), "--training.eval_interval", "1"]
    rows, proc = run_plait(tmp_path, *val, "--training.steps", "1", "--training.eval_steps", "1000")
    found = re.search(r"plait: data\.val_path: .* holds (\d+) of training\.eval_steps 1000 global batches \((\d+) "
                      r"sequences of 64 tokens\): each evaluation measures those (\d+)\n", proc.stdout)
    assert found and found[1] == found[3], proc.stdout[-3000:]
    held, sequences = int(found[1]), int(found[2])
    assert held * 4 <= sequences < (held + 1) * 4 and "val_loss" in rows[-1]
    common = ["train", "--training.seq_len", "64", "--data.vocab_size", "512", *val]
    assert main([*common, "--training.global_batch_size", str(4 * (sequences // 4 + 1))]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not even one global batch of" in err and "more validation text, or a " \
        "smaller training.global_batch_size or seq_len" in err, err
