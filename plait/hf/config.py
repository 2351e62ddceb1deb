"""A Hugging Face `config.json` (Llama and its relatives: Mistral, Qwen2/2.5, Qwen3, OLMo 2 and 3,
SmolLM3, Gemma 3, and the mixtures of experts Qwen3-MoE, Mixtral, gpt-oss, DeepSeek-V3, GLM-4.5,
Llama 4, and the hybrids of linear and full attention Qwen3-Next, Qwen3.5, OLMo hybrid and Kimi
Linear) <-> plait's ModelArgs.

Both layouts of the RoPE fields are read (plait/hf/rope_fields.py): the classic `rope_theta` +
`rope_scaling`, and the `rope_parameters` that transformers 5 writes. Everything that changes
what the model computes is either carried over exactly or refused by name: a model loaded into
the wrong function would train on silently. Every field is read through plait/hf/fields.py: left
out, the family's default (plait/hf/defaults.py); null, or of the wrong type, as transformers
reads it or refused.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from plait import jsonl
from plait.config import ConfigError
from plait.hf.deepseek import deepseek_fields, deepseek_switches, holds_mtp
from plait.hf.defaults import DEFAULTS
from plait.hf.fields import Fields, family_fields
from plait.hf.gemma import gemma_fields, gemma_switches
from plait.hf.glm import glm_fields, glm_switches
from plait.hf.kimi import aliased, kimi_fields, kimi_switches
from plait.hf.hybrid import (QWEN_HYBRIDS, kept_multimodal_rope, olmo_hybrid_fields, olmo_hybrid_switches,
                             qwen_hybrid_fields, qwen_hybrid_switches, qwen_mtp_name, rope_off)
from plait.hf.llama4 import llama4_fields, llama4_switches
from plait.hf.rope_fields import LAYERED, layered_rope_settings, rope_fields, rope_settings, rotary_fraction
from plait.models.args import ModelArgs

def is_hf_folder(folder: Path) -> bool:
    return (folder / "config.json").is_file()


def read_config(folder: Path, option: str) -> dict:
    return jsonl.document(folder / "config.json", option)


# model_type -> the architecture transformers builds for it. Each is Llama with switches.
FAMILIES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM", "olmo2": "Olmo2ForCausalLM", "olmo3": "Olmo3ForCausalLM",
            "smollm3": "SmolLM3ForCausalLM",
            "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM", "gpt_oss": "GptOssForCausalLM",
            "deepseek_v3": "DeepseekV3ForCausalLM", "glm4_moe": "Glm4MoeForCausalLM",
            "gemma3_text": "Gemma3ForCausalLM", "llama4_text": "Llama4ForCausalLM",
            "qwen3_next": "Qwen3NextForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM",
            "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM", "olmo_hybrid": "OlmoHybridForCausalLM",
            "kimi_linear": "KimiLinearForCausalLM"}
# model_types read as another's (Kimi K2's config.json is DeepSeek-V3's architecture)
ALIASES = {"kimi_k2": "deepseek_v3"}
# Fields that change what a model computes in ways plait does not: present and set, refused by name.
UNSUPPORTED = {"final_logit_softcapping": "logit soft-capping", "attn_logit_softcapping": "attention soft-capping",
               "num_experts": "mixture of experts", "num_local_experts": "mixture of experts",
               "n_routed_experts": "mixture of experts",
               "router_jitter_noise": "router jitter", "use_bidirectional_attention": "bidirectional attention"}
MOE_FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3", "glm4_moe", "llama4_text", "qwen3_next",
                "qwen3_5_moe_text", "kimi_linear")
# Multimodal model types whose language model plait reads once saved on its own: the one to save it as
MULTIMODAL = {"gemma3": ("Gemma 3", "Gemma3ForCausalLM", "gemma3_text"),
              "qwen3_5": ("Qwen3.5", "Qwen3_5ForCausalLM", "qwen3_5_text"),
              "qwen3_5_moe": ("Qwen3.5-MoE", "Qwen3_5MoeForCausalLM", "qwen3_5_moe_text")}


def family_switches(fields: Fields, family: str, n_layers: int) -> dict:
    """The ModelArgs switches a family's config.json sets."""
    attention_bias = bool(fields.flag("attention_bias"))
    switches = {"qkv_bias": attention_bias, "out_bias": attention_bias, "ffn_bias": bool(fields.flag("mlp_bias"))}
    if family == "qwen2":  # biases on q, k and v always, none on the output projection
        switches |= {"qkv_bias": True, "out_bias": False}
    if family in ("qwen3", "qwen3_moe"):
        switches["qk_norm"] = "head"
    if family == "qwen3_moe":  # a block is sparse unless listed in mlp_only_layers or off decoder_sparse_step
        step = fields.integer("decoder_sparse_step")
        dense = set(fields.integers("mlp_only_layers") or [])
        # (transformers 4's name, and 5's)
        experts = fields.integer("num_experts" if fields.has("num_experts") else "num_local_experts", required=True)
        switches |= {"n_experts": experts, "top_k": fields.integer("num_experts_per_tok"),
                     "moe_hidden": fields.integer("moe_intermediate_size", required=True),
                     "normalize_top_k": fields.flag("norm_topk_prob"),
                     "dense_layers": tuple(i for i in range(n_layers) if i in dense or (i + 1) % step)}
    if family in ("olmo2", "olmo3"):
        switches |= {"qk_norm": "projection", "post_norm": True}
    if family == "smollm3":
        switches["nope_layers"] = nope_layers(fields, n_layers)
    if family == "gpt_oss":  # every block sparse, biased experts and router, the clamped SwiGLU, sinks
        switches |= {"n_experts": fields.integer("num_local_experts", required=True),
                     "top_k": fields.integer("num_experts_per_tok"),
                     "moe_hidden": fields.integer("intermediate_size", required=True), "expert_bias": True,
                     "router_bias": True, "swiglu_limit": fields.number("swiglu_limit"),
                     "swiglu_alpha": fields.number("swiglu_alpha"), "attention_sinks": True}
    if family == "deepseek_v3":
        switches |= deepseek_switches(fields)
    if family == "glm4_moe":
        switches |= glm_switches(fields)
    if family == "gemma3_text":
        switches |= gemma_switches(fields)
    if family in QWEN_HYBRIDS:
        switches |= qwen_hybrid_switches(fields, family, n_layers)
    if family == "olmo_hybrid":
        switches |= olmo_hybrid_switches(fields, n_layers)
    if family == "kimi_linear":
        switches |= kimi_switches(fields, n_layers)
    if family == "llama4_text":
        switches |= llama4_switches(fields, n_layers, nope_layers(fields, n_layers))
    if family == "mixtral":  # every block sparse, intermediate_size the experts'; top k always renormalised
        switches |= {"n_experts": fields.integer("num_local_experts", required=True),
                     "top_k": fields.integer("num_experts_per_tok"),
                     "moe_hidden": fields.integer("intermediate_size", required=True)}
    return switches | window_switches(fields, family, n_layers)


