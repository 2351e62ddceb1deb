"""The mixed-precision contract: every layout computes in the dtype asked for and reduces
gradients in the dtype asked for, proven from the ops that actually ran (the dtype probe)."""

import pytest

from conftest import AUTOCAST, BF16, LAYOUTS, layout_run, losses, max_abs_diff
from plait.arguments import parse_args
from plait.checks import check_options
from plait.config import ConfigError

pytestmark = pytest.mark.slow
BF16_REDUCE = ["--training.mixed_precision_reduce", "bfloat16"]
CLASSIC_DDP = ["--parallelism.dp_backend", "ddp", "--parallelism.dp_replicate", "2"]

RUNS = {  # name: (layout in conftest.LAYOUTS, precision options, mode options)
    "single": ("single", BF16, []),
    "ddp": ("ddp", BF16, []),
    "fsdp": ("fsdp2", BF16, []),
    "single_autocast": ("single", BF16, AUTOCAST),
    "ddp_autocast": ("ddp", BF16, AUTOCAST),
    "fsdp_autocast": ("fsdp2", BF16, AUTOCAST),
    "classic_ddp_autocast": ("classic_ddp", BF16, AUTOCAST),
    "classic_ddp_autocast_bf16_reduce": ("classic_ddp", [*BF16, *BF16_REDUCE], AUTOCAST),
    "fsdp_bf16_reduce": ("fsdp2", [*BF16, *BF16_REDUCE], []),
    "hsdp_bf16_reduce": ("hsdp_w4", [*BF16, *BF16_REDUCE], []),
    "single_fp32": ("single", [], []),
    "cp": ("cp", BF16, []),
}


@pytest.fixture(scope="module")
def runs(train_once):
    """Each run trained once for 6 steps with the probe on (shared with the parity matrix)."""
    return {name: layout_run(train_once, *spec) for name, spec in RUNS.items()}


def dtypes(probe, phase, kind, ops=None):
    return {r["dtypes"] for r in probe if r["phase"] == phase and r["kind"] == kind and (ops is None or r["op"] in ops)}


GRAD_REDUCTIONS = {"_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_", "allreduce_", "allreduce_coalesced_"}


@pytest.mark.parametrize("name", [n for n in RUNS if n != "single_fp32"])
def test_every_layout_computes_in_bf16_and_reduces_in_the_asked_dtype(runs, name):
    _, probe = runs[name]
    reduce = "bfloat16" if "bf16_reduce" in name else "float32"
    assert dtypes(probe, "forward", "matmul") == {"bfloat16"}, probe
    assert dtypes(probe, "forward", "attention") == {"bfloat16"}
    assert dtypes(probe, "backward", "matmul") == {"bfloat16"}
    if not name.startswith("single"):  # a single device reduces nothing
        assert dtypes(probe, "backward", "collective", GRAD_REDUCTIONS) == {reduce}, probe


def test_context_parallel_moves_keys_values_and_their_gradients_in_the_compute_dtype(runs):
    """CP2 in bf16 (2 blocks, 2 micro-batches): K and V all-gathered in forward and their
    gradients reduce-scattered in backward in bf16 (2 x 2 x 2 calls each), FSDP2's parameter
    gradients (over dp_shard x cp) in the fp32 reduce dtype."""
    _, probe = runs["cp"]
    calls = {(r["phase"], r["op"], r["dtypes"]): r["count"] for r in probe if r["kind"] == "collective"}
    assert calls["forward", "all_gather_into_tensor", "bfloat16"] == 8
    assert calls["backward", "reduce_scatter_tensor", "bfloat16"] == 8
    assert dtypes(probe, "backward", "collective", {"_reduce_scatter_base_"}) == {"float32"}


PIPELINE_RUNS = {  # name: (layout, mode options); bf16 param runs are the parity matrix's
    "pp": ("pp", []), "pp_autocast": ("pp", AUTOCAST), "pp_fsdp2": ("pp_fsdp2", []), "pp_tp": ("pp_tp", []),
}


@pytest.mark.parametrize("name", PIPELINE_RUNS)
def test_every_pipeline_stage_computes_in_bf16_and_sends_the_compute_dtype(train_once, name):
    """The seeds' bug lived longest under PP: here every rank (every stage) is probed. Stages
    send activations forward and gradients back in the dtype of the residual stream: bf16 in
    param mode, fp32 in autocast mode (autocast leaves the residual stream fp32)."""
    layout, mode = PIPELINE_RUNS[name]
    _, probe = layout_run(train_once, layout, BF16, mode)
    assert {r["rank"] for r in probe} == set(range(LAYOUTS[layout][0]))
    for rank in range(LAYOUTS[layout][0]):
        mine = [r for r in probe if r["rank"] == rank]
        assert dtypes(mine, "forward", "matmul") == {"bfloat16"} == dtypes(mine, "backward", "matmul"), (rank, mine)
        assert dtypes(mine, "forward", "attention") == {"bfloat16"}
    stream = "float32" if mode else "bfloat16"
    assert {d for d in dtypes(probe, "step", "collective", {"send", "recv_"}) if d} == {stream}
    if layout == "pp_fsdp2":  # gradients reduced over dp in the asked reduce dtype
        assert dtypes(probe, "backward", "collective", GRAD_REDUCTIONS) == {"float32"}


