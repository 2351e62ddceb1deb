"""Llama's relatives in and out: Qwen2/2.5 (q/k/v biases), Qwen3 (per-head q/k norm, tied),
Mistral, OLMo 2 (norms after each sub-layer, q/k norm over the projection, attention biases),
SmolLM3 (a block without RoPE), Qwen3-MoE (experts, and a dense block among them) and Mixtral,
each a tiny random model made by transformers itself; Qwen2, Qwen3, Mistral and SmolLM3 with
sliding windows shorter than the sequences (in some blocks or all), Qwen3-MoE and OLMo 2 with
YaRN RoPE.

plait builds each from its config.json alone: its logits equal transformers', greedy
`plait generate --ids` gives transformers' greedy tokens, import then export is bitwise with
the same config.json, and a folder trained and exported keeps the source's tokenizer files.
"""

import inspect
import json
import shutil

import pytest
import torch

from conftest import ROOT, plait_forked, run_plait
from test_hf import plait_model

transformers = pytest.importorskip("transformers")

VOCAB = 320
BASE = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=VOCAB, max_position_embeddings=512, eos_token_id=0, bos_token_id=None, pad_token_id=None)
CONFIGS = {  # model_type -> its config class and fields (the families' defaults, sized down)
    # Windows of 8 keys, shorter than the sequences and the generations: blocks 2 and 3 slide (max_window_layers)
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True, rope_theta=1000000.0, use_sliding_window=True,
                                  sliding_window=8, max_window_layers=2)),
    # head_dim is not hidden/heads; local and global blocks alternate (layer_types)
    "qwen3": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=True, use_sliding_window=True, sliding_window=8,
                                  layer_types=["sliding_attention", "full_attention"] * 2)),
    "mistral": ("MistralConfig", dict(sliding_window=8)),  # every block slides
    # YaRN with DeepSeek-V3's mscale fields and other betas
    "olmo2": ("Olmo2Config", dict(attention_bias=True, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 64,
        "beta_fast": 16, "beta_slow": 2, "mscale": 1.0, "mscale_all_dim": 0.5})),
    # three sliding blocks (windows of 8), then a full one; their RoPE apart: YaRN on the full block,
    # another base on the sliding ones
    "olmo3": ("Olmo3Config", dict(sliding_window=8, rope_parameters={
        "full_attention": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 8.0,
                           "original_max_position_embeddings": 64},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    # block 3 has no RoPE, and slides
    "smollm3": ("SmolLM3Config", dict(no_rope_layer_interval=4, tie_word_embeddings=True, use_sliding_window=True,
                                      sliding_window=8)),
    # 4 experts, each token to 2; block 1 dense (mlp_only_layers)
    # YaRN RoPE (4x an original context of 128; Qwen3's long-context recipe), its attention factor from factor
    "qwen3_moe": ("Qwen3MoeConfig", dict(head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                         mlp_only_layers=[1], norm_topk_prob=True,
                                         rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                          "original_max_position_embeddings": 128})),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48)),
    # sinks, windows of 8 on every other block, biased attention, experts and router, the clamped
    # SwiGLU, YaRN
    "gpt_oss": ("GptOssConfig", dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2, intermediate_size=48,
                                     sliding_window=8, rope_parameters={
                                         "rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                                         "original_max_position_embeddings": 128, "beta_fast": 32.0,
                                         "beta_slow": 1.0})),
    # latent attention (a low-rank query, a value head unlike the query's), 8 experts in 4 groups of
    # which 2 are chosen, a shared expert, block 0 dense, YaRN with unequal mscales
    "deepseek_v3": ("DeepseekV3Config", dict(
        num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24,
        n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, moe_intermediate_size=48,
        first_k_dense_replace=1, rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.707})),
    # GLM-4.5: q/k/v biases, per-head q/k norm, RoPE on half of each head (YaRN over those pairs),
    # DeepSeek-V3's router (8 experts in 4 groups, 2 chosen, scaled) with a shared expert, block 0 dense
    "glm4_moe": ("Glm4MoeConfig", dict(
        head_dim=32, attention_bias=True, use_qk_norm=True, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
        topk_group=2, moe_intermediate_size=48, routed_scaling_factor=2.5, first_k_dense_replace=1,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 128, "partial_rotary_factor": 0.5})),
    # Gemma 3: norms around each sub-layer (zero-centred), the embedding scaled, GeGLU, per-head q/k
    # norms, a softmax scale of its own; three sliding blocks (windows of 8, RoPE base 1e4) and a
    # full one (base 1e6, linear 8x), tied
    "gemma3_text": ("Gemma3TextConfig", dict(head_dim=32, query_pre_attn_scalar=24, sliding_window=8,
                                             layer_types=["sliding_attention"] * 3 + ["full_attention"],
                                             rope_parameters={
                                                 "full_attention": {"rope_type": "linear", "rope_theta": 1e6,
                                                                    "factor": 8.0},
                                                 "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
    # Llama 4: experts (4, each token to 2, weighed on their inputs) with a shared expert on blocks 1
    # and 3, dense blocks 0 and 2; block 3 without RoPE, its queries temperature-tuned (floor 16:
    # the tuning moves within 200 positions), L2 q/k norms in the others; chunks of 8 (cut every
    # sequence here, a generation's prompt and its new tokens included)
    "llama4_text": ("Llama4TextConfig", dict(
        head_dim=16, intermediate_size=48, intermediate_size_mlp=96, num_local_experts=4, num_experts_per_tok=2,
        interleave_moe_layer_step=2, floor_scale=16, attn_scale=0.5, attention_chunk_size=8,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    # Qwen3-Next: linear-attention blocks 0-2 (the gated delta rule; 2 key heads of 16 to 4 value
    # heads of 16; 200 positions cross its chunks of 64) and a gated full one (a quarter of each head
    # rotated), zero-centred norms; 4 experts (2 each token) with a gated shared expert, block 1 dense
    "qwen3_next": ("Qwen3NextConfig", dict(
        head_dim=32, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
        shared_expert_intermediate_size=48, mlp_only_layers=[1])),
    # Qwen3.5 (dense): q, k and v in one tensor, z, b and a apart; linear blocks 0 and 2 (2 key heads of
    # 16 to 6 value heads of 8), full ones 1 and 3; its multimodal RoPE (16 of 64 entries rotated in
    # three sections), which rotates a text's positions as plain RoPE does
    "qwen3_5_text": ("Qwen3_5TextConfig", dict(
        head_dim=64, linear_key_head_dim=16, linear_value_head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=6, layer_types=["linear_attention", "full_attention"] * 2,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25,
                         "mrope_section": [3, 3, 2], "mrope_interleaved": True})),
    # Qwen3.5-MoE: experts in every block (4, each token to 2, top k renormalised) with a gated shared
    # expert two experts wide; blocks 0-2 linear
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", dict(
        head_dim=32, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
        shared_expert_intermediate_size=96)),
    # OLMo hybrid: linear blocks 0, 2, 3 (2 key heads of 16 to 4 value heads of 8; the step doubled) that
    # norm their inputs, and an OLMo 3 attention block 1 (norms after each sub-layer, q/k norms over
    # the projection) with RoPE
    "olmo_hybrid": ("OlmoHybridConfig", dict(
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0})),
    # Kimi Linear: Kimi Delta Attention blocks 0, 2, 3 (2 heads of 16, a gate per key channel; 200
    # positions cross its chunks of 64) and a latent attention block 1 without RoPE (a value head unlike
    # the query's); 4 experts in 2 groups of which 1 is chosen, a shared expert, block 0 dense
    "kimi_linear": ("KimiLinearConfig", dict(
        num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24,
        linear_num_heads=2, linear_head_dim=16, num_local_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
        moe_intermediate_size=48, layer_types=["linear_attention", "full_attention", "linear_attention",
                                               "linear_attention"])),
}
ZERO_CENTRED = ("gemma3_text", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")  # (their norms' gains are 1 + w)
CHAT_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"


def make_hf_model(family: str, **change):
    """A random model as transformers initialises it, with its biases and norm weights drawn
    away from 0 and 1: a bias or norm weight mapped to the wrong place must show. (`change`: fields
    other than CONFIGS'.)"""
    torch.manual_seed(0)
    name, fields = CONFIGS[family]
    # (Qwen3.5-MoE's config class has no intermediate_size: every block sparse)
    sizes = {k: v for k, v in BASE.items() if not (k == "intermediate_size" and family == "qwen3_5_moe_text")}
    config = getattr(transformers, name)(**(sizes | fields | change))
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.5)
            elif "norm" in n:
                p.uniform_(0.5, 1.5).sub_(1 if family in ZERO_CENTRED else 0)
            elif n.endswith("dt_bias"):  # (Qwen3-Next's linear attention: each head's own, away from 1)
                p.normal_(0, 1)
        for n, b in model.named_buffers():  # (DeepSeek-V3's router balancing biases steer the choice)
            if n.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)
    return model


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """family -> a folder saved by transformers, with a tokenizer and its configs (a chat template)."""
    from plait.data.tokenizer import train_bpe

    tokenizer = train_bpe([(ROOT / "README.md").read_text()] * 4, 300)
    made = {}

    def folder(family: str):
        if family not in made:
            out = tmp_path_factory.mktemp(family)
            make_hf_model(family).save_pretrained(out)
            tokenizer.save(str(out / "tokenizer.json"))
            (out / "tokenizer_config.json").write_text(json.dumps({
                "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|eos|>", "chat_template": CHAT_TEMPLATE,
                "model_max_length": 512}, indent=2))
            made[family] = out
        return made[family]

    return folder


