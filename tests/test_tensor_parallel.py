"""Tensor parallelism and its compositions against the single-device reference.

TP2, DDP2+TP2 and FSDP2+TP2 in fp32 and bf16 over 6 steps are rows of the parity matrix
(test_parity.py); here: longer runs, SP/loss-parallel switches, world 8, dtypes, refusals."""

import pytest

from conftest import AUTOCAST, BF16, layout_run, losses, max_abs_diff, run_plait

pytestmark = pytest.mark.slow
TP2 = ["--parallelism.tp", "2"]


def test_tp2_without_sp_and_loss_parallel_matches_single_device_fp32(train_once):
    """TP splits each matmul's reduction (row-wise layers sum two partial products), so fp32
    results differ in the last bits per step: measured 4.8e-7 over 6 steps (9.5e-7 over 20),
    with SP and loss parallel (parity matrix) and without them (here); bound 1e-6."""
    no_sp = layout_run(train_once, "tp", [], ["--parallelism.no_sequence_parallel", "--parallelism.no_loss_parallel"])
    diff = max_abs_diff(losses(no_sp[0]), losses(layout_run(train_once, "single")[0]))
    print(f"\nfp32 TP2 without SP/loss parallel vs single: {diff:.2e}")
    assert diff <= 1e-6


def test_hsdp_tp_world8_matches_single_device(tmp_path):
    """Eight ranks on two cores: slow but the only way to have 2 x 2 x 2. Measured 4.8e-7."""
    steps = ["--training.steps", "4"]
    hsdp_tp, _ = run_plait(tmp_path, *steps, "--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "2", *TP2,
                           nproc=8)
    single, _ = run_plait(tmp_path, *steps)
    diff = max_abs_diff(losses(hsdp_tp), losses(single))
    print(f"\nfp32 HSDP(2x2)+TP2 vs single: {diff:.2e}")
    assert diff <= 1e-6


@pytest.mark.parametrize("mode", ["param", "autocast"])
def test_tp_layouts_compute_in_bf16_and_name_their_collectives(train_once, mode):
    # the param run is the parity matrix's bf16 FSDP2+TP2 row
    _, probe = layout_run(train_once, "fsdp2_tp", BF16, AUTOCAST if mode == "autocast" else [])
    by = lambda phase, kind: {(r["op"], r["dtypes"]) for r in probe if r["phase"] == phase and r["kind"] == kind}
    assert {d for _, d in by("forward", "matmul")} == {"bfloat16"}, probe
    assert {d for _, d in by("backward", "matmul")} == {"bfloat16"}, probe
    print(f"\n{mode}: forward collectives {sorted(by('forward', 'collective'))}\n"
          f"{mode}: backward collectives {sorted(by('backward', 'collective'))}")
    # TP's activation collectives (functional all-gather / reduce-scatter) run in both phases.
    tp_ops = lambda phase: {d for op, d in by(phase, "collective") if op in ("all_gather_into_tensor", "reduce_scatter_tensor")}
    if mode == "param":  # everything the TP collectives carry is bf16
        assert tp_ops("forward") == {"bfloat16"} and tp_ops("backward") == {"bfloat16"}
    else:  # matmul outputs are bf16, the residual stream (embedding output, norm inputs) stays fp32
        assert tp_ops("forward") == {"bfloat16", "float32"} and "bfloat16" in tp_ops("backward")


def test_tp_that_does_not_divide_the_heads_is_refused(tmp_path):
    rows, proc = run_plait(tmp_path, "--parallelism.tp", "3", nproc=3, check=False)
    assert proc.returncode != 0 and rows == []
    assert "plait: error: parallelism.tp: 3 does not divide the model n_heads 4" in proc.stderr