def test_what_runs_in_bf16_differs_by_mode_as_documented(runs):
    """The README's table: param mode casts the embedding weight (so the residual stream is
    bf16), autocast leaves it fp32; the loss is fp32 in both."""
    for name in ("single", "fsdp", "hsdp_bf16_reduce"):
        assert dtypes(runs[name][1], "forward", "embedding") == {"bfloat16"}
    for name in ("single_autocast", "fsdp_autocast", "classic_ddp_autocast"):
        assert dtypes(runs[name][1], "forward", "embedding") == {"float32"}
    for name in RUNS:
        assert dtypes(runs[name][1], "forward", "loss") == {"float32"}


def test_the_probe_sees_fp32_compute(runs):
    """The negative control: a float32 run shows float32 matmuls, so a silently-fp32 layout fails."""
    _, probe = runs["single_fp32"]
    assert dtypes(probe, "forward", "matmul") == {"float32"}


def test_collective_pattern_per_layout(runs):
    def ops(name, phase):
        return {r["op"] for r in runs[name][1] if r["phase"] == phase and r["kind"] == "collective"}
    assert "_allgather_base_" in ops("fsdp", "forward") and "_reduce_scatter_base_" in ops("fsdp", "backward")
    assert "_allgather_base_" not in ops("ddp", "forward") and "allreduce_" in ops("ddp", "backward")
    assert {"_allgather_base_"} <= ops("hsdp_bf16_reduce", "forward")
    assert {"_reduce_scatter_base_", "allreduce_"} <= ops("hsdp_bf16_reduce", "backward")
    # FSDP2 gathers parameters already cast: the all-gather runs in bf16 in param mode ...
    assert dtypes(runs["fsdp"][1], "forward", "collective", {"_allgather_base_"}) == {"bfloat16"}
    # ... and in fp32 in autocast mode, where parameters stay fp32 and autocast casts per op.
    assert dtypes(runs["fsdp_autocast"][1], "forward", "collective", {"_allgather_base_"}) == {"float32"}


def test_param_mode_parity_world2_bitwise(runs):
    """bf16 compute, fp32 reduce: the single process accumulating two micro-batches in fp32,
    DDP and FSDP2 all sum the same bf16 gradients in fp32 and divide by two (exact)."""
    single = losses(runs["single"][0])
    assert losses(runs["ddp"][0]) == single
    assert losses(runs["fsdp"][0]) == single


def test_autocast_mode_parity_world2_bitwise(runs):
    single = losses(runs["single_autocast"][0])
    assert losses(runs["classic_ddp_autocast"][0]) == single
    assert losses(runs["ddp_autocast"][0]) == single
    assert losses(runs["fsdp_autocast"][0]) == single


def test_differences_between_modes_and_reduce_dtypes_are_reported(runs):
    """Not hidden, not asserted equal: param vs autocast differ in what runs in bf16 (norms,
    residual stream); bf16 reduction rounds each gradient. Printed for the record, bounded
    loosely so a broken mode (e.g. silently fp32) still stands out."""
    param, autocast = losses(runs["single"][0]), losses(runs["single_autocast"][0])
    fp32 = losses(runs["single_fp32"][0])
    bf16_reduce = losses(runs["fsdp_bf16_reduce"][0])
    print(f"\nmax |loss diff| over 6 steps: param vs autocast {max_abs_diff(param, autocast):.2e}, "
          f"param vs fp32 {max_abs_diff(param, fp32):.2e}, autocast vs fp32 {max_abs_diff(autocast, fp32):.2e}, "
          f"fp32 vs bf16 reduce (FSDP2) {max_abs_diff(param, bf16_reduce):.2e}")
    assert 0 < max_abs_diff(param, autocast) < 0.1
    assert 0 < max_abs_diff(param, bf16_reduce) < 0.05


@pytest.mark.parametrize("argv, fragment", [
    ([*CLASSIC_DDP, *BF16], "mixed_precision_mode autocast"),
    (["--training.mixed_precision_param", "float16"], "loss scaling"),
    (["--compile.autograd"], "compile.autograd"),
    (["--parallelism.dp_backend", "ddp", "--parallelism.dp_shard", "2", *AUTOCAST], "dp_backend"),
])
def test_combinations_that_cannot_be_honoured_refuse_to_start(argv, fragment):
    with pytest.raises(ConfigError, match=fragment):
        check_options(parse_args(argv), world=2)


@pytest.mark.parametrize("name", ["fsdp2_qwen2", "tp_qwen2"])
def test_biased_projections_run_in_the_compute_dtype(train_once, name):
    """Qwen2's q/k/v biases follow the precision table with their weights: the biased matmuls
    (addmm) take a bf16 bias, input and weight in forward, and backward's matmuls are bf16."""
    _, probe = layout_run(train_once, name, BF16)
    assert dtypes(probe, "forward", "matmul", {"addmm"}) == {"bfloat16"}, probe
    assert dtypes(probe, "backward", "matmul") == {"bfloat16"}
