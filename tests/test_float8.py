"""Float8 training: which matmuls run float8 in every layout (the dtype probe), what FSDP2's
float8 all-gather moves (profiler traces), checkpoints that stay fp32 master weights, and the
refusals. The parity rows are in test_parity (the shared runs of conftest.LAYOUTS)."""

import shutil

import pytest
import torch
from safetensors.torch import load_file

from conftest import (BF16, FLOAT8, LAYOUTS, MXFP8, ROWWISE, STEPS, TINY, degrees, layout_run, losses, plait_forked,
                      run_plait)
from plait import float8
from plait.checkpoint.offline import load_full_state_dict
from plait.arguments import parse_args
from plait.checks import check_options
from plait.config import ConfigError
from plait.models.args import ModelArgs
from plait.models.flavors import model_args
from plait.proof.trace import summarise

# The debug model's blocks: 2 x (wq, wk, wv, wo, w1, w2, w3) run float8; the output layer does not.
CONVERTED, LINEAR_LAYERS = 14, 15


def matmuls(probe, phase: str, rank: int = 0) -> dict[str, int]:
    """dtypes -> calls of the matmuls rank `rank` ran in `phase`, per step."""
    found: dict[str, int] = {}
    for r in probe:
        if r["phase"] == phase and r["kind"] == "matmul" and r["rank"] == rank:
            found[r["dtypes"]] = found.get(r["dtypes"], 0) + r["count"]
    return found


def test_the_plan_converts_the_blocks_linear_layers_and_keeps_the_output_layer():
    plan = float8.layer_plan(model_args("debug", 512), tp=1)
    assert sum(why == "" for why in plan.values()) == CONVERTED and len(plan) == LINEAR_LAYERS
    assert "softmax" in plan["output"]
    # Under TP the shapes that count are each rank's: at tp 8 the 64 rows of wk and wv (2 KV heads
    # of 32) are 8 per rank, which float8 cannot multiply; wq's 128 are 16.
    split = float8.layer_plan(model_args("debug", 512), tp=8)
    assert {name.split(".")[-1] for name, why in split.items() if "per-rank weight 8x128" in why} == {"wk", "wv"}
    assert split["layers.0.attention.wq"] == ""
    odd = float8.layer_plan(ModelArgs(dim=48, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=64, multiple_of=16), tp=1)
    assert "multiple of 16" in odd["layers.0.attention.wk"]  # 24 x 48: one KV head of 24


