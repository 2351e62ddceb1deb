"""DeepSeek-V3's pieces that no other family has: multi-token prediction's loss against a
per-token reference, its weights in and out of a Hugging Face folder, the sequence-wise balance
loss against a per-sequence reference, and the refusals.
Latent attention's logits against transformers are in test_families, its layouts in the parity
matrix (conftest's *_mla rows), its routing in test_moe."""

import json

import pytest
import torch
import torch.nn.functional as F

from conftest import LAYOUTS, TINY, layout_run
from plait.arguments import parse_args
from plait.checks import check_options
from plait.config import ConfigError
from plait.models.flavors import model_args
from plait.models.transformer import Transformer
from plait.models.weights import init_weights
from test_parity import REFERENCE


def mtp_model() -> Transformer:
    model = Transformer(model_args("debug_mla", 320))
    init_weights(model, seed=3)
    with torch.no_grad():  # norm weights away from 1: a norm applied to the wrong tensor must show
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    return model


def test_mtp_loss_and_its_gradient_equal_a_per_token_reference():
    """At each position t of each sequence: the MTP module joins the RMSNorm of the embedding of
    token t+1 and of the model's output at t after its final norm (that order: DeepSeek's eh_proj;
    that output: the one vLLM, SGLang and Megatron-Core hand the module), runs its block
    over the sequence, and predicts token t+2 through its norm and the shared output layer. The
    loss is the sum over positions with a token t+2 divided by all positions; the gradient is that
    of loss + mtp_loss_weight x MTP loss."""
    torch.manual_seed(0)
    model, weight = mtp_model(), 0.3
    tokens = torch.randint(0, 320, (2, 24))
    labels = torch.randint(0, 320, (2, 24))
    further = torch.cat([labels[:, 1:], torch.full((2, 1), -100)], dim=1)
    model.mtp_scale = weight
    loss = model(tokens, next_tokens=(labels, further), labels=labels)
    loss.backward()
    measured, grads = model.mtp_records[0], {n: p.grad.clone() for n, p in model.named_parameters()}

    model.zero_grad()
    outputs = {}
    model.layers["1"].register_forward_hook(lambda module, args, out: outputs.setdefault("h", out))
    main = model(tokens, labels=labels)
    h, predictor = outputs["h"], model.mtp["0"]
    joined = torch.stack([torch.stack([predictor.eh_proj(torch.cat([
        predictor.enorm(model.tok_embeddings.weight[labels[b, t]]), predictor.hnorm(model.norm(h[b, t]))]))
        for t in range(24)]) for b in range(2)])
    out = predictor.block(joined, model.rope)
    total = torch.zeros(())
    for b in range(2):
        for t in range(23):  # the last position has no token t+2
            logits = model.output.weight @ predictor.norm(out[b, t])
            total = total + F.cross_entropy(logits[None], labels[b, t + 1][None])
    reference = total / (2 * 24)
    (main + weight * reference).backward()
    assert torch.allclose(measured, reference.detach(), rtol=1e-5, atol=0), (measured, reference)
    for name, param in model.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert grads["mtp.0.eh_proj.weight"].abs().sum() > 0


def test_mtp_weights_in_and_out_of_a_deepseek_v3_folder(tmp_path):
    """The MTP module is DeepSeek-V3's layer <n_layers> of a folder (transformers ignores it; its
    logits are the model's without it): read when present, written back bitwise with its copies of
    the embedding and output layer; a folder without it (transformers' saves) trains without."""
    from safetensors.torch import load_file

    from plait import hf
    from plait.hf.config import hf_config
    from plait.hf.weights import write_weights
    from plait.models.weights import fill_weights

    model = mtp_model()
    state = model.state_dict()
    write_weights(state, model.args, tmp_path / "a", torch.float32, 1 << 30)
    (tmp_path / "a" / "config.json").write_text(json.dumps(hf_config(model.args, torch.float32, None, 0)))
    written = load_file(tmp_path / "a" / "model.safetensors")
    assert torch.equal(written["model.layers.2.eh_proj.weight"], state["mtp.0.eh_proj.weight"])
    assert torch.equal(written["model.layers.2.shared_head.norm.weight"], state["mtp.0.norm.weight"])
    assert torch.equal(written["model.layers.2.self_attn.kv_b_proj.weight"], state["mtp.0.block.attention.wkv_b.weight"])
    assert torch.equal(written["model.layers.2.embed_tokens.weight"], state["tok_embeddings.weight"])
    assert torch.equal(written["model.layers.2.shared_head.head.weight"], state["output.weight"])

    args = hf.model_args(tmp_path / "a", "checkpoint.load")
    assert args == model.args
    weights = hf.HFWeights(tmp_path / "a", args, "checkpoint.load")
    again = Transformer(args)
    fill_weights(again, lambda name, shape: weights[name], weights.buffers)
    write_weights(again.state_dict(), args, tmp_path / "b", torch.float32, 1 << 30)
    back = load_file(tmp_path / "b" / "model.safetensors")
    assert written.keys() == back.keys() and all(torch.equal(written[k], back[k]) for k in written)

    for name in [n for n in written if n.startswith("model.layers.2.")]:
        del written[name]
    from safetensors.torch import save_file

    save_file(written, str(tmp_path / "a" / "model.safetensors"))
    assert hf.model_args(tmp_path / "a", "checkpoint.load").mtp_layers == 0


