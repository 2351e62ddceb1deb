"""`plait compare` end to end on the tiny model: table, plot, golden files, bad overrides.

Compares run in this process through `plait.cli.main` (the `plait` entry point), so torch is
imported once; the training runs themselves are real `plait train` processes.
"""

import contextlib
import io
import json
from collections import Counter

import pytest

from conftest import TINY, VALIDATE, validation_text
from plait.cli import main
from plait.proof.compare import option_types

pytestmark = pytest.mark.slow
# Options shared by every run: TINY without its thread pin (compare pins threads itself), in fp32,
# where single device, DDP and FSDP2 at world 2 are bitwise equal (tests/test_parity.py).
THREADS = TINY.index("--training.threads")
SHARED = ["--", *TINY[:THREADS], *TINY[THREADS + 2:], "--training.mixed_precision_param", "float32"]
# Bitwise only if the single process accumulates the two rank slices of world 2, in their order.
SINGLE = "nproc=1,micro_batch_size=2"
AMBIGUOUS = min(key for key, n in Counter(name.split(".", 1)[1] for name in option_types()).items() if n > 1)


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    """Single vs FSDP2 vs DDP vs PP2 at world 2, validation loss included, the reference exported
    as a golden file: (folder, exit code, stdout, the shared options). Two runs train at once
    (--jobs 2), and they are still bitwise equal: each runs one thread per rank."""
    folder = tmp_path_factory.mktemp("compare")
    (folder / "val.txt").write_text(validation_text())
    shared = [*SHARED, *VALIDATE, "--data.val_path", str(folder / "val.txt")]
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = main(["compare", "--out", str(folder / "out"), "--steps", "4", "--assert-equal", "--jobs", "2",
                     "--export", str(folder / "golden.json"),
                     "--run", SINGLE, "--run", "dp_shard=2", "--run", "dp_replicate=2", "--run", "pp=2", *shared])
    return folder, code, stdout.getvalue(), shared


def test_world2_layouts_bitwise_with_table_plot_and_losses(world2):
    folder, code, stdout, _ = world2
    assert code == 0, stdout
    assert "final val_loss" in stdout.splitlines()[0]
    for run in ("dp_shard=2", "dp_replicate=2", "pp=2"):  # loss, rel, val_loss, grad norm, rel: all 0
        assert f"| {run} | 2 | {SINGLE} | 0.0e+00 | 0.0e+00 | 0.0e+00 | 0.0e+00 | 0.0e+00 | yes |" in stdout
    result = json.loads((folder / "out" / "losses.json").read_text())
    assert [(r["run"], r["world"], len(r["loss"]), r["val_step"]) for r in result["runs"]] == [
        (SINGLE, 1, 4, [3, 4]), ("dp_shard=2", 2, 4, [3, 4]), ("dp_replicate=2", 2, 4, [3, 4]), ("pp=2", 2, 4, [3, 4])]
    assert result["runs"][0]["loss"][-1] < result["runs"][0]["loss"][0]
    assert [row["bitwise"] for row in result["table"]] == [True, True, True]
    assert (folder / "out" / "losses.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_golden_round_trip_then_doctored_golden_fails_naming_the_step(world2, tmp_path, capsys):
    folder, code, _, shared = world2
    assert code == 0
    golden = json.loads((folder / "golden.json").read_text())
    assert golden["run"] == SINGLE and golden["config"]["training.mixed_precision_param"] == "float32"
    compare = ["compare", "--out", str(tmp_path / "out"), "--steps", "4", "--run", SINGLE]
    assert main([*compare, "--assert-equal", "--golden", str(folder / "golden.json"), *shared]) == 0
    assert f"| {SINGLE} | 1 | golden golden.json | 0.0e+00 |" in capsys.readouterr().out

    golden["loss"][2] += 1e-3
    golden["val_loss"][1] += 2e-3
    (tmp_path / "doctored.json").write_text(json.dumps(golden))
    assert main([*compare, "--atol", "1e-4", "--golden", str(tmp_path / "doctored.json"), *shared]) == 1
    err = capsys.readouterr().err
    assert "golden doctored.json: loss differs by 1.0e-03 at step 3 (atol 0.0001)" in err
    assert "golden doctored.json: val_loss differs by 2.0e-03 at step 4 (atol 0.0001)" in err

    # Another step count or shared option fails before anything runs.
    assert main([*compare[:4], "5", *compare[5:], "--golden", str(folder / "golden.json"), *shared]) == 2
    assert "holds 4 steps, this compare runs 5" in capsys.readouterr().err
    assert main([*compare, "--golden", str(folder / "golden.json"), *shared, "--training.lr", "1e-3"]) == 2
    assert "training.lr 0.002 (golden) vs 0.001" in capsys.readouterr().err


@pytest.mark.parametrize("run, message", [
    ("tpp=2", "tpp: unknown option in run 'tpp=2'; did you mean tp or pp? (a key is nproc, section.key"),
    ("training.stepz=2", "training.stepz: unknown option in run 'training.stepz=2'; did you mean training.steps, "),
    (f"{AMBIGUOUS}=1", f"{AMBIGUOUS}: ambiguous in run '{AMBIGUOUS}=1', say which: "),
    ("tp=two", "parallelism.tp: 'two' in run 'tp=two' is not int"),
    ("sequence_parallel=maybe", "parallelism.sequence_parallel: 'maybe' in run 'sequence_parallel=maybe' is not true"),
    ("mixed_precision_param=fp8", "training.mixed_precision_param: 'fp8' in run 'mixed_precision_param=fp8' is not one"),
    ("seed=1", "training.seed: must be the same in every run"),
    ("threads=2", "training.threads: set by plait compare"),
    ("nproc=3,dp_shard=2", "run 'nproc=3,dp_shard=2' (world 3): parallelism: dp_replicate(1) x dp_shard(2)"),
    ("tp=3", "run 'tp=3' (world 3): parallelism.tp: 3 does not divide the model n_heads"),
])
def test_bad_override_fails_with_one_line_before_any_run(run, message, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["compare", "--out", str(out), "--run", "dp_shard=2", "--run", run, *SHARED]) == 2
    err = capsys.readouterr().err
    assert err.startswith("plait: error: ") and message in err and err.count("\n") == 1, err
    assert not out.exists()  # not even the seed checkpoint was written
