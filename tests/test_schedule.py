"""The learning-rate schedules: every step's logged lr is the formula's, and a warmup-stable-decay
run stopped in its stable phase, resumed with more steps, stays at the peak and decays later."""

import math
import shutil

import pytest

from conftest import TINY, run_plait
from plait.arguments import parse_args
from plait.config import ConfigError
from plait.optim.schedule import check_schedule, factor


def schedule(*args: str):
    cfg = parse_args([*TINY, *args])
    check_schedule(cfg)
    return [factor(cfg)(done) for done in range(cfg.training.steps)]


def test_each_schedule_is_its_formula():
    warm = ["--training.steps", "10", "--training.warmup_steps", "2"]
    # cosine (the default): to 0.1 x the peak at the last step, as plait always did
    assert schedule(*warm) == pytest.approx([0.5, 1.0] + [0.1 + 0.45 * (1 + math.cos(math.pi * (s - 2) / 8))
                                                          for s in range(3, 11)])
    assert schedule(*warm, "--training.lr_schedule", "constant") == [0.5] + [1.0] * 9
    # wsd, 30% of 10 steps decaying: the peak through step 7, then steps 8, 9, 10 at 1/3, 2/3, 3/3 of the decay
    wsd = [*warm, "--training.lr_schedule", "wsd", "--training.decay_fraction", "0.3", "--training.min_lr_ratio", "0"]
    stable = [0.5] + [1.0] * 6
    assert schedule(*wsd) == pytest.approx(stable + [2 / 3, 1 / 3, 0.0])
    assert schedule(*wsd, "--training.decay_shape", "sqrt") == pytest.approx(
        stable + [1 - math.sqrt(1 / 3), 1 - math.sqrt(2 / 3), 0.0])
    assert schedule(*wsd, "--training.decay_shape", "cosine") == pytest.approx(stable + [0.75, 0.25, 0.0])
    assert schedule(*wsd, "--training.min_lr_ratio", "0.1")[-1] == pytest.approx(0.1)
    with pytest.raises(ConfigError, match=r"training.decay_fraction: 0.9 of 10 steps would start the decay at step 2, "
                                          r"inside the 2 warmup steps"):
        schedule(*warm, "--training.lr_schedule", "wsd", "--training.decay_fraction", "0.9")
    # A fraction of the steps that rounds to no step still decays in the last one (it kept the peak to
    # the end, then divided by zero at LambdaLR's call after the last step), and 0 is refused.
    short = [*warm, "--training.lr_schedule", "wsd", "--training.decay_fraction", "0.05"]
    assert schedule(*short) == pytest.approx([0.5] + [1.0] * 8 + [0.1])
    assert factor(parse_args([*TINY, *short]))(10) == pytest.approx(0.1)
    with pytest.raises(ConfigError, match=r"training.decay_fraction: 0 leaves wsd no step to decay in"):
        schedule(*warm, "--training.lr_schedule", "wsd", "--training.decay_fraction", "0")
    with pytest.raises(ConfigError, match=r"training.min_lr_ratio: must be in \[0, 1\], got 1.5"):
        schedule("--training.min_lr_ratio", "1.5")
    with pytest.raises(ConfigError, match="training.decay_shape: 'step' is not one of its 3 choices"):
        schedule("--training.decay_shape", "step")


def test_wsd_logs_its_formula_and_a_resumed_longer_run_decays_later(tmp_path):
    """Steps 1-10 of a 10-step wsd run (25% decaying) log the formula's lr; resumed from its
    step-4 checkpoint (stable phase) with 20 steps, it logs the 20-step schedule's lr from step 5:
    the peak until step 15, then the decay to the end."""
    wsd = ["--training.lr_schedule", "wsd", "--training.decay_fraction", "0.25", "--training.warmup_steps", "2"]
    folder = ["--checkpoint.folder", str(tmp_path / "c"), "--checkpoint.interval", "4"]
    rows, _ = run_plait(tmp_path, "--training.steps", "10", *wsd, *folder)
    lr = parse_args(TINY).training.lr
    assert [r["lr"] for r in rows] == pytest.approx([lr * f for f in schedule("--training.steps", "10", *wsd)],
                                                    rel=1e-12)
    for later in (tmp_path / "c").glob("step-*"):  # as if stopped after step 4
        if later.name != "step-4":
            shutil.rmtree(later)
    resumed, proc = run_plait(tmp_path, "--training.steps", "20", *wsd, *folder)
    longer = [lr * f for f in schedule("--training.steps", "20", *wsd)]
    # the line says where the change takes the lr (issue 62: an extended run's lr moved unsaid)
    shorter = [lr * f for f in schedule("--training.steps", "10", *wsd)]
    assert (f"plait: resuming with training.steps 10 -> 20 (this run's options; the checkpoint had the former): "
            f"step 5's lr {shorter[4]:.3g} -> {longer[4]:.3g} (lr {lr:g} (2 warmup steps, then constant, then a linear "
            f"decay over the last 0.25 of the steps to 0.1x), 20 steps)") in proc.stdout, proc.stdout
    assert [r["step"] for r in resumed] == list(range(5, 21))
    assert [r["lr"] for r in resumed] == pytest.approx(longer[4:], rel=1e-12)
    assert [r["lr"] for r in resumed[:11]] == [lr] * 11 and resumed[-1]["lr"] == pytest.approx(0.1 * lr)
