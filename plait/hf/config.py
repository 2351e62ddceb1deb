"""A Hugging Face `config.json` (Llama and its relatives: Mistral, Qwen2/2.5, Qwen3, OLMo 2,
SmolLM3, and the mixtures of experts Qwen3-MoE, Mixtral, gpt-oss) <-> plait's ModelArgs.

Both layouts of the RoPE fields are read: the classic `rope_theta` + `rope_scaling`, and the
`rope_parameters` that transformers 5 writes. Everything that changes what the model computes is
either carried over exactly or refused by name: a model loaded into the wrong function would
train on silently. A field left out means the family's default (plait/hf/defaults.py).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch

from plait.config import ConfigError
from plait.hf.deepseek import deepseek_fields, deepseek_switches, holds_mtp
from plait.hf.defaults import DEFAULTS, ROPE_SCALING, setting
from plait.models.flavors import ModelArgs

ROPE_FIELDS = {"linear": ("factor",),
               "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
               "yarn": ("factor", "original_max_position_embeddings")}
# Fields a scaling type may set and otherwise defaults (plait/models/rope.py has the defaults)
ROPE_OPTIONAL = {"yarn": ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate")}


def is_hf_folder(folder: Path) -> bool:
    return (folder / "config.json").is_file()


def read_config(folder: Path, option: str) -> dict:
    try:
        return json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{option}: {folder / 'config.json'} is unreadable: {e}") from None


def rope_settings(config: dict, family: str, where: str) -> tuple[float, dict | None]:
    """(rope_theta, scaling) from either layout; scaling None, or {"rope_type", its fields}."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {k: v for k, v in params.items() if k != "rope_theta"}
    if "rope_scaling" not in config and "rope_parameters" not in config:
        scaling = ROPE_SCALING.get(family, {})
    # rope_parameters' theta first: given both, transformers 5 takes it
    theta = float(params.get("rope_theta") or config.get("rope_theta") or DEFAULTS[family]["rope_theta"])
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind not in ROPE_FIELDS:
        raise ConfigError(f"{where}: RoPE scaling '{kind}' is not supported; plait implements default, "
                          f"{', '.join(ROPE_FIELDS)}")
    missing = [f for f in ROPE_FIELDS[kind] if f not in scaling]
    if missing:
        raise ConfigError(f"{where}: RoPE scaling '{kind}' lacks {', '.join(missing)}")
    if scaling.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(f"{where}: partial_rotary_factor {scaling['partial_rotary_factor']}: plait rotates every "
                          "pair of a head; allowed: 1.0")
    optional = {f: scaling[f] for f in ROPE_OPTIONAL.get(kind, ()) if scaling.get(f) is not None}
    return theta, {"rope_type": kind, **{f: scaling[f] for f in ROPE_FIELDS[kind]}, **optional}


# model_type -> the architecture transformers builds for it. Each is Llama with switches.
FAMILIES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM", "olmo2": "Olmo2ForCausalLM", "smollm3": "SmolLM3ForCausalLM",
            "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM", "gpt_oss": "GptOssForCausalLM",
            "deepseek_v3": "DeepseekV3ForCausalLM"}
# model_types read as another's (Kimi K2's config.json is DeepSeek-V3's architecture)
ALIASES = {"kimi_k2": "deepseek_v3"}
# Fields that change what a model computes in ways plait does not: present and set, refused by name.
UNSUPPORTED = {"final_logit_softcapping": "logit soft-capping", "attn_logit_softcapping": "attention soft-capping",
               "num_experts": "mixture of experts", "num_local_experts": "mixture of experts",
               "n_routed_experts": "mixture of experts",
               "router_jitter_noise": "router jitter"}
MOE_FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3")


