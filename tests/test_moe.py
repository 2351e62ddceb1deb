"""Mixtures of experts: the layer against a per-expert loop, routing rules, the auxiliary loss's
gradient, expert parallelism's regrouping, what the shared runs' metrics, probe and traces show,
what a pipeline counts and its router biases, and the refusals. Parity against the single device
is in test_parity (conftest's *_moe rows)."""

import pytest
import torch
import torch.nn.functional as F

from conftest import BF16, CP2, LAYOUTS, MOE, PP2, REFERENCE, SIGMOID, STEPS, layout_run, losses, run_plait
from plait.cli import main
from plait.models.transformer import Transformer, num_params
from plait.models.flavors import model_args
from plait.models.moe import AuxLoss, Router, swiglu_experts
from plait.parallel.expert_parallel import dynamic_rows, local_experts, regroup
from plait.proof.trace import summarise
from plait.models.flavors import FLAVORS


def per_expert_loop(x, counts, w1, w2, w3):
    return torch.cat([F.linear(F.silu(F.linear(rows, a)) * F.linear(rows, c), b)
                      for rows, a, b, c in zip(x.split(counts.tolist()), w1, w2, w3)])


@pytest.mark.parametrize("dtype, kernel", [(torch.float32, True), (torch.float32, False), (torch.bfloat16, True)])
def test_grouped_experts_equal_a_loop_over_experts_forward_and_backward(dtype, kernel, monkeypatch):
    """Each expert's rows multiplied as by their own matmuls (an expert without tokens included), to
    the dtype's rounding (torch.testing's defaults): the grouped kernel need not block the sums as
    this CPU's F.linear does. fp32 goes through plait's operator (its own backward): with the
    grouped kernel, and with the loop over experts it runs where the kernel does not (CUDA in fp32)."""
    from plait.models import expert_matmul

    monkeypatch.setattr(expert_matmul, "_kernel_runs", lambda x: kernel)
    torch.manual_seed(0)
    counts = torch.tensor([5, 0, 3, 8])
    x = torch.randn(16, 32, dtype=dtype, requires_grad=True)
    weights = [torch.randn(4, *shape, dtype=dtype, requires_grad=True) for shape in ((24, 32), (32, 24), (24, 32))]
    grouped = swiglu_experts(x, counts, *weights)
    upstream = torch.randn_like(grouped)  # (a real gradient: torch 2.13's grouped backward refuses a stride-0 one)
    grouped.backward(upstream)
    grads = [t.grad.clone() for t in (x, *weights)]
    for t in (x, *weights):
        t.grad = None
    looped = per_expert_loop(x, counts, *weights)
    looped.backward(upstream)
    torch.testing.assert_close(grouped, looped)
    for got, want in zip(grads, [t.grad for t in (x, *weights)]):
        torch.testing.assert_close(got, want)


def test_router_breaks_ties_to_the_lower_expert_and_renormalises():
    router = Router(4, 4, 2, "softmax", True, 1.0)
    with torch.no_grad():
        router.gate.weight.copy_(torch.tensor([[0.0] * 4, [1.0] * 4, [1.0] * 4, [1.0] * 4]))
    scores, experts, weights = router(torch.ones(1, 4))
    assert experts.tolist() == [[1, 2]]  # experts 1, 2 and 3 tie: the two lowest
    assert scores.dtype == weights.dtype == torch.float32
    assert torch.allclose(weights, torch.tensor([[0.5, 0.5]]))


def test_group_limited_routing_picks_experts_of_the_best_groups_only():
    """DeepSeek-V3's routing by hand: 8 experts in 4 groups, the 2 groups whose two best (biased)
    scores sum highest are kept, top 2 among their experts, weights normalised then scaled."""
    router = Router(8, 8, 2, "sigmoid", True, 2.5, groups=4, top_groups=2)
    logits = torch.tensor([[3.0, -4.0, 1.0, 1.0, 0.5, 0.4, -1.0, 2.5]])
    with torch.no_grad():
        router.gate.weight.copy_(torch.eye(8))
    scores, experts, weights = router(logits)
    # group sums of the two best: 0.95+0.02, 0.73+0.73, 0.62+0.60, 0.27+0.92: groups 1 and 2 win,
    # so expert 0 (the best score, in group 0) and expert 7 (group 3) are out
    assert experts.tolist() == [[2, 3]]
    assert torch.allclose(weights, 2.5 * scores[:, [2, 3]] / scores[:, [2, 3]].sum())
    router.bias.copy_(torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]))  # group 3 now wins, and its expert 7
    assert router(logits)[1].tolist() == [[7, 2]]