@pytest.mark.parametrize("family", CONFIGS)
def test_logits_equal_transformers(folders, family):
    ours, _ = plait_model(folders(family))
    assert ours.args.family == family
    tokens = torch.randint(0, VOCAB, (2, 200), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (ours(tokens) - make_hf_model(family)(tokens).logits).abs().max().item()
    print(f"\n{family}: max |logits - transformers'| {diff:.2e} over 200 positions")
    # fp32; measured 2.4e-7 to 3.3e-7 (equivalent RoPE layouts, other kernel orders): 30x margin
    assert diff <= 1e-5


@pytest.mark.parametrize("family", CONFIGS)
def test_the_loss_and_whole_gradient_equal_transformers(folders, tmp_path, family):
    """One batch's loss and every parameter's gradient, plait's against transformers' (its gradients
    saved as a folder's weights and read by plait's reader: in plait's names and RoPE order)."""
    from plait import hf

    ours, _ = plait_model(folders(family))
    theirs = make_hf_model(family).train()
    tokens = torch.randint(0, VOCAB, (2, 65), generator=torch.Generator().manual_seed(1))
    loss = ours.train()(tokens[:, :-1], labels=tokens[:, 1:])
    their_loss = theirs(tokens, labels=tokens).loss
    (loss + 0 * sum(p.sum() for p in ours.parameters())).backward()  # (an expert no token chose: a zero gradient)
    their_loss.backward()
    with torch.no_grad():  # (saved by transformers itself: its names on disk, experts one by one)
        for p in theirs.parameters():
            p.copy_(p.grad if p.grad is not None else torch.zeros_like(p))
    grads = tmp_path / "gradients"
    theirs.save_pretrained(grads)
    their_grads = hf.HFWeights(grads, ours.args, "gradients")
    differences = {name: (p.grad - their_grads[name]).norm() for name, p in ours.named_parameters()}
    whole = torch.stack(list(differences.values())).norm() / torch.stack(
        [their_grads[name].norm() for name in differences]).norm()
    print(f"\n{family}: loss {loss.item():.6f} vs {their_loss.item():.6f}; |gradient - transformers'| / |theirs| "
          f"{whole:.2e}")
    # fp32: the loss within 2 ulps (measured 0 to 1), the gradient as the logits (other kernel orders;
    # measured 1.2e-7 to 1.1e-6, OLMo 3's the most: a post-norm model, YaRN)
    assert abs(loss.item() - their_loss.item()) <= 2e-6 and whole <= 1e-5


@pytest.mark.parametrize("family", CONFIGS)
def test_greedy_generation_equals_transformers(folders, family, capsys):
    from plait.cli import main

    folder = folders(family)
    prompt = "Tensor parallelism splits"
    assert main(["generate", "--checkpoint", str(folder), "--prompt", prompt, "--max_new_tokens", "16",
                 "--temperature", "0", "--ids"]) == 0
    ours = json.loads(capsys.readouterr().err.split("ids ")[-1])
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(prompt).ids
    full = make_hf_model(family).generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0].tolist()
    assert ours == full[len(ids):] and ours