def test_a_model_no_layer_of_which_can_run_float8_is_refused():
    args = ModelArgs(dim=24, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=64, multiple_of=8)
    with pytest.raises(ConfigError, match="training.float8: no linear layer"):
        float8.check_layers(args, parse_args([*TINY, *FLOAT8]), torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("argv, fragment", [
    ([*FLOAT8, "--parallelism.dp_backend", "simple_fsdp", "--parallelism.dp_shard", "2"], "simple_fsdp"),
])
def test_layouts_that_cannot_run_float8_refuse_to_start(argv, fragment):
    with pytest.raises(ConfigError, match=f"training.float8: .*{fragment}"):
        check_options(parse_args(argv), world=2)


def test_without_torchao_float8_is_refused_naming_the_extra(monkeypatch):
    monkeypatch.setattr(float8, "available", lambda: False)
    with pytest.raises(ConfigError, match=r"training.float8: needs torchao.*plait\[float8\]"):
        check_options(parse_args([*TINY, *FLOAT8]), world=1)


PROBED = {  # name: (layout, precision, micro-batches per rank and step): every layout with a float8
    # row, and the bf16 runs (data parallelism gives each rank one micro-batch of 2 sequences)
    "single": ("single_f8", [], 2), "fsdp2": ("fsdp2_f8", [], 1), "ddp": ("ddp_f8", [], 1),
    "classic_ddp": ("classic_ddp_f8", [], 1), "tp": ("tp_f8", [], 2),
    "pp": ("pp_f8", [], 2), "fsdp2_tp": ("fsdp2_tp_f8", [], 1), "single_rowwise": ("single_f8_rowwise", [], 2),
    "tp_rowwise": ("tp_f8_rowwise", [], 2), "single_bf16": ("single_f8", BF16, 2), "fsdp2_bf16": ("fsdp2_f8", BF16, 1),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", PROBED)
def test_converted_layers_multiply_in_float8_forward_and_backward(train_once, name):
    """Per micro-batch, the 14 converted layers run one float8 matmul in forward (input and weight
    e4m3) and two in backward (tensorwise: the output gradient in e5m2, its range; rowwise: all
    e4m3), each with fp32 scales; the only other matmuls are the output layer's, in the compute
    dtype, all three in forward (the chunked loss computes its gradients there; one chunk: a
    micro-batch holds 128 tokens); attention runs in the compute dtype. Rank 0 (each stage of
    the pipeline)."""
    layout, precision, micro = PROBED[name]
    _, probe = layout_run(train_once, layout, precision)
    compute = "bfloat16" if precision else "float32"
    backward_inputs = "float32,float8_e4m3fn" if "rowwise" in layout else "float32,float8_e4m3fn,float8_e5m2"
    stages = 2 if layout.startswith("pp") else 1  # a stage holds half the blocks
    for rank in range(stages):
        forward, backward = matmuls(probe, "forward", rank), matmuls(probe, "backward", rank)
        last = rank == stages - 1  # holds the output layer
        assert forward == {"float32,float8_e4m3fn": micro * CONVERTED // stages,
                           **({compute: 3 * micro} if last else {})}, (rank, forward)
        assert backward == {backward_inputs: 2 * micro * CONVERTED // stages}, (rank, backward)
        assert {r["dtypes"] for r in probe if r["rank"] == rank and r["kind"] == "attention"} == {compute}
    if not layout.startswith("tp") and "_tp" not in layout:  # under TP the op is DTensor's mm of float8 data
        assert {r["op"] for r in probe if r["kind"] == "matmul" and "float8" in r["dtypes"]} == {"_scaled_mm"}


@pytest.mark.slow
@pytest.mark.parametrize("layout, micro", [("single_mla_f8", 2), ("fsdp2_mla_f8", 1)])
def test_latent_attention_and_the_mtp_module_multiply_in_float8(train_once, layout, micro):
    """DeepSeek-V3 (debug_mla): per micro-batch 25 linear layers run float8 (each block's five of
    latent attention and three of its dense FFN or shared expert, the MTP module's projection and
    its block's eight), forward once and backward twice; the routers, the experts' grouped
    matmuls and the output layer do not."""
    _, probe = layout_run(train_once, layout)
    eight = lambda phase: sum(n for dtypes, n in matmuls(probe, phase, 0).items() if "float8" in dtypes)
    assert (eight("forward"), eight("backward")) == (25 * micro, 50 * micro), (matmuls(probe, "forward", 0),
                                                                                matmuls(probe, "backward", 0))


@pytest.mark.slow
def test_fsdp2_all_gathers_float8_weights_as_one_byte_elements_half_of_bf16(train_once):
    """Measured from the profiler traces of the bf16 FSDP2 runs with and without float8: the
    blocks' forward all-gathers carry 1-byte elements (uint8 views of the float8 weights and the
    blocks' bf16 norm weights' bytes), about half the bf16 run's; the root unit (embedding and
    output layer, not converted) is gathered in bf16 as before."""
    world, args = LAYOUTS["fsdp2_f8"]
    plain_args = [a for a in args if a not in FLOAT8]
    rows = {}
    for key, options in (("float8", (*STEPS, *args, *BF16)), ("bf16", (*STEPS, *plain_args, *BF16))):
        train_once(world, *options)
        rows[key] = {(r["phase"], r["kind"], r["dtype"]): r["bytes_per_step"]
                     for r in summarise(train_once.traces[(world, options)], rank=0)}
    f8, bf16 = rows["float8"], rows["bf16"]
    root = f8["forward", "all_gather", "bfloat16"]  # embedding + output + final norm, in bf16
    blocks_f8, blocks_bf16 = f8["forward", "all_gather", "uint8"], bf16["forward", "all_gather", "bfloat16"] - root
    ratio = blocks_f8 / blocks_bf16
    print(f"\nblocks' forward all-gather bytes: float8 {blocks_f8:.0f}, bf16 {blocks_bf16:.0f}, ratio {ratio:.4f}")
    assert 0.5 <= ratio < 0.502, ratio  # the norm weights stay 2 bytes: 0.5 + their share
    assert ("backward", "reduce_scatter", "float32") in f8  # gradients as before


@pytest.mark.slow
def test_a_float8_checkpoint_holds_fp32_master_weights_and_resumes_with_and_without_float8(tmp_path):
    """FSDP2 float8 all-gather wraps the weights in a torchao class; the checkpoint holds the
    plain fp32 tensors (loadable by the weights-only reader), so float8 resumes bitwise from
    its own checkpoint (loading plain tensors into torchao's wrappers, as it would from a bf16
    run's checkpoint), a run without float8 resumes from it, and it exports as any checkpoint."""
    world, args = LAYOUTS["fsdp2_f8"]
    ck = ["--checkpoint.folder", str(tmp_path / "ck"), "--checkpoint.interval", "2", "--training.steps", "4"]
    whole = losses(run_plait(tmp_path, *args, *ck, nproc=world)[0])
    shutil.rmtree(tmp_path / "ck" / "step-4")
    assert losses(run_plait(tmp_path, *args, *ck, nproc=world)[0]) == whole[2:]  # float8 from step 2
    shutil.rmtree(tmp_path / "ck" / "step-4")
    plain = run_plait(tmp_path, *degrees(1, 2), *ck, nproc=world)[0]  # the same weights, without float8
    # Steps 3-4 of the same weights and batches without float8: float8's rounding apart (1.7e-4
    # between float8 and fp32 over 6 steps on one device).
    assert [row["step"] for row in plain] == [3, 4] and max(abs(a - b) for a, b in zip(losses(plain), whole[2:])) < 2e-3
    # The Hugging Face export of a float8 checkpoint: its fp32 master weights, as of any run.
    out = tmp_path / "hf"
    proc = plait_forked("export", "--checkpoint", str(tmp_path / "ck" / "step-2"), "--out", str(out),
                        "--dtype", "float32")
    assert proc.returncode == 0, proc.stderr[-2000:]
    exported = load_file(out / "model.safetensors")
    saved = load_full_state_dict(tmp_path / "ck" / "step-2", model_args("debug", 512), "checkpoint")
    assert torch.equal(exported["model.layers.0.self_attn.v_proj.weight"], saved["layers.0.attention.wv.weight"])


MX_PROBED = {  # name: (layout, precision, micro-batches per rank, dense layers converted, MoE layers in MXFP8)
    "single": ("single_mx", [], 2, CONVERTED, 0), "fsdp2": ("fsdp2_mx", [], 1, CONVERTED, 0),
    "tp": ("tp_mx", [], 1, CONVERTED, 0), "single_moe_bf16": ("single_moe_mx", BF16, 2, 8, 2),
    "ep2_bf16": ("ep2_moe_mx", BF16, 1, 8, 2), "single_moe_fp32": ("single_moe_mx", [], 2, 8, 0),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", MX_PROBED)
def test_mxfp8_quantises_every_converted_matmul_forward_and_backward(train_once, name):
    """Emulated MXFP8 multiplies values cast to e4m3 in blocks of 32 and back, in the compute
    dtype: the casts prove it. Per micro-batch and rank, a converted linear layer casts its input
    and weight in forward and, in backward, the output gradient both ways, the weight and the
    input along the other axis (4); each of an MoE layer's three grouped matmuls the same (2 and
    4). Under TP each rank casts its shards (a weight reached through DTensor's matmul would cast
    nothing: the bug this caught). Under fp32 compute the experts stay fp32 (MXFP8's grouped
    matmul is bf16-only)."""
    layout, precision, micro, dense, moe = MX_PROBED[name]
    _, probe = layout_run(train_once, layout, precision)
    casts = {phase: sum(r["count"] for r in probe if (r["rank"], r["phase"], r["kind"]) == (0, phase, "quantize"))
             for phase in ("forward", "backward")}
    assert casts == {"forward": micro * (2 * dense + 6 * moe), "backward": micro * (4 * dense + 12 * moe)}, casts
    assert {r["dtypes"].split("->")[1] for r in probe if r["kind"] == "quantize"} == {"float8_e4m3fn"}
    compute = "bfloat16" if precision else "float32"
    # (fp32: plait's own grouped operator, plait/models/expert_matmul.py, forward and weight gradient)
    grouped = {r["dtypes"] for r in probe if r["op"] in ("_grouped_mm", "expert_matmul", "expert_weight_gradient")}
    assert grouped == ({compute} if "moe" in layout else set())


@pytest.mark.slow
def test_mxfp8_wgrad_hp_keeps_the_weight_gradients_matmul_in_the_compute_dtype(train_once):
    """mxfp8_wgrad_hp: forward and the input gradient as mxfp8 (casts of the input and weight,
    then the output gradient and the weight along the other axis); the weight gradient from the
    unquantised input and output gradient: 2 backward casts per layer, not 4."""
    _, probe = layout_run(train_once, "single_mx_wgrad_hp")
    casts = {phase: sum(r["count"] for r in probe if (r["phase"], r["kind"]) == (phase, "quantize"))
             for phase in ("forward", "backward")}
    assert casts == {"forward": 2 * 2 * CONVERTED, "backward": 2 * 2 * CONVERTED}, casts


def test_the_mxfp8_plan_takes_blocks_of_32_and_leaves_biased_layers_and_fp32_experts_out():
    args = model_args("debug", 512)
    assert float8.layer_plan(args, tp=1, recipe="mxfp8") == float8.layer_plan(args, tp=1)  # debug: multiples of 32
    odd = ModelArgs(dim=48, n_layers=1, n_heads=2, n_kv_heads=2, vocab_size=64, multiple_of=16)
    assert "multiple of 32" in float8.layer_plan(odd, tp=1, recipe="mxfp8")["layers.0.attention.wq"]
    assert float8.layer_plan(odd, tp=1)["layers.0.attention.wq"] == ""  # (48 x 48: float8's 16 divide it)
    qwen2 = model_args("debug_qwen2", 512)  # (biases on wq, wk, wv)
    assert "drop its bias" in float8.layer_plan(qwen2, tp=1, recipe="mxfp8")["layers.0.attention.wq"]
    moe, cpu = model_args("debug_moe", 512), torch.device("cpu")
    assert set(float8.expert_plan(moe, "mxfp8", cpu, torch.bfloat16).values()) == {""}
    assert "bfloat16 only" in float8.expert_plan(moe, "mxfp8", cpu, torch.float32)["layers.0.feed_forward.experts"]
    assert "sm90" in float8.expert_plan(moe, "tensorwise", cpu, torch.bfloat16)["layers.0.feed_forward.experts"]


@pytest.mark.parametrize("argv, fragment", [
    ([*TINY, *MXFP8, "--training.mixed_precision_mode", "autocast"], "mixed_precision_mode param"),
    ([*TINY, *MXFP8, "--training.seq_len", "48", "--training.micro_batch_size", "1"], "48 tokens per rank"),
])
def test_mxfp8_refuses_what_it_cannot_run_in_one_line(argv, fragment):
    with pytest.raises(ConfigError, match=f"training.float8: .*{fragment}"):
        check_options(parse_args(argv), world=1)
    check_options(parse_args([*argv[:-2], "--training.float8", "mxfp8_wgrad_hp"] if "48" in argv else TINY), world=1)


@pytest.mark.slow
def test_an_mxfp8_checkpoint_holds_fp32_master_weights_and_resumes_under_another_recipe(tmp_path):
    """TP2 MXFP8 (torchao's training tensor inside TP's DTensors): the checkpoint holds plain fp32
    tensors, an MXFP8 resume is bitwise the continuous run, and a resume under float8 rowwise
    (another recipe: its own layer classes) trains on from the same weights."""
    world, args = LAYOUTS["tp_mx"]
    ck = ["--checkpoint.folder", str(tmp_path / "ck"), "--checkpoint.interval", "2", "--training.steps", "4"]
    whole = losses(run_plait(tmp_path, *args, *ck, nproc=world)[0])
    saved = load_full_state_dict(tmp_path / "ck" / "step-2", model_args("debug", 512), "checkpoint")
    assert all(type(t) is torch.Tensor and t.dtype == torch.float32 for t in saved.values())
    shutil.rmtree(tmp_path / "ck" / "step-4")
    assert losses(run_plait(tmp_path, *args, *ck, nproc=world)[0]) == whole[2:]
    shutil.rmtree(tmp_path / "ck" / "step-4")
    rowwise = [*[a for a in args if a not in MXFP8], *ROWWISE]
    other = losses(run_plait(tmp_path, *rowwise, *ck, nproc=world)[0])
    assert len(other) == 2 and max(abs(a - b) for a, b in zip(other, whole[2:])) < 2e-3


def test_compiled_mxfp8_experts_are_refused_naming_the_way_out():
    args, cfg = model_args("debug_moe", 512), parse_args([*TINY, *MXFP8, "--compile.enable"])
    with pytest.raises(ConfigError, match="compile.enable: not with the experts' grouped matmuls in mxfp8"):
        float8.check_layers(args, cfg, torch.device("cpu"), torch.bfloat16)
    float8.check_layers(args, cfg, torch.device("cpu"), torch.float32)  # (fp32: the experts stay fp32)


def test_one_device_mxfp8_keeps_fully_shard_whose_parameter_is_reused():
    """A fresh compute-dtype copy of torchao's MXFP8 weight wrapper as a leaf each step is never
    freed (torch 2.13, torchao 0.18: 0.17 GiB a step on `small`, OOM-killed at step 67 of a
    200-step run); fully_shard at degree 1 reuses one unsharded parameter (flat over 40 steps)."""
    from plait.precision import resolve
    assert not resolve(check_options(parse_args([*TINY, *MXFP8, *BF16]), world=1)).one_device
    assert resolve(check_options(parse_args([*TINY, *BF16]), world=1)).one_device


def test_emulated_tensorwise_float8_equals_the_cpu_scaled_mm_within_fp32_summation_order():
    """On a CPU, tensorwise float8 matmuls dequantise and multiply in fp32 (torchao's emulation)
    instead of torch's CPU _scaled_mm, which is slow (issue 62: 4.7 s vs 4.6 ms for one 256 x 768 x
    768 forward on an AMX Xeon): the output and both gradients are _scaled_mm's within fp32
    summation order (measured 2.4e-7 of the largest value; bound 1e-6)."""
    import dataclasses

    from torch import nn
    torchao_float8 = pytest.importorskip("torchao.float8")
    from plait.float8 import _recipe

    emulated = _recipe("tensorwise", False, "cpu")
    assert emulated.emulate
    results = []
    for config in (dataclasses.replace(emulated, emulate=False), emulated):
        torch.manual_seed(0)
        layer = nn.Sequential(nn.Linear(768, 768, bias=False))
        torchao_float8.convert_to_float8_training(layer, config=config)
        torch.manual_seed(1)
        x, grad = torch.randn(256, 768, requires_grad=True), torch.randn(256, 768)
        out = layer(x)
        out.backward(grad)
        results.append((out.detach(), x.grad, layer[0].weight.grad))
    for scaled_mm, dequantised in zip(*results):
        assert (scaled_mm - dequantised).abs().max() <= 1e-6 * scaled_mm.abs().max()