def test_sigmoid_router_bias_steers_the_choice_not_the_weights():
    router = Router(4, 4, 1, "sigmoid", False, 1.0)
    with torch.no_grad():
        router.gate.weight.copy_(torch.eye(4))
        router.bias.copy_(torch.tensor([0.0, 0.0, 0.0, 1.0]))
    x = torch.tensor([[2.0, 0.0, 0.0, 0.0]])
    scores, experts, weights = router(x)
    assert experts.tolist() == [[3]]  # sigmoid(2) = 0.88 < sigmoid(0) + 1
    assert weights.item() == scores[0, 3].item() == 0.5


def test_aux_loss_adds_its_gradient_and_leaves_the_output():
    a = torch.randn(3, requires_grad=True)
    out = a * 2
    aux = (a ** 2).sum()
    same = AuxLoss.apply(out, aux, 0.25)
    assert torch.equal(same, out)
    same.sum().backward()
    assert torch.allclose(a.grad, 2 + 0.25 * 2 * a.detach())


def test_regroup_orders_tokens_by_expert_then_sender():
    received = torch.tensor([[2, 1], [0, 3]])  # sender 0: 2 for expert 0, 1 for expert 1; sender 1: 0, 3
    rows = ["s0e0", "s0e0", "s0e1", "s1e1", "s1e1", "s1e1"]
    assert [rows[i] for i in regroup(received, len(rows)).tolist()] == ["s0e0", "s0e0", "s0e1", "s1e1", "s1e1", "s1e1"]
    received = torch.tensor([[1, 1], [2, 1]])
    rows = ["s0e0", "s0e1", "s1e0", "s1e0", "s1e1"]
    assert [rows[i] for i in regroup(received, len(rows)).tolist()] == ["s0e0", "s1e0", "s1e0", "s0e1", "s1e1"]


def test_qwen3_30b_a3b_has_its_published_parameter_counts():
    """Qwen3-30B-A3B: 30.5B parameters, 3.3B active (its model card, which truncates 3.35B)."""
    with torch.device("meta"):
        model = Transformer(model_args("qwen3_30b_a3b", 151936))
    assert round(num_params(model) / 1e9, 1) == 30.5
    assert 3.3e9 <= num_params(model, active=True) < 3.4e9


def test_the_expert_metrics_are_logged_and_the_load_counts_every_token(train_once):
    """Every step logs the auxiliary loss (k = 2 when balanced; a uniform router is exactly k) and
    the fewest/most token-slots of an expert over the global batch: 4 sequences x 64 tokens x
    top 2 over 8 experts is 64 each when balanced."""
    for name in ("single_moe", "ep2_moe", "ep2_fsdp2_moe"):
        rows, _ = layout_run(train_once, name)
        for row in rows:
            assert 2 <= row["aux_loss"] < 2.2, (name, row)
            assert 0 < row["expert_load_min"] <= 64 <= row["expert_load_max"] < 4 * 64 * 2, (name, row)
    sigmoid, _ = layout_run(train_once, "ep2_moe_sigmoid")
    assert "aux_loss" not in sigmoid[0] and sigmoid[0]["expert_load_min"] <= 64


def expert_metrics(rows: list[dict]) -> list[tuple]:
    """Each step's (fewest, most) tokens of an expert, and the auxiliary loss where there is one."""
    return [(row["expert_load_min"], row["expert_load_max"], row.get("aux_loss")) for row in rows]


