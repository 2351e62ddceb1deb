"""Muon: the Newton-Schulz iteration, which parameters it takes, its collectives (optimizer phase),
checkpoints and refusals. Parity against single-device Muon is in test_parity (conftest's *_muon rows)."""

import json
import shutil

import pytest
import torch

from conftest import LAYOUTS, MUON, STEPS, layout_run, losses, run_plait
from plait.cli import main
from plait.models.transformer import Transformer
from plait.models.flavors import model_args
from plait.optim.optimizers import muon_scale, newton_schulz, uses_muon
from plait.proof.trace import summarise


@pytest.mark.parametrize("shape", [(48, 96), (96, 48), (3, 32, 64)])
def test_newton_schulz_makes_every_singular_value_about_one(shape):
    """Keller Jordan's quintic coefficients trade exactness for speed: after 5 steps every singular
    value lies in about [0.7, 1.2] (not 1), whatever the input's scale; a stack is orthogonalised
    matrix by matrix."""
    g = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 1e-3
    x = newton_schulz(g, 5)
    assert x.shape == g.shape and x.dtype == torch.float32
    singular = torch.linalg.svdvals(x)
    assert singular.min() > 0.6 and singular.max() < 1.25, singular
    if len(shape) == 3:
        torch.testing.assert_close(x[1], newton_schulz(g[1], 5))


def test_muon_takes_the_blocks_matrices_and_experts_not_routers_embeddings_or_norms():
    with torch.device("meta"):
        model = Transformer(model_args("debug_moe", 512))
    chosen = {name for name, p in model.named_parameters() if uses_muon(name, p)}
    assert "layers.0.attention.wq.weight" in chosen and "layers.1.feed_forward.experts.w2" in chosen
    assert not chosen & {"tok_embeddings.weight", "output.weight", "layers.0.feed_forward.router.gate.weight",
                         "layers.0.attention_norm.weight", "layers.0.attention.q_norm.weight"}
    assert muon_scale(torch.Size([8, 64, 128])) == 0.2 * 128 ** 0.5


def test_muon_orthogonalises_in_the_optimizer_step_by_all_to_all(train_once):
    """FSDP2 at world 2 (debug: 2 blocks x 7 matrices, one to each rank per round): 7 rounds of two
    fp32 all-to-alls per step, in the optimizer phase; none in forward or backward."""
    layout_run(train_once, "fsdp2_muon")
    world, args = LAYOUTS["fsdp2_muon"]
    rows = summarise(train_once.traces[(world, (*STEPS, *args))])
    exchanges = {(r["phase"], r["dtype"]): r["calls_per_step"] for r in rows if r["kind"] == "all_to_all"}
    assert exchanges == {("optimizer", "float32"): 14}, exchanges


def test_a_muon_checkpoint_resumes_bitwise_and_not_under_adamw(tmp_path):
    args = [*MUON, "--training.steps", "6", "--checkpoint.interval", "3", "--parallelism.dp_shard", "2"]
    full, _ = run_plait(tmp_path, *args, "--checkpoint.folder", str(tmp_path / "full"), nproc=2)
    shutil.copytree(tmp_path / "full" / "step-3", tmp_path / "resumed" / "step-3")
    resumed, proc = run_plait(tmp_path, *args, "--checkpoint.folder", str(tmp_path / "resumed"), nproc=2)
    assert "resumed from" in proc.stdout and losses(resumed) == losses(full)[3:]
    manifest = json.loads((tmp_path / "full" / "step-3" / "plait.json").read_text())
    assert manifest["hyperparameters"]["optimizer"] == "muon"
    _, proc = run_plait(tmp_path, "--training.steps", "6", "--checkpoint.folder", str(tmp_path / "full"), check=False)
    assert proc.returncode == 2 and "was trained with muon" in proc.stderr and "allowed here: muon" in proc.stderr


@pytest.mark.parametrize("options, fragment", [
    (["--optimizer.betas", "0.9", "1.0"], "optimizer.betas: two numbers in [0, 1)"),
    ([*MUON, "--optimizer.ns_steps", "0"], "ns_steps >= 1"),
    (["--optimizer.name", "sgd"], "optimizer.name"),
])
def test_bad_optimizer_options_fail_with_one_line(tmp_path, capsys, options, fragment):
    assert main(["train", *options]) == 2
    assert fragment in capsys.readouterr().err