@pytest.mark.parametrize("family", CONFIGS)
def test_import_then_export_is_bitwise_with_the_same_config(folders, tmp_path, family):
    from safetensors.torch import load_file

    from plait.hf.config import hf_config
    from plait.hf.hybrid import MROPE
    from plait.hf.kimi import stored_names
    from plait.hf.weights import write_weights

    source = folders(family)
    model, weights = plait_model(source)
    write_weights(dict(weights.items()) | weights.buffers, model.args, tmp_path, torch.float32, 1 << 30)
    before, after = load_file(source / "model.safetensors"), load_file(tmp_path / "model.safetensors")
    # (Kimi Linear's dense feed-forward: transformers saves it under the sparse blocks' name, plait
    # writes the released folders' `mlp`; both are read)
    renamed = {stored: ours for ours, stored in stored_names(before, model.args).items()}
    before = {renamed.get(k, k): t for k, t in before.items()}
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    # Written from plait's model alone (no source config), config.json builds transformers' model of the
    # same family and shape: the one transformers saved.
    config = hf_config(model.args, torch.float32, None, 0)
    (tmp_path / "config.json").write_text(json.dumps(config))
    theirs = transformers.AutoConfig.from_pretrained(tmp_path).to_dict()
    saved = transformers.AutoConfig.from_pretrained(source).to_dict()
    # (transformers' DeepSeek-V3 says 1 MTP module by default and saves none: plait writes the 0 it holds)
    ignored = ("transformers_version", "_name_or_path", "num_nextn_predict_layers")
    # (nor a text model's multimodal RoPE sections, which rotate a text as plain RoPE does: kept from a source)
    if "rope_parameters" in saved:  # (Kimi Linear has no RoPE)
        saved["rope_parameters"] = {k: v for k, v in saved["rope_parameters"].items() if k not in MROPE}
    differ = {k for k in saved if k not in ignored and saved[k] != theirs.get(k)}
    assert config["model_type"] == family and not differ, {k: (saved[k], theirs.get(k)) for k in differ}
    source_config = json.loads((source / "config.json").read_text())
    if set(MROPE) <= source_config.get("rope_parameters", {}).keys():
        kept = hf_config(model.args, torch.float32, None, 0, source_config)["rope_scaling"]
        assert {k: kept[k] for k in MROPE} == {k: source_config["rope_parameters"][k] for k in MROPE}


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"])
def test_a_qwen_hybrids_mtp_module_is_read_trained_as_vllm_runs_it_and_written_back(folders, tmp_path, family):
    """The MTP module of Qwen3-Next's and Qwen3.5's folders (`mtp.*`, which transformers leaves
    unread): vLLM's and SGLang's qwen3_next_mtp run fc([pre_fc_norm_embedding(embedding of t+1);
    pre_fc_norm_hidden(the model's output after its final norm)]) through one more full-attention
    block (gated, a quarter of each head rotated; experts where the model has them), then mtp.norm
    and the shared lm_head. The reference here is that, built of transformers' own modules: the
    block is the last of a model one block deeper (as transformers initialises and saves it). A
    folder holding `mtp.*` without a config field is read with one module; plait's MTP loss and its
    gradient equal the reference's (fp32: the loss within 2 ulps, the gradient within 1e-5 of its
    norm, as the model's own above); export writes the folder's tensors back bitwise; transformers
    reads the folder; `--model.mtp_layers 0` leaves the module out."""
    from dataclasses import replace

    from safetensors.torch import load_file, save_file

    from plait import hf
    from plait.hf.weights import write_weights

    base = make_hf_model(family)
    types = [*base.config.layer_types, "full_attention"]
    deeper = make_hf_model(family, num_hidden_layers=len(types), layer_types=types)
    block = deeper.model.layers[len(types) - 1]
    dim, norm_class = base.config.hidden_size, type(base.model.norm)
    torch.manual_seed(2)
    fc = torch.nn.Linear(2 * dim, dim, bias=False)
    norms = {name: norm_class(dim, eps=base.config.rms_norm_eps) for name in ("pre_fc_norm_embedding",
                                                                             "pre_fc_norm_hidden", "norm")}
    with torch.no_grad():
        for norm in norms.values():
            norm.weight.uniform_(-0.5, 0.5)  # (zero-centred gains 0.5 to 1.5)

    def mtp_tensors(model_dir) -> dict:
        """The module's tensors on disk (the deeper model's last block saved by transformers, renamed)."""
        deeper.save_pretrained(model_dir)
        last = f"model.layers.{len(types) - 1}."
        saved = load_file(model_dir / "model.safetensors")
        saved = {f"mtp.layers.0.{k.removeprefix(last)}": t for k, t in saved.items() if k.startswith(last)}
        return saved | {"mtp.fc.weight": fc.weight.detach().clone()} | {
            f"mtp.{name}.weight": norm.weight.detach().clone() for name, norm in norms.items()}

    folder = tmp_path / "with_mtp"
    shutil.copytree(folders(family), folder)
    on_disk = load_file(folder / "model.safetensors") | mtp_tensors(tmp_path / "deeper")
    save_file(on_disk, str(folder / "model.safetensors"), metadata={"format": "pt"})

    ours, weights = plait_model(folder)
    assert ours.args.mtp_layers == 1
    tokens = torch.randint(0, VOCAB, (2, 34), generator=torch.Generator().manual_seed(1))
    inputs, following, targets = tokens[:, :32], tokens[:, 1:33], tokens[:, 2:34]
    ours.train().mtp_scale = 1.0
    (ours(inputs, labels=following, next_tokens=(following, targets)) +
     0 * sum(p.sum() for p in ours.parameters())).backward()  # (an expert no token chose: a zero gradient)
    measured = ours.mtp_records[-1]

    hidden = base.model(inputs).last_hidden_state  # (after the model's final norm)
    x = fc(torch.cat([norms["pre_fc_norm_embedding"](base.model.embed_tokens(following)),
                      norms["pre_fc_norm_hidden"](hidden)], -1))
    positions = torch.arange(32)[None]
    x = block(x, position_embeddings=base.model.rotary_emb(x, positions), position_ids=positions)
    logits = base.lm_head(norms["norm"](x))
    reference = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum") / 64
    reference.backward()
    print(f"\n{family}: MTP loss {measured.item():.6f}, vLLM's way with transformers' modules {reference.item():.6f}")
    assert abs(measured.item() - reference.item()) <= 2e-6

    with torch.no_grad():  # (the reference's gradients on disk as the module's tensors, read by plait's reader)
        for p in [*block.parameters(), fc.weight, *(n.weight for n in norms.values())]:
            p.copy_(p.grad if p.grad is not None else torch.zeros_like(p))
    gradients = tmp_path / "gradients"
    shutil.copytree(folder, gradients)
    save_file(on_disk | mtp_tensors(tmp_path / "deeper_gradients"), str(gradients / "model.safetensors"),
              metadata={"format": "pt"})
    theirs = hf.HFWeights(gradients, ours.args, "gradients")
    names = [name for name, _ in ours.named_parameters() if name.startswith("mtp.")]
    grads = dict(ours.named_parameters())
    difference = torch.stack([(grads[n].grad - theirs[n]).norm() for n in names]).norm()
    assert difference <= 1e-5 * torch.stack([theirs[n].norm() for n in names]).norm()

    out = tmp_path / "export"
    write_weights(dict(weights.items()) | weights.buffers, ours.args, out, torch.float32, 1 << 30)
    written = load_file(out / "model.safetensors")
    assert written.keys() == on_disk.keys() and all(torch.equal(written[k], on_disk[k]) for k in on_disk)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        assert torch.equal(loaded(inputs).logits, base(inputs).logits)
    without = replace(ours.args, mtp_layers=0)  # (--model.mtp_layers 0: the folder's module left unread)
    assert "mtp.fc.weight" not in hf.weights.hf_names("layers.0.attention_norm.weight", without)
    assert len(hf.HFWeights(folder, without, "checkpoint.load")) == len(list(ours.parameters())) - len(names)