def assert_same_expert_metrics(rows: list[dict], reference: list[dict], rel: float):
    got, want = expert_metrics(rows), expert_metrics(reference)
    assert [g[:2] for g in got] == [w[:2] for w in want], (got, want)
    # The aux loss where the router has one (None for sigmoid routers): pytest >= 9.2's approx refuses None.
    assert [g[2] is None for g in got] == [w[2] is None for w in want], (got, want)
    assert [g[2] for g in got if g[2] is not None] == pytest.approx([w[2] for w in want if w[2] is not None],
                                                                   rel=rel), (got, want)


@pytest.mark.parametrize("name", ["pp_moe", "pp_moe_sigmoid", "pp_ep2_moe"])
def test_a_pipeline_s_shape_inference_counts_in_no_expert_metric(train_once, name):
    """torch's pipeline forwards each stage once more to size its buffers: at the first step, and
    again at the first training step after each validation (switching between eval and step makes
    it infer anew: step 4 of the shared runs), the later stages on uninitialised inputs. That
    pass must route nothing the step counts: every step's expert loads and auxiliary loss are the
    single device's, which forwards the same micro-batches (the aux loss's layer terms are added
    over the stages: last-bit differences). PP2+EP2 too, whose pass also sends its tokens."""
    rows, reference = layout_run(train_once, name)[0], layout_run(train_once, REFERENCE[name])[0]
    assert_same_expert_metrics(rows, reference, rel=1e-6)


def router_biases(folder) -> dict:
    from plait.checkpoint.safe_dcp import load, read_metadata

    metadata = read_metadata(folder).state_dict_metadata
    biases = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in metadata.items() if k.endswith("router.bias")}
    load(biases, folder, no_dist=True)
    return biases


def test_a_pipeline_moves_the_router_bias_as_one_device_and_resumes_bitwise(tmp_path):
    """The sigmoid router's bias, which each step's expert loads move, pipelined over 2 ranks:
    after 3 steps it is the single device's (forwarding the same micro-batches; integer loads
    move it by +-moe_bias_rate, so bitwise), and resumed from there (the pipeline infers its
    shapes again at the resumed run's first step) the last 3 steps and the final biases are
    bitwise those of the run that went on."""
    import shutil

    args = [*SIGMOID, "--training.steps", "6", "--checkpoint.interval", "3"]
    full, _ = run_plait(tmp_path, *args, *PP2, "--checkpoint.folder", str(tmp_path / "pp"), nproc=2)
    run_plait(tmp_path, *args, "--training.micro_batch_size", "2", "--checkpoint.folder", str(tmp_path / "single"))
    single, pipelined = (router_biases(tmp_path / run / "step-3") for run in ("single", "pp"))
    assert len(single) == 2 and all(b.abs().sum() > 0 for b in single.values())  # both layers' biases moved
    assert single.keys() == pipelined.keys() and all(torch.equal(single[k], pipelined[k]) for k in single), \
        (single, pipelined)
    shutil.copytree(tmp_path / "pp" / "step-3", tmp_path / "resumed" / "step-3")
    resumed, proc = run_plait(tmp_path, *args, *PP2, "--checkpoint.folder", str(tmp_path / "resumed"), nproc=2)
    assert "resumed from" in proc.stdout and losses(resumed) == losses(full)[3:]
    final, went_on = (router_biases(tmp_path / run / "step-6") for run in ("resumed", "pp"))
    assert all(torch.equal(final[k], went_on[k]) for k in went_on), (final, went_on)


def dense_first_block_folder(folder):
    """A Hugging Face Qwen3-MoE folder (plait writes it) of debug_moe's shape with block 0 dense
    (mlp_only_layers [0]), and a tokenizer: under PP2 the first stage holds no mixture of experts."""
    import json
    from dataclasses import replace

    from conftest import ROOT
    from plait.data.tokenizer import train_bpe
    from plait.hf.config import hf_config
    from plait.hf.weights import write_weights
    from plait.models.weights import init_weights

    folder.mkdir()
    train_bpe([(ROOT / "README.md").read_text()] * 4, 300).save(str(folder / "tokenizer.json"))
    args = replace(FLAVORS["debug_moe"], vocab_size=320, dense_layers=(0,))
    model = Transformer(args)
    init_weights(model, 0)
    write_weights(model.state_dict(), args, folder, torch.float32, 1 << 30)
    (folder / "config.json").write_text(json.dumps(hf_config(args, torch.float32, None, 0)))
    return folder