def test_the_sequence_wise_balance_loss_and_its_gradient_equal_a_per_sequence_reference():
    """DeepSeek-V3's sequence-wise loss of a sigmoid router's layer, per sequence b of T tokens:
    f_e = E / (k T) x the tokens of b whose top k hold e, P_e = the mean over b's tokens of e's
    score divided by the token's sum of scores, L_b = sum_e f_e P_e; the layer's loss is the mean
    of L_b, 1 when balanced, and its gradient joins the routers' as scale x dL (the layer's
    output unchanged)."""
    from plait.models.moe import MoE

    torch.manual_seed(0)
    args = model_args("debug_mla", 320)
    layer, scale = MoE(args.dim, args), 0.5
    with torch.no_grad():  # (the balancing bias steers the choice, not the scores P averages)
        for param in layer.parameters():
            param.normal_(0, 0.02)
        layer.router.bias.uniform_(-0.01, 0.01)
    x = torch.randn(3, 10, args.dim)
    layer.aux_scale = scale
    out = layer(x)
    out.sum().backward()
    measured, grad = layer.records[0][1], layer.router.gate.weight.grad.clone()

    layer.zero_grad()
    layer.aux_scale = 0.0
    plain = layer(x)
    assert torch.equal(plain, out) and layer.records[1][1] is None  # (no loss asked: none computed)
    per_sequence = []
    for b in range(3):
        scores, experts, _ = layer.router(x[b])
        f = [args.n_experts / (args.top_k * 10) * sum(int(e in experts[t]) for t in range(10))
             for e in range(args.n_experts)]
        p = [sum(scores[t, e] / scores[t].sum() for t in range(10)) / 10 for e in range(args.n_experts)]
        per_sequence.append(sum(fe * pe for fe, pe in zip(f, p)))
    reference = sum(per_sequence) / 3
    (plain.sum() + scale * reference).backward()
    assert torch.allclose(measured, reference.detach(), rtol=1e-6, atol=0), (measured, reference)
    torch.testing.assert_close(grad, layer.router.gate.weight.grad, rtol=1e-5, atol=1e-8)
    assert 1 <= measured < 2  # (near balance: 1)