def test_a_trained_and_exported_folder_keeps_its_family_config_and_tokenizer_files(folders, tmp_path):
    """Qwen3 (tied, per-head q/k norm) and OLMo 2 (post-norm): 2 steps from the folder, export:
    the config.json is the source's with plait's fields (same model_type, architectures, and the
    fields plait does not read, e.g. initializer_range), the tokenizer configs are the source's
    byte for byte (the chat template), and transformers loads it and applies the template."""
    for family in ("qwen3", "olmo2"):
        source = folders(family)
        checkpoints = tmp_path / family
        rows, _ = run_plait(tmp_path, "--training.steps", "2", "--checkpoint.load", str(source),
                            "--checkpoint.folder", str(checkpoints), "--checkpoint.interval", "2")
        assert len(rows) == 2
        exported = tmp_path / f"{family}-exported"
        assert plait_forked("export", "--checkpoint", str(checkpoints / "step-2"), "--out", str(exported), "--dtype",
                            "float32").returncode == 0
        saved, written = (json.loads((f / "config.json").read_text()) for f in (source, exported))
        assert {k: v for k, v in written.items() if k != "torch_dtype"} == \
            {k: v for k, v in saved.items() if k not in ("dtype", "rope_parameters")} | \
            {k: written[k] for k in ("rope_theta", "rope_scaling", "hidden_act", "head_dim", "mlp_bias", "attention_bias")}
        for name in ("tokenizer_config.json", "generation_config.json"):
            assert (exported / name).read_bytes() == (source / name).read_bytes(), name
        tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
        chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
        assert chat == "<|user|>hi"
        model = transformers.AutoModelForCausalLM.from_pretrained(exported)
        assert type(model).__name__ == {"qwen3": "Qwen3ForCausalLM", "olmo2": "Olmo2ForCausalLM"}[family]


