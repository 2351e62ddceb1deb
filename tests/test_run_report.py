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


def test_a_small_validation_set_names_the_eval_steps_that_fit(tmp_path, capsys):
    from plait.cli import main

    (tmp_path / "val.txt").write_text(validation_text())
    common = ["train", "--training.seq_len", "64", "--training.global_batch_size", "4", "--data.vocab_size", "512",
              "--data.val_path", str(tmp_path / "val.txt"), "--training.eval_interval", "1"]
    assert main([*common, "--training.eval_steps", "1000"]) == 2
    err = capsys.readouterr().err
    found = re.fullmatch(r"plait: error: data\.val_path: .* has (\d+) sequences of training\.seq_len=64, fewer than "
                         r"training\.eval_steps x global_batch_size = 1000 x 4 = 4000: --training\.eval_steps (\d+) "
                         r"fits\n", err)
    assert found, err
    sequences, fits = int(found[1]), int(found[2])
    assert fits * 4 <= sequences < (fits + 1) * 4
    # A set with fewer sequences than one global batch: no eval_steps fits, and the line says what does.
    assert main([*common, "--training.global_batch_size", str(4 * (sequences // 4 + 1))]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not even one global batch: more validation text, or a smaller " \
        "training.global_batch_size or seq_len" in err, err