def family_switches(config: dict, family: str, where: str) -> dict:
    """The ModelArgs switches a family's config.json sets."""
    attention_bias = bool(setting(config, family, "attention_bias"))
    switches = {"qkv_bias": attention_bias, "out_bias": attention_bias,
                "ffn_bias": bool(setting(config, family, "mlp_bias"))}
    if family == "qwen2":  # biases on q, k and v always, none on the output projection
        switches |= {"qkv_bias": True, "out_bias": False}
    if family in ("qwen3", "qwen3_moe"):
        switches["qk_norm"] = "head"
    if family == "qwen3_moe":  # a block is sparse unless listed in mlp_only_layers or off decoder_sparse_step
        step = setting(config, family, "decoder_sparse_step")
        dense = set(setting(config, family, "mlp_only_layers") or [])
        experts = config.get("num_experts") or config["num_local_experts"]  # (transformers 4's name, and 5's)
        switches |= {"n_experts": experts, "top_k": setting(config, family, "num_experts_per_tok"),
                     "moe_hidden": config["moe_intermediate_size"],
                     "normalize_top_k": bool(setting(config, family, "norm_topk_prob")),
                     "dense_layers": tuple(i for i in range(config["num_hidden_layers"])
                                           if i in dense or (i + 1) % step)}
    if family == "olmo2":
        switches |= {"qk_norm": "projection", "post_norm": True}
    if family == "smollm3":
        switches["nope_layers"] = nope_layers(config, family)
    if family == "gpt_oss":  # every block sparse, biased experts and router, the clamped SwiGLU, sinks
        switches |= {"n_experts": config["num_local_experts"], "top_k": setting(config, family, "num_experts_per_tok"),
                     "moe_hidden": config["intermediate_size"], "expert_bias": True, "router_bias": True,
                     "swiglu_limit": number(config, family, "swiglu_limit", family),
                     "swiglu_alpha": number(config, family, "swiglu_alpha", family), "attention_sinks": True}
    if family == "deepseek_v3":
        switches |= deepseek_switches(config, family, where)
    if family == "mixtral":  # every block sparse, intermediate_size the experts'; top k always renormalised
        switches |= {"n_experts": config["num_local_experts"],
                     "top_k": setting(config, family, "num_experts_per_tok"), "moe_hidden": config["intermediate_size"]}
    return switches | window_switches(config, family)


def nope_layers(config: dict, family: str) -> tuple[int, ...]:
    """SmolLM3's blocks without RoPE: no_rope_layers (1 = this block uses RoPE), else every
    no_rope_layer_interval-th block."""
    interval, rope = setting(config, family, "no_rope_layer_interval"), setting(config, family, "no_rope_layers")
    if rope is None:
        rope = [(i + 1) % interval != 0 for i in range(config["num_hidden_layers"])]
    return tuple(i for i, uses_rope in enumerate(rope) if not uses_rope)


def window_switches(config: dict, family: str) -> dict:
    """sliding_window and full_layers as transformers reads them: Mistral and Mixtral slide in
    every block whenever sliding_window is set; Qwen and SmolLM3 only with use_sliding_window,
    in the blocks layer_types names (Qwen's default: from max_window_layers on; SmolLM3's: the
    blocks without RoPE); Qwen3-MoE in every block; gpt-oss in the blocks layer_types names
    (default: every other block from the first)."""
    window = setting(config, family, "sliding_window")
    if family not in ("mistral", "mixtral", "gpt_oss") and not setting(config, family, "use_sliding_window"):
        window = None
    if not window:
        return {}
    layers = range(config["num_hidden_layers"])
    types = setting(config, family, "layer_types")
    if types is None and family in ("qwen2", "qwen3"):
        types = ["full_attention" if i < setting(config, family, "max_window_layers") else "sliding_attention"
                 for i in layers]
    if types is None and family == "gpt_oss":
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in layers]
    if types is None and family == "smollm3":
        types = ["sliding_attention" if i in nope_layers(config, family) else "full_attention" for i in layers]
    full = tuple(i for i in layers if types is not None and types[i] != "sliding_attention")
    return {"sliding_window": int(window), "full_layers": full}


