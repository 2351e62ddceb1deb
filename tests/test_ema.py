"""The weights' moving average (training.ema, plait/ema.py): what each checkpoint holds is the
recurrence average_t = lerp(average_t-1, weights_t, 1 - decay) from the weights the run started
with, bitwise (each rank's shard is averaged as the whole tensor would be, element by element);
a resumed run continues it bitwise; export reads it."""

from __future__ import annotations

import shutil

import pytest
import torch

from conftest import TINY, run_plait
from plait.checkpoint.manifest import manifest_model, read_manifest
from plait.checkpoint.offline import load_full_state_dict
from plait.cli import main
from plait.config import ConfigError

pytestmark = pytest.mark.slow
EMA = ["--training.ema", "0.75", "--training.steps", "3", "--checkpoint.interval", "1", "--parallelism.dp_shard", "2"]


def test_each_checkpoint_holds_the_average_of_the_weights_and_a_resume_continues_it(tmp_path):
    seed = tmp_path / "seed"
    assert main(["seed-checkpoint", *TINY, "--out", str(seed)]) == 0
    run = tmp_path / "run"
    full, _ = run_plait(tmp_path, *EMA, "--checkpoint.load", str(seed), "--checkpoint.folder", str(run), nproc=2)
    args = manifest_model(read_manifest(seed), seed, "checkpoint")
    average = load_full_state_dict(seed, args, "checkpoint")
    with pytest.raises(ConfigError, match="holds no average of the weights"):
        load_full_state_dict(seed, args, "checkpoint", "ema")
    for step in (1, 2, 3):
        folder = run / f"step-{step}"
        assert read_manifest(folder)["ema"] == 0.75
        weights = load_full_state_dict(folder, args, "checkpoint")
        saved = load_full_state_dict(folder, args, "checkpoint", "ema")
        average = {name: torch.lerp(average[name], weights[name], 0.25) for name in average}
        assert all(saved[name].equal(average[name]) for name in average), step
        assert any(not saved[name].equal(weights[name]) for name in weights)

    shutil.rmtree(run / "step-3")  # resumed from step 2: step 3 and its average again, bitwise
    resumed, proc = run_plait(tmp_path, *EMA, "--checkpoint.load", str(seed), "--checkpoint.folder", str(run), nproc=2)
    assert "resumed from" in proc.stdout and resumed[0]["loss"] == full[2]["loss"]
    again = load_full_state_dict(run / "step-3", args, "checkpoint", "ema")
    assert all(again[name].equal(average[name]) for name in average)

    assert main(["export", "--checkpoint", str(run), "--out", str(tmp_path / "hf"), "--weights", "ema",
                 "--dtype", "float32"]) == 0
    from safetensors.torch import load_file

    exported = load_file(tmp_path / "hf" / "model.safetensors")
    assert exported["model.embed_tokens.weight"].equal(average["tok_embeddings.weight"])