@pytest.mark.slow
def test_pp_cp_logs_the_aux_loss_of_one_device_when_rank_0_holds_no_experts(tmp_path):
    """PP2 x CP2 (world 4) of a model whose first stage is a dense block: rank 0, which logs,
    holds no mixture of experts, yet its aux loss is the single device's mean (the cp ranks'
    terms are parts of one sequence's loss, added rather than averaged), as are the loads."""
    folder = dense_first_block_folder(tmp_path / "hf")
    args = ["--checkpoint.load", str(folder), "--training.steps", "2"]
    single, _ = run_plait(tmp_path, *args, "--training.micro_batch_size", "2")
    pp_cp, proc = run_plait(tmp_path, *args, *PP2, *CP2, nproc=4)
    assert "stages of blocks 0-0 | 1-1" in proc.stdout
    assert_same_expert_metrics(pp_cp, single, rel=1e-5)


def test_experts_multiply_in_bf16_and_the_router_in_fp32(train_once):
    """The dtype probe of the EP2 bf16 run: grouped matmuls in bf16 in forward and backward; the
    only fp32 matmuls of forward are the routers' (one per MoE layer and micro-batch)."""
    _, probe = layout_run(train_once, "ep2_moe", BF16)
    matmuls = [r for r in probe if r["kind"] == "matmul"]
    grouped = {(r["phase"], r["dtypes"]) for r in matmuls if r["op"] == "_grouped_mm"}
    assert grouped == {("forward", "bfloat16"), ("backward", "bfloat16")}
    fp32 = [r for r in matmuls if r["phase"] == "forward" and r["dtypes"] == "float32"]
    assert [(r["op"], r["count"]) for r in fp32] == [("mm", 2)]


@pytest.mark.parametrize("name", ["fsdp2_mla", "tp_mla"])
def test_latent_attention_runs_in_bf16_and_its_router_in_fp32(train_once, name):
    """DeepSeek-V3's bf16 runs (debug_mla: one MoE block of two, and the MTP module's): every matmul and attention of
    forward and backward in bf16 (latent projections, heads, experts, shared expert; attention
    in SDPA's fused kernel, its narrower values padded) but the router's: its fp32 scores (one
    matmul in forward) and their gradients (two in backward: its input's and weight's)."""
    _, probe = layout_run(train_once, name, BF16)
    rows = [r for r in probe if r["kind"] in ("matmul", "attention")]
    fp32 = [(r["phase"], r["op"], r["count"]) for r in rows if r["dtypes"] != "bfloat16"]
    # router forwards per rank and step: FSDP2 one micro-batch through a MoE block and the MTP
    # module's; TP two micro-batches through both
    routers = {"fsdp2_mla": 2, "tp_mla": 4}[name]
    assert fp32 == [("backward", "mm", 2 * routers), ("forward", "mm", routers)], probe
    assert {r["op"] for r in rows if r["kind"] == "attention"} == {"_scaled_dot_product_flash_attention_for_cpu"}


def test_expert_parallelism_all_to_alls_in_forward_and_backward_in_bf16(train_once, capsys):
    """The EP2 bf16 run's trace: per MoE layer (2) and step, forward sends the token counts (int64),
    then tokens out and results back (bf16); backward sends both gradients back (bf16)."""
    layout_run(train_once, "ep2_moe", BF16)
    world, args = LAYOUTS["ep2_moe"]
    folder = train_once.traces[(world, (*STEPS, *args, *BF16))]
    rows = {(r["phase"], r["dtype"]): r["calls_per_step"] for r in summarise(folder) if r["kind"] == "all_to_all"}
    assert rows == {("forward", "int64"): 2, ("forward", "bfloat16"): 4, ("backward", "bfloat16"): 4}, rows
    assert main(["trace", str(folder), "--expect", "forward:all_to_all:bf16=4", "--expect",
                 "backward:all_to_all:bf16=4"]) == 0