# A field config.json leaves out means what transformers' config class of the family gives (derived
# as it derives it), not plait's own default: (family, fields removed, fields set).
OMITTED = {
    "qwen3_moe-norm_topk_prob": ("qwen3_moe", ("norm_topk_prob",), {}),  # False: top k not renormalised
    "olmo2-rms_norm_eps": ("olmo2", ("rms_norm_eps",), {}),  # 1e-5, where most families have 1e-6
    "smollm3-no_rope_layers": ("smollm3", ("no_rope_layers",), {}),  # from no_rope_layer_interval (4): block 3
    "smollm3-no_rope_layers-interval_2": ("smollm3", ("no_rope_layers",), {"no_rope_layer_interval": 2}),
    "smollm3-no_rope_layers-interval": ("smollm3", ("no_rope_layers", "no_rope_layer_interval"), {}),  # 4
    "smollm3-rope_parameters": ("smollm3", ("rope_parameters",), {}),  # rope_theta 2e6
    "smollm3-tie_word_embeddings": ("smollm3", ("tie_word_embeddings",), {}),  # tied
    "mixtral-rope_parameters": ("mixtral", ("rope_parameters",), {}),  # rope_theta 1e6
    # OLMo 3's class gives a top-level rope_theta to the full blocks alone; the sliding ones keep 5e5
    "olmo3-rope_parameters": ("olmo3", ("rope_parameters",), {"rope_theta": 10000.0}),
    "olmo3-layer_types": ("olmo3", ("layer_types",), {}),  # three sliding blocks, then a full one
    # Gemma 3's classic layout: rope_scaling and rope_theta the full blocks', rope_local_base_freq the sliding ones'
    "gemma3_text-rope_parameters": ("gemma3_text", ("rope_parameters",), {
        "rope_theta": 1e5, "rope_local_base_freq": 5e3, "rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    # older folders' sliding_window_pattern: every 2nd block full
    "gemma3_text-layer_types": ("gemma3_text", ("layer_types",), {"sliding_window_pattern": 2}),
    # Llama 4's sparse blocks from interleave_moe_layer_step (2), its blocks without RoPE from the interval (4)
    "llama4_text-moe_layers": ("llama4_text", ("moe_layers", "no_rope_layers"), {}),
}


@pytest.mark.parametrize("case", OMITTED)
def test_a_field_left_out_means_the_familys_default(folders, tmp_path, case):
    family, removed, changed = OMITTED[case]
    shutil.copytree(folders(family), tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    assert set(removed) <= config.keys()  # (else the case tests nothing)
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k not in removed} | changed))
    ours, _ = plait_model(tmp_path)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    tokens = torch.randint(0, VOCAB, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (ours(tokens) - theirs(tokens).logits).abs().max().item()
    print(f"\n{case}: max |logits - transformers'| {diff:.2e}")
    assert diff <= 1e-5  # as test_logits_equal_transformers


def changed_folder(source, folder, change: dict):
    """A copy of `source` whose config.json has `change` written over it."""
    shutil.copytree(source, folder, dirs_exist_ok=True)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | change))
    return folder