def number(config: dict, family: str, field: str, where: str) -> float:
    """A field that must be a number (null or text in config.json: one line, not a TypeError)."""
    value = setting(config, family, field)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{where} sets {field} {json.dumps(value)}; allowed: a number")
    return float(value)


def model_args(folder: Path, option: str) -> ModelArgs:
    """The model a Hugging Face folder holds, from its config.json."""
    config, where = read_config(folder, option), f"{option}: {folder / 'config.json'}"
    family = ALIASES.get(config.get("model_type"), config.get("model_type"))
    if family not in FAMILIES:
        raise ConfigError(f"{where} holds a model_type {family!r} model; plait reads {', '.join(FAMILIES)}")
    # (left out, each is unset in every family: the defaults table has those that are not expert counts)
    for field, what in UNSUPPORTED.items():
        if config.get(field) and not (family in MOE_FAMILIES and what == "mixture of experts"):
            raise ConfigError(f"{where} sets {field} ({what}), which plait does not compute; allowed: unset, "
                              "null or false")
    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method", "?")
        raise ConfigError(f"{where} holds quantized weights ({method}); plait reads them dequantized: with "
                          "transformers, from_pretrained(folder, quantization_config=Mxfp4Config(dequantize=True)) "
                          "then save_pretrained")
    if setting(config, family, "hidden_act") != "silu":
        raise ConfigError(f"{where} sets hidden_act {config['hidden_act']!r}; allowed: 'silu'")
    theta, scaling = rope_settings(config, family, where)
    try:  # (sizes have no default: a missing one is refused by name)
        heads = config["num_attention_heads"]
        args = ModelArgs(dim=config["hidden_size"], n_layers=config["num_hidden_layers"], n_heads=heads,
                         n_kv_heads=setting(config, family, "num_key_value_heads") or heads,
                         vocab_size=config["vocab_size"], ffn_hidden=config["intermediate_size"],
                         head_dim=setting(config, family, "head_dim") or config["hidden_size"] // heads,
                         norm_eps=number(config, family, "rms_norm_eps", where), rope_theta=theta,
                         rope_scaling=scaling, max_seq_len=setting(config, family, "max_position_embeddings"),
                         tie_embeddings=bool(setting(config, family, "tie_word_embeddings")), family=family,
                         **family_switches(config, family, where))
    except KeyError as e:
        raise ConfigError(f"{where} lacks {e.args[0]}") from None
    # DeepSeek-V3's MTP module, where the folder holds its weights (transformers' saves do not)
    return replace(args, mtp_layers=args.mtp_layers * holds_mtp(folder, args.n_layers)) if args.mtp_layers else args


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
    if args.qkv_bias != args.out_bias and args.family != "qwen2":
        raise ConfigError(f"checkpoint: a {args.family} config.json has one attention_bias for q/k/v and the output "
                          "projection; this model has biases on only some")
    computed = {
        "architectures": [FAMILIES[args.family]], "model_type": args.family, "hidden_act": "silu",
        "hidden_size": args.dim, "intermediate_size": args.ffn_hidden, "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads, "head_dim": args.head_dim,
        "vocab_size": args.vocab_size, "rms_norm_eps": args.norm_eps, "rope_theta": args.rope_theta,
        "rope_scaling": args.rope_scaling, "max_position_embeddings": args.max_seq_len,
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
    elif args.kv_lora_rank:
        raise ConfigError(f"checkpoint: a {args.family} config.json has no latent attention (export it as deepseek_v3)")
    if args.family == "smollm3":
        computed["no_rope_layers"] = [int(i not in args.nope_layers) for i in range(args.n_layers)]
    computed |= window_fields(args)
    if args.family == "mixtral":
        if args.dense_layers or args.qk_norm != "none" or not args.normalize_top_k:
            raise ConfigError("checkpoint: a mixtral config.json has every block sparse, no q/k norm and its top k "
                              "renormalised; this model differs (export it as qwen3_moe)")
        computed |= {"num_local_experts": args.n_experts, "num_experts_per_tok": args.top_k,
                     "intermediate_size": args.moe_hidden}
        if args.head_dim == args.dim // args.n_heads:  # transformers' Mixtral writes its default as null
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
    if args.family == "gpt_oss":
        return {"sliding_window": args.sliding_window or None, "layer_types": types}
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


def job_model(cfg, tokenizer_vocab: int) -> ModelArgs:
    """The run's model: the config.json of a Hugging Face folder given as checkpoint.load (a
    model.flavor or model.n_layers given as well must agree with it), else model.flavor's shape."""
    from plait.config import hf_folder
    from plait.models.flavors import model_args as flavor_args

    folder = hf_folder(cfg)
    if folder is None:
        args = flavor_args(cfg.model.flavor.replace("auto", "debug"), tokenizer_vocab, cfg.model.n_layers)
        args = replace(args, tie_embeddings=args.tie_embeddings or cfg.model.tie_embeddings,
                       max_seq_len=cfg.model.max_seq_len or args.max_seq_len)
        if cfg.model.mtp_layers >= 0:
            args = replace(args, mtp_layers=cfg.model.mtp_layers)
        if cfg.model.sliding_window:
            if not set(cfg.model.full_layers) <= set(range(args.n_layers)):
                raise ConfigError(f"model.full_layers: {list(cfg.model.full_layers)}, but the model has blocks 0 to "
                                  f"{args.n_layers - 1}")
            args = replace(args, sliding_window=cfg.model.sliding_window, full_layers=tuple(cfg.model.full_layers))
        return args
    args = model_args(folder, "checkpoint.load")
    if cfg.model.tie_embeddings and not args.tie_embeddings:
        raise ConfigError(f"model.tie_embeddings: {folder} has an output layer of its own (tie_word_embeddings false)")
    if cfg.model.flavor != "auto":
        flavor = replace(flavor_args(cfg.model.flavor, args.vocab_size, cfg.model.n_layers),  # a flavor names a
                         tie_embeddings=args.tie_embeddings, mtp_layers=args.mtp_layers)  # shape, not these
        if describe_difference(flavor, args):
            raise ConfigError(f"model.flavor: {cfg.model.flavor} is not the model of {folder} "
                              f"({describe_difference(flavor, args)} in its config.json); leave model.flavor out to "
                              "train the folder's model")
    if cfg.model.max_seq_len not in (0, args.max_seq_len):
        raise ConfigError(f"model.max_seq_len: {cfg.model.max_seq_len}, but {folder} takes {args.max_seq_len} "
                          f"positions (max_position_embeddings); allowed: 0 or {args.max_seq_len}")
    if cfg.model.sliding_window and (cfg.model.sliding_window, tuple(cfg.model.full_layers)) != \
            (args.sliding_window, args.full_layers):
        raise ConfigError(f"model.sliding_window: {folder}'s config.json sets the windows (sliding_window "
                          f"{args.sliding_window}, full blocks {list(args.full_layers)}); allowed: 0, or the same")
    if cfg.model.mtp_layers == 0:  # (trained without the folder's MTP module; an export then has none)
        args = replace(args, mtp_layers=0)
    elif cfg.model.mtp_layers > args.mtp_layers:
        raise ConfigError(f"model.mtp_layers: {cfg.model.mtp_layers}, but {folder} holds no multi-token prediction "
                          "weights; allowed: -1 or 0")
    if cfg.model.n_layers not in (0, args.n_layers):
        raise ConfigError(f"model.n_layers: {cfg.model.n_layers}, but {folder} has {args.n_layers} blocks; allowed: "
                          f"0 or {args.n_layers}")
    if tokenizer_vocab > args.vocab_size:
        raise ConfigError(f"data.tokenizer: has {tokenizer_vocab} tokens, more than the {args.vocab_size} embeddings "
                          f"of {folder}: token ids past {args.vocab_size - 1} would have no embedding; use the "
                          "folder's own tokenizer")
    return args