def test_the_balance_loss_coefficient_weighs_the_mean_over_every_moe_layer_the_mtp_block_s_included():
    """training.moe_sequence_aux_coef c weighs the mean over MoE layers of their balance losses
    (config.py, docs/moe.md), and the MTP block's MoE is one of those layers (a block like the
    others: its routing is balanced as theirs; the logged aux_loss averages its records too), so
    the scales the trainer sets (ExpertLoad, further_tokens) give the gradient of loss +
    mtp_loss_weight x MTP loss + c x mean over all L MoE layers, L = 2 on debug_mla (block 1 and
    the MTP block). Issue 60 item 12: ExpertLoad divided by the main blocks' MoE layers (1) only,
    so c weighed their sum: (L / (L - 1)) c. The reference forwards the same model with no scale
    set and adds c x the mean of each layer's loss from its own routing: equal to the bit (the same
    ops in the same order; each loss's gradient is c / L = 0.25 exactly on both sides), as is the
    logged mean."""
    from plait.expert_load import ExpertLoad, further_tokens
    from plait.models.moe import moe_layers

    torch.manual_seed(0)
    model, c, weight = mtp_model(), 0.5, 0.3
    layers = moe_layers(model)
    assert len(layers) == 2 and model.args.sparse_blocks == 1  # the MTP block's MoE is the second
    tokens = torch.randint(0, 320, (2, 24))
    labels = torch.randint(0, 320, (2, 24))
    further = torch.cat([labels[:, 1:], torch.full((2, 1), -100)], dim=1)
    ExpertLoad(model, model.args, 1, 0.0, 0.0, None, None, sequence_coefficient=c)  # one forward per step
    further_tokens(model, model.args, 1, weight, torch.device("cpu"), None)
    model(tokens, next_tokens=(labels, further), labels=labels).backward()
    trained = {name: param.grad.clone() for name, param in model.named_parameters()}
    logged = [aux for layer in layers for _, aux in layer.records]

    model.zero_grad()
    owner, routed = {id(layer.router): layer for layer in layers}, []
    for layer in layers:
        layer.aux_scale = 0.0
        layer.router.register_forward_hook(lambda router, args, out: routed.append((owner[id(router)], out)))
    loss = model(tokens, next_tokens=(labels, further), labels=labels)  # (the MTP loss weighted as above)
    assert len(routed) == 2
    mean = sum(layer.sequence_aux_loss(experts, scores, 2) for layer, (scores, experts, _) in routed) / 2
    (loss + c * mean).backward()
    assert torch.equal(sum(logged) / len(logged), mean.detach())  # what aux_loss logs (ExpertLoad.step)
    worst = max(((trained[name] - param.grad).abs().max() / param.grad.abs().max()).item()
                for name, param in model.named_parameters() if param.grad.abs().max() > 0)
    print(f"gradients vs c x the mean over {len(layers)} MoE layers: {worst:.2e} (relative)")
    for name, param in model.named_parameters():
        torch.testing.assert_close(trained[name], param.grad, rtol=0, atol=0, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name in LAYOUTS if name.endswith("_mla") and not name.startswith("single")])
def test_every_layout_logs_the_losses_and_gradient_norm_of_the_single_device(train_once, name):
    """The parity matrix's DeepSeek-V3 rows train with the sequence-wise loss (conftest's MLA):
    each step's aux_loss (the mean over layers, micro-batches and sequences; near 1) is the single
    device's to the last bits (fp32; measured 1.2e-7 relative at most). Under cp each rank's term
    sums its own tokens' scores against the whole sequence's routing, which the cp ranks' sum
    gives. So are the MTP loss and the gradient norm (under PP the embedding's copy on the last
    stage counted once)."""
    rows, reference = layout_run(train_once, name)[0], layout_run(train_once, REFERENCE[name])[0]
    assert 1 <= reference[0]["aux_loss"] < 1.5, reference[0]
    for metric in ("aux_loss", "mtp_loss", "grad_norm"):  # (the MTP loss where the row has it)
        if metric in reference[0]:
            assert [r[metric] for r in rows] == pytest.approx([r[metric] for r in reference], rel=1e-6, abs=0), \
                (name, metric)


@pytest.mark.parametrize("argv, message", [
    (["--training.moe_sequence_aux_coef", "-1"], "training.moe_sequence_aux_coef: must be a finite number >= 0"),
    (["--training.moe_sequence_aux_coef", "0.1", "--model.flavor", "debug_moe"],
     "training.moe_sequence_aux_coef: 0.1 weighs a sigmoid router's loss"),
])
def test_a_sequence_wise_loss_where_it_cannot_apply_is_refused_at_start_up(argv, message):
    from plait.job_model import job_model
    from plait.parallel.expert_parallel import check_experts

    with pytest.raises(ConfigError, match=message):
        cfg = check_options(parse_args([*TINY, "--model.flavor", "debug_mla", *argv]), world=1)
        check_experts(job_model(cfg, 256), cfg)


@pytest.mark.parametrize("argv, message", [
    (["--parallelism.pp", "2", "--parallelism.pp_schedule", "zbv"], "parallelism.pp_schedule: zbv runs the first and"),
    (["--model.mtp_layers", "2"], "model.mtp_layers: 2; allowed: -1"),
])
def test_what_multi_token_prediction_cannot_do_is_refused_at_start_up(argv, message):
    with pytest.raises(ConfigError, match=message):
        check_options(parse_args([*TINY, "--model.flavor", "debug_mla", *argv]), world=2)