def rope_parameters(family: str, **change) -> dict:
    return {"rope_parameters": CONFIGS[family][1]["rope_parameters"] | change}


# A field set to null means what transformers reads there (a field its config class types `X | None`:
# derived or off); a null it refuses or fails on, or a value of the wrong type, is refused in one line
# naming the field: (family, change to config.json, plait's refusal; None: plait computes transformers' logits).
NULLS = {
    "deepseek_v3-routed_scaling_factor": ("deepseek_v3", {"routed_scaling_factor": None},
                                          "sets routed_scaling_factor null; allowed: a number"),
    "deepseek_v3-routed_scaling_factor-text": ("deepseek_v3", {"routed_scaling_factor": "2.5"},
                                               'sets routed_scaling_factor "2.5"; allowed: a number'),
    "deepseek_v3-first_k_dense_replace": ("deepseek_v3", {"first_k_dense_replace": None},
                                          "sets first_k_dense_replace null; allowed: an integer >= 0"),
    "deepseek_v3-num_experts_per_tok": ("deepseek_v3", {"num_experts_per_tok": None},
                                        "sets num_experts_per_tok null; allowed: an integer >= 1"),
    # (the folder's shared experts must not be dropped)
    "deepseek_v3-n_shared_experts": ("deepseek_v3", {"n_shared_experts": None},
                                     "sets n_shared_experts null; allowed: an integer >= 1"),
    "deepseek_v3-rope_interleave": ("deepseek_v3", {"rope_interleave": None}, "sets rope_interleave null"),
    "qwen3-rope_scaling-text": ("qwen3", {"rope_scaling": "yarn"},
                                'sets rope_scaling "yarn"; allowed: an object (rope_type and its fields) or null'),
    "qwen3_moe-yarn-factor": ("qwen3_moe", rope_parameters("qwen3_moe", factor=None),
                              "sets rope_parameters.factor null; allowed: a number"),
    "mistral-max_position_embeddings": ("mistral", {"max_position_embeddings": None},
                                        "sets max_position_embeddings null; allowed: an integer >= 1"),
    "qwen3-head_dim": ("qwen3", {"head_dim": None}, "sets head_dim null; allowed: an integer >= 1"),
    "olmo2-tie_word_embeddings": ("olmo2", {"tie_word_embeddings": None},
                                  "sets tie_word_embeddings null; allowed: true or false"),
    "qwen2-sliding_window": ("qwen2", {"sliding_window": None},
                             "sets sliding_window null with use_sliding_window true; allowed: an integer >= 1"),
    "gpt_oss-sliding_window": ("gpt_oss", {"sliding_window": None}, "sets sliding_window null; allowed: an integer"),
    "gpt_oss-layer_types-short": ("gpt_oss", {"layer_types": ["full_attention"]},
                                  'sets layer_types ["full_attention"]; allowed: a list of 4 strings'),
    "llama-hidden_size": ("qwen2", {"hidden_size": None}, "sets hidden_size null; allowed: an integer >= 1"),
    # YaRN's truncate null is false in transformers (it reads .get("truncate", True)): the ramp unrounded
    "gpt_oss-yarn-truncate": ("gpt_oss", rope_parameters("gpt_oss", truncate=None), None),
    "gpt_oss-layer_types": ("gpt_oss", {"layer_types": None}, None),  # every other block slides, from the first
    "deepseek_v3-norm_topk_prob": ("deepseek_v3", {"norm_topk_prob": None}, None),  # falsy: not renormalised
    "deepseek_v3-num_key_value_heads": ("deepseek_v3", {"num_key_value_heads": None}, None),  # the heads
    "mistral-head_dim": ("mistral", {"head_dim": None}, None),  # hidden_size / heads
    "mixtral-sliding_window": ("mixtral", {"sliding_window": None}, None),  # no window
    "olmo3-sliding_window": ("olmo3", {"sliding_window": None}, "sets sliding_window null; allowed: an integer"),
    "olmo3-rope_parameters-flat": ("olmo3", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
                                   "allowed: an object of full_attention and sliding_attention objects"),
    "llama4_text-attention_chunk_size": ("llama4_text", {"attention_chunk_size": None},
                                         "sets attention_chunk_size null; allowed: an integer >= 1"),
    "gemma3_text-use_bidirectional_attention": ("gemma3_text", {"use_bidirectional_attention": True},
                                                "sets use_bidirectional_attention (bidirectional attention)"),
    "gemma3_text-hidden_activation": ("gemma3_text", {"hidden_activation": "silu"},
                                      "sets hidden_activation 'silu'; allowed: 'gelu_pytorch_tanh'"),
    # OLMo hybrid's released folders: a RoPE base of null, attention without RoPE
    "olmo_hybrid-rope_theta": ("olmo_hybrid", {"rope_parameters": {"rope_type": "default", "rope_theta": None}}, None),
    # YaRN's truncate by layer type: transformers reads it from rope_parameters itself (none): truncated
    "olmo3-yarn-truncate": ("olmo3", {"rope_parameters": {"full_attention": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0, "original_max_position_embeddings": 32,
        "truncate": False}}}, None),
}