def nope_layers(fields: Fields, n_layers: int) -> tuple[int, ...]:
    """SmolLM3's and Llama 4's blocks without RoPE: no_rope_layers (1 = this block uses RoPE), else
    every no_rope_layer_interval-th block."""
    interval, rope = fields.integer("no_rope_layer_interval"), fields.integers("no_rope_layers", n_layers)
    if rope is None:
        rope = [(i + 1) % interval != 0 for i in range(n_layers)]
    return tuple(i for i, uses_rope in enumerate(rope) if not uses_rope)


def window_switches(fields: Fields, family: str, n_layers: int) -> dict:
    """sliding_window and full_layers as transformers reads them: Mistral and Mixtral slide in
    every block whenever sliding_window is set; Qwen and SmolLM3 only with use_sliding_window,
    in the blocks layer_types names (Qwen's default: from max_window_layers on; SmolLM3's: the
    blocks without RoPE); Qwen3-MoE in every block; gpt-oss in the blocks layer_types names
    (default: every other block from the first)."""
    always = ("mistral", "mixtral", "gpt_oss", "olmo3", "gemma3_text")  # (slide without use_sliding_window)
    if family not in always and not fields.flag("use_sliding_window"):
        if family == "smollm3" and fields.config.get("sliding_window") and "sliding_attention" in (
                fields.texts("layer_types", n_layers) or []):
            # (its masks slide there, its flash-attention path does not: which one the folder means is unknown)
            fields.refuse("layer_types", "full_attention in every block, or use_sliding_window true",
                          " with use_sliding_window false, where transformers' SmolLM3 slides under sdpa and not "
                          "under flash attention")
        return {}
    window = fields.integer("sliding_window", minimum=0)
    if window is None and fields.has("sliding_window") and family not in ("mistral", "mixtral"):
        # (null where transformers' model then slides: it fails on it)
        fields.refuse("sliding_window", "an integer >= 1", " with use_sliding_window true")
    if not window:
        return {}
    layers = range(n_layers)
    types = fields.texts("layer_types", n_layers)
    if types is None and family in ("qwen2", "qwen3"):
        types = ["full_attention" if i < fields.integer("max_window_layers", minimum=0) else "sliding_attention"
                 for i in layers]
    if types is None and family == "gpt_oss":
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in layers]
    if types is None and family == "olmo3":  # three sliding blocks, then a full one
        types = ["sliding_attention" if (i + 1) % 4 else "full_attention" for i in layers]
    if types is None and family == "gemma3_text":  # (older folders' sliding_window_pattern: every 6th full)
        pattern = fields.integer("sliding_window_pattern") if fields.has("sliding_window_pattern") else 6
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in layers]
    if types is None and family == "smollm3":
        types = ["sliding_attention" if i in nope_layers(fields, n_layers) else "full_attention" for i in layers]
    full = tuple(i for i in layers if types is not None and types[i] != "sliding_attention")
    # (a window no block slides in is no window: the model computes, and exports, as one without)
    return {"sliding_window": window, "full_layers": full} if len(full) < n_layers else {}