@pytest.mark.parametrize("options, fragment", [
    (["--parallelism.ep", "2"], "needs a mixture-of-experts model"),
    ([*MOE, "--parallelism.ep", "3"], "must divide dp_shard x cp"),
    ([*MOE, "--parallelism.ep", "2", "--parallelism.dp_backend", "ddp", "--parallelism.dp_replicate", "2",
      "--parallelism.dp_shard", "1"], "allowed with parallelism.dp_backend fsdp2 only"),
])
def test_bad_expert_options_fail_at_start_up_with_one_line(tmp_path, options, fragment):
    _, proc = run_plait(tmp_path, *options, check=False, nproc=2)
    assert proc.returncode == 2 and fragment in proc.stderr, proc.stderr[-2000:]


def test_the_moe_flavors_are_mixtures_of_experts():
    for name in ("debug_moe", "debug_moe_sigmoid", "small_moe", "qwen3_30b_a3b", "qwen3_235b_a22b"):
        assert FLAVORS[name].n_experts and FLAVORS[name].top_k < FLAVORS[name].n_experts


def test_an_ep_checkpoint_resumes_bitwise_and_under_another_layout(tmp_path):
    """EP2 with the sigmoid router, its balancing bias moving fast enough to change the routing
    (moe_bias_rate 0.05: the losses differ from a run without it), saved at step 3: resumed by
    EP2 the last 3 steps are bitwise the uninterrupted run's (expert shards, AdamW state, router
    biases restored), and resumed by one device (the experts' shards read whole) within the fp32
    bound of the parity rows."""
    import shutil

    from conftest import SIGMOID, losses, max_abs_diff

    args = [*SIGMOID, "--training.steps", "6", "--training.moe_bias_rate", "0.05", "--checkpoint.interval", "3"]
    ep2 = ["--parallelism.ep", "2"]
    full, _ = run_plait(tmp_path, *args, *ep2, "--checkpoint.folder", str(tmp_path / "full"), nproc=2)
    unbiased, _ = run_plait(tmp_path, *args, *ep2, "--training.moe_bias_rate", "0", "--checkpoint.folder",
                            str(tmp_path / "unbiased"), nproc=2)
    assert losses(unbiased)[3:] != losses(full)[3:]
    for name in ("ep2", "single"):
        shutil.copytree(tmp_path / "full" / "step-3", tmp_path / name / "step-3")
    resumed, proc = run_plait(tmp_path, *args, *ep2, "--checkpoint.folder", str(tmp_path / "ep2"), nproc=2)
    assert "resumed from" in proc.stdout and losses(resumed) == losses(full)[3:]
    single, _ = run_plait(tmp_path, *args, "--training.micro_batch_size", "2", "--checkpoint.folder",
                          str(tmp_path / "single"))
    assert max_abs_diff(losses(single), losses(full)[3:]) <= 1e-6


def test_the_compiled_experts_of_a_rank_take_any_count_of_tokens_it_receives():
    """Under ep with compile.enable a rank's experts run as one graph whose token count is
    dynamic: a step where the rank receives no token, or one, compiles those apart (dynamo
    specializes 0 and 1), and every count computes what eager does (assert_close's fp32
    bounds: the compiled backward fuses; measured 7.6e-6 at most on gradients up to 136)."""
    torch.manual_seed(0)
    weights = [torch.randn(4, 16, 8, requires_grad=True), torch.randn(4, 8, 16, requires_grad=True),
               torch.randn(4, 16, 8, requires_grad=True)]
    compiled = torch.compile(local_experts, fullgraph=True)
    for received in ([[3, 1, 0, 2], [1, 0, 2, 1]], [[0] * 4] * 2, [[0, 1, 0, 0], [0] * 4], [[2, 2, 1, 0], [0, 3, 1, 1]]):
        received = torch.tensor(received)
        tokens = torch.randn(int(received.sum()), 8)
        outputs, grads = [], []
        for run in (local_experts, compiled):
            x = dynamic_rows(tokens.clone().requires_grad_())
            out = run(x, received, weights, 0.0, 1.702)
            out.sum().backward()
            outputs.append(out)
            grads.append(x.grad)
        torch.testing.assert_close(outputs[1], outputs[0])
        torch.testing.assert_close(grads[1], grads[0])