@pytest.mark.parametrize("case", NULLS)
def test_a_null_or_ill_typed_field_is_read_as_transformers_reads_it_or_refused_in_one_line(folders, tmp_path, case):
    from plait import hf
    from plait.config import ConfigError

    family, change, refusal = NULLS[case]
    folder = changed_folder(folders(family), tmp_path, change)
    if refusal is not None:
        with pytest.raises(ConfigError) as refused:
            hf.model_args(folder, "checkpoint.load")
        assert refusal in str(refused.value) and "\n" not in str(refused.value), str(refused.value)
        return
    ours, _ = plait_model(folder)
    theirs, loading = transformers.AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not any(loading.values()), loading  # (every weight of the folder, and only those)
    tokens = torch.randint(0, VOCAB, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (ours(tokens) - theirs.eval()(tokens).logits).abs().max().item()
    print(f"\n{case}: max |logits - transformers'| {diff:.2e}")
    assert diff <= 1e-5  # as test_logits_equal_transformers


def test_gpt_oss_rope_scaling_null_is_its_default_yarn_as_in_transformers(folders, tmp_path):
    """transformers reads "rope_scaling": null as left out: gpt-oss's default YaRN (32x an original
    4096, q and k times its attention factor 1.35; q and k sharpened 4x here, so that it shows in the
    logits). An export writes the YaRN out, and a gpt-oss without RoPE scaling writes rope_type
    "default" (null would read as the YaRN)."""
    from dataclasses import replace

    from safetensors.torch import load_file, save_file

    from plait.hf.config import hf_config

    source = folders("gpt_oss")
    params = json.loads((source / "config.json").read_text())["rope_parameters"]
    folder = changed_folder(source, tmp_path / "null", {"rope_parameters": None, "rope_scaling": None,
                                                         "rope_theta": params["rope_theta"]})
    weights = load_file(folder / "model.safetensors")
    sharpened = {k: v * 4 if k.endswith(("q_proj.weight", "k_proj.weight")) else v for k, v in weights.items()}
    save_file(sharpened, str(folder / "model.safetensors"), metadata={"format": "pt"})
    ours, _ = plait_model(folder)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    assert theirs.config.rope_parameters["factor"] == 32.0
    tokens = torch.randint(0, VOCAB, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (ours(tokens) - theirs(tokens).logits).abs().max().item()
    print(f"\nrope_scaling null: max |logits - transformers'| {diff:.2e}")
    assert diff <= 1e-5  # as test_logits_equal_transformers
    for args, rope_type in ((ours.args, "yarn"), (replace(ours.args, rope_scaling=None), "default")):
        out = tmp_path / rope_type
        out.mkdir()
        (out / "config.json").write_text(json.dumps(hf_config(args, torch.float32, None, 0)))
        read = transformers.AutoConfig.from_pretrained(out).rope_parameters
        assert read["rope_type"] == rope_type
        assert rope_type == "default" or read == theirs.config.rope_parameters
        assert plait_model_args(out).rope_scaling == args.rope_scaling


def test_olmo_hybrid_without_rope_exports_without_rope(folders, tmp_path):
    """A RoPE base of null (OLMo hybrid's released folders: attention without RoPE) is written back
    as null: transformers' model of the export builds no RoPE either."""
    from plait.hf.config import hf_config

    folder = changed_folder(folders("olmo_hybrid"), tmp_path / "nope", {"rope_parameters": {"rope_theta": None}})
    args = plait_model_args(folder)
    assert args.nope_layers == (1,)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "config.json").write_text(json.dumps(hf_config(args, torch.float32, None, 0)))
    assert transformers.AutoConfig.from_pretrained(tmp_path / "out").rope_parameters["rope_theta"] is None
    assert plait_model_args(tmp_path / "out") == args


def plait_model_args(folder):
    from plait import hf

    return hf.model_args(folder, "checkpoint.load")


SIZES = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=4, num_attention_heads=4, vocab_size=VOCAB)
EXPERT_SIZES = {"qwen3_moe": dict(num_experts=4, moe_intermediate_size=48), "mixtral": dict(num_local_experts=4),
                "gpt_oss": dict(num_local_experts=4), "deepseek_v3": dict(n_routed_experts=16, moe_intermediate_size=48),
                "glm4_moe": dict(n_routed_experts=16, moe_intermediate_size=48),
                "llama4_text": dict(num_local_experts=4, intermediate_size_mlp=96),
                "qwen3_next": dict(num_experts=4, moe_intermediate_size=48, shared_expert_intermediate_size=48),
                "qwen3_5_moe_text": dict(num_experts=4, moe_intermediate_size=48, shared_expert_intermediate_size=48),
                "kimi_linear": dict(num_experts=4, moe_intermediate_size=48)}