def model_args(folder: Path, option: str) -> ModelArgs:
    """The model a Hugging Face folder holds, from its config.json."""
    config, where = read_config(folder, option), f"{option}: {folder / 'config.json'}"
    if not isinstance(config, dict):
        raise ConfigError(f"{where} holds no JSON object of fields")
    model_type = config.get("model_type")
    family = ALIASES.get(model_type, model_type) if isinstance(model_type, str) else None
    if family not in FAMILIES:
        name, causal_lm, text = MULTIMODAL.get(model_type, (None,) * 3)
        hint = f" ({name}'s multimodal folder: save its language model with transformers' {causal_lm}, a {text} " \
            "folder)" if name else ""
        raise ConfigError(f"{where} holds a model_type {model_type!r} model; plait reads {', '.join(FAMILIES)}{hint}")
    # (left out, each is unset in every family: the defaults table has those that are not expert counts)
    for field, what in UNSUPPORTED.items():
        if config.get(field) and not (family in MOE_FAMILIES and what == "mixture of experts"):
            raise ConfigError(f"{where} sets {field} ({what}), which plait does not compute; allowed: unset, "
                              "null or false")
    fields = family_fields(config, family, where)
    quantization = fields.table("quantization_config")
    if quantization:
        method = quantization.get("quant_method", "?")
        raise ConfigError(f"{where} holds quantized weights ({method}); plait reads them dequantized: with "
                          "transformers, from_pretrained(folder, quantization_config=Mxfp4Config(dequantize=True)) "
                          "then save_pretrained")
    field, gate = ("hidden_activation", "gelu_pytorch_tanh") if family == "gemma3_text" else ("hidden_act", "silu")
    if fields.text(field, repr(gate)) != gate:
        raise ConfigError(f"{where} sets {field} {config[field]!r}; allowed: {gate!r}")
    if family in LAYERED:
        (theta, scaling), local = layered_rope_settings(config, family, where)
        local_rope = {} if local == (theta, scaling) else {"local_rope_theta": local[0], "local_rope_scaling": local[1]}
    elif family == "kimi_linear" or family == "olmo_hybrid" and rope_off(config):  # (no RoPE: no base to read)
        (theta, scaling), local_rope = (ModelArgs.rope_theta, None), {}
    else:
        (theta, scaling), local_rope = rope_settings(config, family, where), {}
    # (sizes have no default: a missing one is refused by name)
    dim, heads = fields.integer("hidden_size", required=True), fields.integer("num_attention_heads", required=True)
    n_layers = fields.integer("num_hidden_layers", required=True)
    head_dim = fields.integer("head_dim") or dim // heads
    rotary = int(head_dim * rotary_fraction(config, family, where))  # (as transformers rounds it)
    if rotary < 2 or rotary % 2:
        raise ConfigError(f"{where} sets partial_rotary_factor {rotary_fraction(config, family, where)}: RoPE would "
                          f"rotate {rotary} of a head's {head_dim} entries; allowed: a share giving pairs")
    shape = dict(dim=dim, n_layers=n_layers, n_heads=heads, n_kv_heads=fields.integer("num_key_value_heads") or heads,
                 vocab_size=fields.integer("vocab_size", required=True),
                 # (Qwen3.5-MoE has none: every block sparse, the switches give its experts' size)
                 ffn_hidden=fields.integer("intermediate_size", required=True) if family != "qwen3_5_moe_text" else 0,
                 head_dim=head_dim, rotary_dim=rotary % head_dim, norm_eps=fields.number("rms_norm_eps"),
                 rope_theta=theta, rope_scaling=scaling, max_seq_len=fields.integer(
                     aliased(fields, "max_position_embeddings") if family == "kimi_linear" else
                     "max_position_embeddings"),
                 # (transformers' Kimi Linear ties nothing, whatever tie_word_embeddings says)
                 tie_embeddings=fields.flag("tie_word_embeddings") and family != "kimi_linear", family=family,
                 **local_rope)
    # (a family's switches may say a size its own way: Llama 4's dense blocks are intermediate_size_mlp wide)
    args = ModelArgs(**shape | family_switches(fields, family, n_layers))
    # The MTP module (DeepSeek-V3's, the Qwen hybrids'), where the folder holds its weights (transformers' saves do not)
    probe = qwen_mtp_name(f"model.layers.{args.n_layers}.eh_proj.weight", args)
    return replace(args, mtp_layers=args.mtp_layers * holds_mtp(folder, probe)) if args.mtp_layers else args