@pytest.mark.parametrize("change, message", [
    ({"rope_interleave": False}, "sets rope_interleave false"),
    ({"scoring_func": "softmax"}, "sets scoring_func 'softmax'"),
    ({"topk_method": "group_limited_greedy"}, "sets topk_method 'group_limited_greedy'"),
    ({"n_group": 3}, "sets n_group 3, topk_group 2 for 8 experts"),
    ({"num_nextn_predict_layers": 2}, "sets num_nextn_predict_layers 2"),
])
def test_deepseek_configs_plait_does_not_compute_are_refused_by_name(tmp_path, change, message):
    from plait import hf

    config = {"model_type": "deepseek_v3", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "vocab_size": 320, "n_routed_experts": 8, "moe_intermediate_size": 32,
              "n_group": 4, "topk_group": 2, "num_experts_per_tok": 2}
    (tmp_path / "config.json").write_text(json.dumps(config | change))
    with pytest.raises(ConfigError, match=message):
        hf.model_args(tmp_path, "checkpoint.load")


def deepseek_folder(folder, rope_parameters: dict):
    """A tiny DeepSeek-V3 as transformers makes it (test_families' shape) with this RoPE, saved to `folder`."""
    transformers = pytest.importorskip("transformers")
    from test_families import BASE, CONFIGS

    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(**(BASE | CONFIGS["deepseek_v3"][1] | {"rope_parameters": rope_parameters}))
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(folder)
    return model


def test_linear_rope_with_mscale_all_dim_scales_the_softmax_as_transformers_and_exports_it(tmp_path):
    """transformers' DeepseekV3 multiplies its softmax scale by yarn_mscale(factor, mscale_all_dim)^2
    under any RoPE scaling, not YaRN's alone (yarn_apply_mscale): linear scaling too. plait computes
    its logits, and its export keeps mscale_all_dim: transformers reads back the same model."""
    from plait.hf.config import hf_config
    from plait.hf.weights import write_weights
    from test_hf import plait_model

    rope = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0, "mscale_all_dim": 1.0}
    theirs = deepseek_folder(tmp_path / "source", rope)
    ours, weights = plait_model(tmp_path / "source")
    tokens = torch.randint(0, 320, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = theirs(tokens).logits
        diff = (ours(tokens) - expected).abs().max().item()
    print(f"\nlinear + mscale_all_dim: max |logits - transformers'| {diff:.2e}")
    assert diff <= 1e-5  # as test_families' test_logits_equal_transformers

    out = tmp_path / "exported"
    write_weights(dict(weights.items()) | weights.buffers, ours.args, out, torch.float32, 1 << 30)
    (out / "config.json").write_text(json.dumps(hf_config(ours.args, torch.float32, None, 0)))
    transformers = pytest.importorskip("transformers")
    again = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert {k: again.config.rope_parameters.get(k) for k in rope} == rope
    with torch.no_grad():
        assert (again(tokens).logits - expected).abs().max().item() <= 1e-5
    from plait import hf

    assert hf.model_args(out, "checkpoint.load") == ours.args


def test_shared_expert_weights_a_config_json_leaves_out_are_refused_not_dropped(tmp_path):
    """A config.json of no shared experts (n_shared_experts 0) over a folder holding them: refused
    by name rather than the folder's weights left unread (transformers builds 0-wide shared experts
    for it; no published DeepSeek-V3 has none), and one that moves where the sparse blocks begin
    is refused by the weights it lacks."""
    from plait import hf

    deepseek_folder(tmp_path, {"rope_type": "default", "rope_theta": 10000.0})
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"n_shared_experts": 0}))
    with pytest.raises(ConfigError, match=r"sets n_shared_experts 0; allowed: an integer >= 1 "):
        hf.model_args(tmp_path, "checkpoint.load")
    (tmp_path / "config.json").write_text(json.dumps(config | {"first_k_dense_replace": 2}))
    args = hf.model_args(tmp_path, "checkpoint.load")
    with pytest.raises(ConfigError, match=r"lacks \['model.layers.1.mlp.gate_proj.weight'"):
        hf.HFWeights(tmp_path, args, "checkpoint.load")