@pytest.mark.parametrize("family", ["llama", *CONFIGS])
def test_a_config_json_of_sizes_alone_is_the_model_transformers_fills_in(tmp_path, family):
    """Every field but the sizes left out: plait builds the model of transformers' config class with
    its defaults, as that class writes it out in full."""
    from plait import hf
    from plait.hf.config import describe_difference

    sizes = SIZES | EXPERT_SIZES.get(family, {})
    if family == "qwen3_5_moe_text":  # (every block sparse: its config class has no intermediate_size)
        sizes.pop("intermediate_size")
    full = json.loads(transformers.AutoConfig.for_model(family, **sizes).to_json_string(use_diff=False))
    args = {}
    for name, config in (("alone", {"model_type": family, **sizes}), ("full", full)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        args[name] = hf.model_args(tmp_path / name, "checkpoint.load")
    assert args["alone"] == args["full"], describe_difference(args["full"], args["alone"])
    # A size has no default that could fit the folder's weights: one left out is refused by name.
    from plait.config import ConfigError

    for size in sizes:
        left = {k: v for k, v in sizes.items() if k != size}
        (tmp_path / "alone" / "config.json").write_text(json.dumps({"model_type": family, **left}))
        # (Qwen3-MoE's two names: either will do)
        named = "num_local_experts" if size == "num_experts" and family == "qwen3_moe" else size
        with pytest.raises(ConfigError, match=f"config.json lacks {named}$"):
            hf.model_args(tmp_path / "alone", "checkpoint.load")


def transformers_default(family: str, field: str):
    """The default of `field` in transformers' config class for `family` ("absent": it has none)."""
    config_class = type(transformers.AutoConfig.for_model(family))
    parameters = inspect.signature(config_class.__init__).parameters
    if field in parameters:
        return parameters[field].default
    if field == "rope_theta":  # transformers 5: inside rope_parameters, the class's default_theta when left out
        theta = config_class.default_theta
        return theta["global"] if isinstance(theta, dict) else theta  # (Gemma 3's: its full blocks')
    return "absent"


def test_the_defaults_plait_reads_are_transformers():
    """plait's table of each family's defaults, field by field, against transformers' config classes:
    the table cannot drift from the transformers it stands in for."""
    from plait.hf.config import FAMILIES
    from plait.hf.defaults import DEFAULTS, READ

    assert DEFAULTS.keys() == FAMILIES.keys()
    differ = {(family, field): (defaults.get(field, "absent"), transformers_default(family, field))
              for family, defaults in DEFAULTS.items() for field in READ
              if defaults.get(field, "absent") != transformers_default(family, field)}
    assert not differ, differ  # (plait's, transformers')


def test_the_nulls_plait_reads_are_transformers():
    """plait's table of the fields whose null means unset (NULLABLE) against transformers' config
    classes: the fields each types `X | None`, but those its model then fails on (plait refuses them)."""
    import dataclasses

    from plait.hf.defaults import NULLABLE, READ

    # (gpt-oss: range(None); OLMo 3 and Gemma 3: torch.tensor(None))
    fails = {"gpt_oss": {"sliding_window"}, "olmo3": {"sliding_window"}, "gemma3_text": {"sliding_window"},
             "llama4_text": {"attention_chunk_size"},  # (its mask reads a sliding_window it lacks)
             "deepseek_v3": {"num_experts_per_tok", "v_head_dim", "n_group", "topk_group", "first_k_dense_replace"},
             "kimi_linear": {"num_experts_per_tok", "v_head_dim", "topk_group"}}
    for family, nullable in NULLABLE.items():
        types = {f.name: str(f.type) for f in dataclasses.fields(type(transformers.AutoConfig.for_model(family)))}
        assert nullable == {f for f in READ if "None" in types.get(f, "")} - fails.get(family, set()), family


def test_rope_parameters_win_over_a_top_level_rope_theta_as_in_transformers():
    """transformers 5 writes rope_theta inside rope_parameters and, given both, takes that one."""
    from transformers import LlamaConfig

    from plait.hf.rope_fields import rope_settings

    both = {"rope_theta": 10000.0, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}
    sizes = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 1, "intermediate_size": 128,
             "vocab_size": 100}
    assert LlamaConfig.from_dict({**both, **sizes}).rope_parameters["rope_theta"] == 500000.0
    assert rope_settings(both, "llama", "checkpoint.load") == (500000.0, None)


def test_plan_predicts_each_family_flavor(capsys):
    from plait.cli import main

    for flavor in ("qwen3_0_6b", "qwen2_5_0_5b", "mistral_7b", "olmo2_1b", "olmo3_32b", "smollm3_3b",
                   "deepseek_v3_16b", "qwen3_5_35b_a3b"):
        assert main(["plan", "--world", "8", "--device_memory_gib", "80", "--model.flavor", flavor,
                     "--training.seq_len", "4096", "--training.global_batch_size", "32",
                     "--training.micro_batch_size", "4"]) == 0
        assert "plan: best: " in capsys.readouterr().out, flavor