def hf_config(args: ModelArgs, dtype: torch.dtype, bos_id: int | None, eos_id: int | None,
              source: dict | None = None) -> dict:
    """config.json of `args` in the classic layout, which transformers 4 and 5 both read: the
    fields of the source folder's config.json (`source`, when the run started from one; its
    special token ids too) with every field plait computes written over them."""
    if args.family not in FAMILIES:
        why = {"plait_moe": "DeepSeek-V3's router and shared experts come with its latent attention: debug_mla "
                            "exports as deepseek_v3",
               "plait_sinks": "Qwen3's shape with sinks is no published family's; debug_gpt_oss exports as gpt_oss"}
        raise ConfigError(f"checkpoint: a {args.family} model has no Hugging Face architecture plait writes "
                          f"({why.get(args.family, 'no family has its switches')}); exported families: "
                          f"{', '.join(FAMILIES)}")
    if args.qkv_bias != args.out_bias and args.family not in ("qwen2", "glm4_moe"):
        raise ConfigError(f"checkpoint: a {args.family} config.json has one attention_bias for q/k/v and the output "
                          "projection; this model has biases on only some")
    computed = {
        "architectures": [FAMILIES[args.family]], "model_type": args.family,
        **({"hidden_act": "silu"} if args.family != "gemma3_text" else {}),
        "hidden_size": args.dim, "num_hidden_layers": args.n_layers,
        # (Qwen3.5-MoE's config class has none: every block is sparse)
        **({"intermediate_size": args.ffn_hidden} if args.family != "qwen3_5_moe_text" else {}),
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads, "head_dim": args.head_dim,
        "vocab_size": args.vocab_size, "rms_norm_eps": args.norm_eps, **rope_fields(args),
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings, "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if args.family not in ("qwen2", "gpt_oss", "deepseek_v3"):
        computed |= {"attention_bias": args.qkv_bias, "mlp_bias": args.ffn_bias}
    if args.family == "gpt_oss":
        if args.dense_layers or not (args.expert_bias and args.router_bias and args.attention_sinks and args.swiglu_limit
                                     and args.normalize_top_k and args.qk_norm == "none"):
            raise ConfigError("checkpoint: a gpt_oss config.json has every block sparse with biased experts and router, "
                              "the clamped SwiGLU, sinks and no q/k norm; this model differs")
        computed |= {"attention_bias": args.qkv_bias, "num_local_experts": args.n_experts,
                     "num_experts_per_tok": args.top_k, "intermediate_size": args.moe_hidden,
                     "swiglu_limit": args.swiglu_limit, "swiglu_alpha": args.swiglu_alpha}
    if args.family == "deepseek_v3":
        computed |= deepseek_fields(args) | {"attention_bias": args.qkv_bias}
    elif args.kv_lora_rank and args.family != "kimi_linear":
        raise ConfigError(f"checkpoint: a {args.family} config.json has no latent attention (export it as deepseek_v3)")
    computed |= gemma_fields(args)
    if args.family == "llama4_text":
        computed |= llama4_fields(args)
    elif args.route_inputs or args.qk_norm == "l2" or args.nope_temperature or args.attention_chunk:
        raise ConfigError(f"checkpoint: a {args.family} config.json has none of Llama 4's experts weighed on their "
                          "inputs, L2 q/k norms, temperature tuning or chunked attention; this model has (export it "
                          "as llama4_text)")
    if args.family in QWEN_HYBRIDS:
        computed |= qwen_hybrid_fields(args) | kept_multimodal_rope(computed["rope_scaling"], source)
    elif args.family == "olmo_hybrid":
        computed |= olmo_hybrid_fields(args)
    elif args.family == "kimi_linear":
        computed |= kimi_fields(args)
    elif args.linear_layers or args.attention_gate or args.shared_expert_gate:
        raise ConfigError(f"checkpoint: a {args.family} config.json has no linear attention, gated attention or "
                          "gated shared expert; this model has (export it as qwen3_next, qwen3_5_text, olmo_hybrid or "
                          "kimi_linear)")
    if args.family == "glm4_moe":
        computed |= glm_fields(args)
    elif args.rotary_dim and args.family not in QWEN_HYBRIDS:
        raise ConfigError(f"checkpoint: a {args.family} config.json rotates every entry of a head; this model rotates "
                          f"{args.rotary_dim} of {args.head_dim} (export it as glm4_moe)")
    if args.family == "smollm3":
        computed["no_rope_layers"] = [int(i not in args.nope_layers) for i in range(args.n_layers)]
    computed |= window_fields(args)
    if args.family == "mixtral":
        if args.dense_layers or args.qk_norm != "none" or not args.normalize_top_k:
            raise ConfigError("checkpoint: a mixtral config.json has every block sparse, no q/k norm and its top k "
                              "renormalised; this model differs (export it as qwen3_moe)")
        computed |= {"num_local_experts": args.n_experts, "num_experts_per_tok": args.top_k,
                     "intermediate_size": args.moe_hidden}
        # transformers' Mixtral writes its default as null; but its RoPE scalings read a null head_dim as
        # given (a TypeError): with one, the number
        if args.head_dim == args.dim // args.n_heads and not args.rope_scaling:
            computed["head_dim"] = None
    if args.family == "qwen3_moe":
        computed |= {"num_experts": args.n_experts, "num_experts_per_tok": args.top_k, "decoder_sparse_step": 1,
                     "moe_intermediate_size": args.moe_hidden, "norm_topk_prob": args.normalize_top_k,
                     "mlp_only_layers": list(args.dense_layers)}
    # transformers 5 writes rope_parameters and dtype; the source's would contradict the fields above.
    kept = {k: v for k, v in (source or {}).items() if k not in ("rope_parameters", "dtype")}
    # (the source's special token ids win; without one, no padding token: some families default to one)
    return {"bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": None, **kept, **computed}


def window_fields(args: ModelArgs) -> dict:
    """config.json's sliding-window fields for `args` (see `window_switches`)."""
    types = ["full_attention" if args.window(i) == 0 else "sliding_attention" for i in range(args.n_layers)]
    if args.family in ("mistral", "mixtral", "qwen3_moe"):
        if args.sliding_window and args.full_layers:
            raise ConfigError(f"checkpoint: a {args.family} config.json slides in every block or none; this model has "
                              f"full-attention blocks {list(args.full_layers)} among sliding ones (export it as qwen3)")
        fields = {"sliding_window": args.sliding_window or None}
        return fields | ({"use_sliding_window": bool(args.sliding_window)} if args.family == "qwen3_moe" else {})
    if args.family in ("gpt_oss", "olmo3", "gemma3_text"):  # (their models need a window where none slides)
        return {"sliding_window": args.sliding_window or DEFAULTS[args.family]["sliding_window"], "layer_types": types}
    if args.family in ("qwen2", "qwen3", "smollm3"):
        fields = {"use_sliding_window": bool(args.sliding_window), "sliding_window": args.sliding_window or None,
                  "layer_types": types}
        # Full blocks first, then sliding ones ("full_attention" sorts first): what max_window_layers says.
        if args.family != "smollm3" and args.sliding_window and types == sorted(types):
            fields["max_window_layers"] = types.index("sliding_attention")
        return fields
    if args.sliding_window:
        raise ConfigError(f"checkpoint: a {args.family} config.json has no sliding window; this model attends within "
                          f"{args.sliding_window} keys")
    return {}


# How a shape was written down (FFN rounding) and how many positions it is used for change
# nothing the model computes: two ModelArgs differing only there are one model.
NOTATION = ("multiple_of", "ffn_dim_multiplier", "max_seq_len")


def describe_difference(theirs: ModelArgs, ours: ModelArgs) -> str:
    """The fields that make two models compute differently ('' when they are one model)."""
    a, b = vars(theirs), vars(ours)
    return ", ".join(f"{k} {a[k]} vs {b[k]}" for k in b if a[k] != b[k] and k not in NOTATION)
