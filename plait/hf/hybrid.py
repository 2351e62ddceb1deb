"""The linear-attention hybrids' config.json and weights <-> plait's: blocks that mix tokens by
the gated delta rule (plait/models/linear_attention.py) among full-attention ones, by
`layer_types`.

- Qwen3-Next (`qwen3_next`: Qwen3-Next-80B-A3B) and Qwen3.5's language models (`qwen3_5_text`,
  dense; `qwen3_5_moe_text`, experts in every block): else every `full_attention_interval`-th
  block full; an output gate on attention, zero-centred norms, a per-head q/k norm, RoPE on the
  first quarter of each head (`partial_rotary_factor`), experts whose shared expert is gated
  (Qwen3-Next: or a dense feed-forward where `num_experts` is 0 or `mlp_only_layers` says).
  Qwen3.5's multimodal RoPE (`mrope_section`) rotates a text's positions as plain RoPE does: its
  three position axes are one.
- OLMo hybrid (`olmo_hybrid`: Olmo-Hybrid-7B): else every fourth block full (the last, where
  that leaves none); OLMo 3's attention blocks (norms after each sub-layer, q/k norms over the
  projection; no RoPE where rope_theta is null, as in the released folders), linear blocks that
  norm their inputs, the step b doubled (`linear_allow_neg_eigval`), the output norm's eps 1e-5,
  Mamba's initialisation of the gates (`linear_a_log_*`, `linear_dt_*`).

Some of their tensors hold several of plait's, which plait keeps apart (tensor parallelism splits
each by heads). Qwen3-Next's linear block: in_proj_qkvz holds q, k, v and the output gate z, and
in_proj_ba the step b and the gate a, each by key head (a key head's q, k, then its value heads'
v and z). Qwen3.5's: in_proj_qkv holds every head's q, then k, then v (z, b and a apart). Both:
conv1d holds the convolution of q, k and v one after the other; a full block's q_proj holds each
head's query and then its output gate. OLMo hybrid's conv1d is three tensors on disk (`on_disk`).
"""

from __future__ import annotations

import re

import torch

from plait.config import ConfigError
from plait.hf.fields import Fields
from plait.hf.kimi import kimi_name
from plait.models.args import ModelArgs

# The Qwen hybrids' model types, and their switches: their config.json cannot turn them off
QWEN_HYBRIDS = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
QWEN3_NEXT = {"qk_norm": "head", "zero_centered_norms": True, "attention_gate": True}
# Their MTP module (vLLM's and SGLang's qwen3_next_mtp / qwen3_5_mtp; transformers leaves it unread): how many,
# by config.json's field, and its tensors at the folder's top, beside the model's
MTP_FIELDS = {"qwen3_next": "num_nextn_predict_layers", "qwen3_5_text": "mtp_num_hidden_layers",
              "qwen3_5_moe_text": "mtp_num_hidden_layers"}
MTP_OWN = {"enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden", "eh_proj": "fc", "shared_head.norm": "norm"}
HYBRIDS = (*QWEN_HYBRIDS, "olmo_hybrid", "kimi_linear")  # (Kimi Linear's config and names: plait/hf/kimi.py)
LINEAR_TYPES = "a list of full_attention and linear_attention"


def qwen_hybrid_switches(fields: Fields, family: str, n_layers: int) -> dict:
    """The ModelArgs switches of a Qwen hybrid's config.json (but the rotated share: `rotary_fraction`)."""
    types = fields.texts("layer_types", n_layers)
    if types is None:
        interval = fields.integer("full_attention_interval") if fields.has("full_attention_interval") else 4
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)]
    if not set(types) <= {"full_attention", "linear_attention"}:
        fields.refuse("layer_types", LINEAR_TYPES)
    key_heads, value_heads = fields.integer("linear_num_key_heads"), fields.integer("linear_num_value_heads")
    if value_heads % key_heads:
        fields.refuse("linear_num_value_heads", f"a multiple of linear_num_key_heads {key_heads}")
    # (one MTP module where the field is left out: the released folders hold one; plait reads it where present)
    mtp = fields.integer(MTP_FIELDS[family], minimum=0) if fields.has(MTP_FIELDS[family]) else 1
    if mtp > 1:
        fields.refuse(MTP_FIELDS[family], "0 or 1", " (plait trains one MTP module)")
    switches = QWEN3_NEXT | {
        "mtp_layers": mtp, "linear_layers": tuple(i for i, kind in enumerate(types) if kind == "linear_attention"),
        "linear_key_heads": key_heads, "linear_value_heads": value_heads,
        "linear_key_dim": fields.integer("linear_key_head_dim"),
        "linear_value_dim": fields.integer("linear_value_head_dim"),
        "linear_conv": fields.integer("linear_conv_kernel_dim"), "qkv_bias": bool(fields.flag("attention_bias")),
        "out_bias": bool(fields.flag("attention_bias"))}
    if family == "qwen3_5_text":
        return switches
    experts = fields.integer("num_experts", minimum=family == "qwen3_5_moe_text", required=True)
    if not experts:
        return switches
    hidden = fields.integer("moe_intermediate_size", required=True)
    if family == "qwen3_5_moe_text":  # (every block sparse; no intermediate_size: its experts' size instead)
        step, dense, normalize = 1, set(), True
    else:
        step, dense = fields.integer("decoder_sparse_step"), set(fields.integers("mlp_only_layers") or [])
        normalize = fields.flag("norm_topk_prob")
    shared = fields.integer("shared_expert_intermediate_size", required=True)
    if shared % hidden:  # (plait's shared experts are moe_intermediate_size wide each)
        fields.refuse("shared_expert_intermediate_size", f"a multiple of moe_intermediate_size {hidden}")
    return switches | {"n_experts": experts, "top_k": fields.integer("num_experts_per_tok"), "moe_hidden": hidden,
                       "normalize_top_k": normalize, "n_shared_experts": shared // hidden,
                       "shared_expert_gate": True,
                       "dense_layers": tuple(i for i in range(n_layers) if i in dense or (i + 1) % step)} | (
        {"ffn_hidden": hidden} if family == "qwen3_5_moe_text" else {})


# OLMo hybrid's switches: its config.json cannot turn them off (post_norm: in its attention blocks;
# a linear block norms its inputs whatever post_norm says)
OLMO_HYBRID = {"qk_norm": "projection", "post_norm": True, "linear_norm_eps": 1e-5}


def rope_off(config: dict) -> bool:
    """Whether transformers' OLMo hybrid builds no RoPE: a RoPE base of null (the released folders')."""
    rope = config.get("rope_parameters") or config.get("rope_scaling")
    theta = rope["rope_theta"] if isinstance(rope, dict) and "rope_theta" in rope else config.get("rope_theta", 0)
    return theta is None


def olmo_hybrid_switches(fields: Fields, n_layers: int) -> dict:
    """The ModelArgs switches of an olmo_hybrid config.json (heads and sizes left out as its config
    class derives them: the attention heads; 0.75 x hidden_size a key head; values twice as wide)."""
    dim, heads = fields.integer("hidden_size", required=True), fields.integer("num_attention_heads", required=True)
    types = fields.texts("layer_types", n_layers)
    if types is None:
        types = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(n_layers)]
        types[-1] = types[-1] if "full_attention" in types else "full_attention"
    if set(types) != {"full_attention", "linear_attention"}:  # (transformers' class refuses a kind missing)
        fields.refuse("layer_types", LINEAR_TYPES + ", each at least once")
    key_heads = fields.integer("linear_num_key_heads") or heads
    value_heads = fields.integer("linear_num_value_heads") or heads
    if value_heads % key_heads:
        fields.refuse("linear_num_value_heads", f"a multiple of linear_num_key_heads {key_heads}")
    key_dim = fields.integer("linear_key_head_dim") or int(0.75 * dim / key_heads)
    full = tuple(i for i, kind in enumerate(types) if kind == "full_attention")
    return OLMO_HYBRID | {
        "linear_layers": tuple(i for i in range(n_layers) if i not in full), "linear_key_heads": key_heads,
        "linear_value_heads": value_heads, "linear_key_dim": key_dim,
        "linear_value_dim": fields.integer("linear_value_head_dim") or 2 * key_dim,
        "linear_conv": fields.integer("linear_conv_kernel_dim"),
        "linear_negative_eigenvalues": bool(fields.flag("linear_allow_neg_eigval")),
        "linear_a_init": (fields.number("linear_a_log_min"), fields.number("linear_a_log_max")),
        "linear_dt_init": tuple(fields.number(f"linear_dt_{name}") for name in ("min", "max", "init_floor")),
        "nope_layers": full if rope_off(fields.config) else ()}


def olmo_hybrid_fields(args: ModelArgs) -> dict:
    """config.json's OLMo hybrid fields for `args`, refused in one line where it is not OLMo hybrid's model."""
    full = tuple(i for i in range(args.n_layers) if not args.linear(i))
    if not (args.linear_layers and full and all(getattr(args, k) == v for k, v in OLMO_HYBRID.items())
            and args.nope_layers in ((), full) and len(args.linear_dt_init) == 3 and not args.n_experts
            and args.qkv_bias == args.out_bias and not args.kv_lora_rank
            and not (args.sliding_window or args.sandwich_norm or args.attention_sinks or args.attention_gate
                     or args.zero_centered_norms or args.ffn_bias)):
        raise ConfigError("checkpoint: an olmo_hybrid config.json has linear-attention blocks among full-attention "
                          "ones (each kind at least once) with OLMo 3's norms, no RoPE or RoPE in every attention "
                          "block, Mamba's gate initialisation, and no experts, windows, sinks, gates or MLP biases; "
                          "this model differs")
    dt_min, dt_max, floor = args.linear_dt_init
    rope = {"rope_theta": None, "rope_scaling": None} if args.nope_layers else {}  # (null: no RoPE)
    return rope | {
        "layer_types": ["linear_attention" if args.linear(i) else "full_attention" for i in range(args.n_layers)],
        "linear_num_key_heads": args.linear_key_heads, "linear_num_value_heads": args.linear_value_heads,
        "linear_key_head_dim": args.linear_key_dim, "linear_value_head_dim": args.linear_value_dim,
        "linear_conv_kernel_dim": args.linear_conv, "linear_allow_neg_eigval": args.linear_negative_eigenvalues,
        "linear_a_log_min": args.linear_a_init[0], "linear_a_log_max": args.linear_a_init[1],
        "linear_dt_min": dt_min, "linear_dt_max": dt_max, "linear_dt_init_floor": floor}


MROPE = ("mrope_section", "mrope_interleaved")


def kept_multimodal_rope(scaling: dict | None, source: dict | None) -> dict:
    """Qwen3.5's multimodal RoPE sections, from the source folder's config.json, in the RoPE object
    written: a text's positions rotate alike with or without them, but the vision-language model
    built from the export needs them."""
    rope = (source or {}).get("rope_parameters") or (source or {}).get("rope_scaling") or {}
    theirs = {k: v for k, v in rope.items() if k in MROPE} if isinstance(rope, dict) else {}
    return {"rope_scaling": (scaling or {"rope_type": "default"}) | theirs} if theirs else {}


# What each Qwen hybrid's experts are, in words, and whether `args`' are
QWEN_EXPERTS = {"qwen3_next": "experts (if any) with a gated shared expert",
                "qwen3_5_text": "no experts",
                "qwen3_5_moe_text": "experts in every block, their top k renormalised, with a gated shared expert"}


def experts_fit(args: ModelArgs) -> bool:
    gated = args.router == "softmax" and args.n_shared_experts and args.shared_expert_gate
    if args.family == "qwen3_5_text":
        return not args.n_experts
    if args.family == "qwen3_5_moe_text":
        return bool(args.n_experts and gated and not args.dense_layers and args.normalize_top_k)
    return not args.n_experts or bool(gated)


def qwen_hybrid_fields(args: ModelArgs) -> dict:
    """config.json's fields of `args`' Qwen hybrid, refused in one line where it is not that family's model."""
    if not (args.linear_layers and experts_fit(args) and all(getattr(args, k) == v for k, v in QWEN3_NEXT.items())
            and args.qkv_bias == args.out_bias and not args.kv_lora_rank
            and not (args.sliding_window or args.post_norm or args.sandwich_norm or args.attention_sinks
                     or args.ffn_bias or args.expert_bias or args.router_bias or args.nope_layers)):
        raise ConfigError(f"checkpoint: a {args.family} config.json has linear-attention blocks among gated full-"
                          f"attention ones, zero-centred norms, per-head q/k norms, {QWEN_EXPERTS[args.family]}, and "
                          "no windows, sinks or MLP biases; this model differs")
    fields = {"layer_types": ["linear_attention" if args.linear(i) else "full_attention" for i in range(args.n_layers)],
              "linear_num_key_heads": args.linear_key_heads, "linear_num_value_heads": args.linear_value_heads,
              "linear_key_head_dim": args.linear_key_dim, "linear_value_head_dim": args.linear_value_dim,
              "linear_conv_kernel_dim": args.linear_conv, "attention_bias": args.qkv_bias,
              "partial_rotary_factor": args.rope_dim / args.head_dim, MTP_FIELDS[args.family]: args.mtp_layers}
    if args.family == "qwen3_5_moe_text":  # (its config class has no intermediate_size, sparse step or norm_topk_prob)
        return fields | {"num_experts": args.n_experts, "num_experts_per_tok": args.top_k,
                         "moe_intermediate_size": args.moe_hidden,
                         "shared_expert_intermediate_size": args.moe_hidden * args.n_shared_experts}
    if args.family == "qwen3_next":
        fields["num_experts"] = args.n_experts
    if args.n_experts:
        fields |= {"num_experts_per_tok": args.top_k, "moe_intermediate_size": args.moe_hidden,
                   "shared_expert_intermediate_size": args.moe_hidden * args.n_shared_experts,
                   "norm_topk_prob": args.normalize_top_k, "decoder_sparse_step": 1,
                   "mlp_only_layers": list(args.dense_layers)}
    return fields


def fused_tensors(args: ModelArgs, block: int) -> dict[str, tuple[tuple[str, ...], tuple[int, ...], int]]:
    """Block `block`'s tensors on disk that hold several of plait's: their name in the block ->
    (plait's names in the block, in order; the rows each has per group; the groups)."""
    if args.linear(block):
        ratio, keys = args.linear_value_heads // args.linear_key_heads, args.linear_key_heads * args.linear_key_dim
        dk, dv = args.linear_key_dim, args.linear_value_dim
        values = args.linear_value_heads * dv
        mixer = "self_attn" if args.family == "kimi_linear" else "linear_attn"
        conv = {f"{mixer}.conv1d.weight": (("attention.conv_q", "attention.conv_k", "attention.conv_v"),
                                           (keys, keys, values), 1)}
        if args.family in ("olmo_hybrid", "kimi_linear"):  # (their projections are one each)
            return conv
        if args.family != "qwen3_next":  # (Qwen3.5: q, k and v apart from z, b and a, whole heads one after the other)
            qkv = tuple(f"attention.w{kind}.weight" for kind in "qkv")
            return {"linear_attn.in_proj_qkv.weight": (qkv, (keys, keys, values), 1)} | conv
        qkvz = tuple(f"attention.w{kind}.weight" for kind in "qkvz")
        return {"linear_attn.in_proj_qkvz.weight": (qkvz, (dk, dk, ratio * dv, ratio * dv), args.linear_key_heads),
                "linear_attn.in_proj_ba.weight": (("attention.wb.weight", "attention.wa.weight"), (ratio, ratio),
                                                  args.linear_key_heads)} | conv
    if args.attention_gate:
        return {"self_attn.q_proj.weight": (("attention.wq.weight", "attention.wg.weight"),
                                            (args.head_dim, args.head_dim), args.n_heads)}
    return {}


def on_disk(args: ModelArgs, whole: str) -> list[str]:
    """The tensors on disk of one that holds several of plait's: itself; but OLMo hybrid's and Kimi
    Linear's convolution, stored as q's, k's and v's, which transformers concatenates when it reads
    them, whatever each holds (its own saves cut the whole in thirds)."""
    if args.family in ("olmo_hybrid", "kimi_linear") and whole.endswith("conv1d.weight"):
        return [whole.replace("conv1d", f"{kind}_conv1d") for kind in "qkv"]
    return [whole]


def fused_part(tensor: torch.Tensor, name: str, parts: tuple[str, ...], rows: tuple[int, ...], groups: int
               ) -> torch.Tensor:
    """Plait's tensor `name` (one of `parts`) out of the tensor on disk that holds them all (a
    convolution's [channels, 1, taps] as plait's [channels, taps])."""
    piece = tensor.reshape(groups, sum(rows), *tensor.shape[1:]).split(rows, 1)[parts.index(name)]
    return piece.reshape(groups * rows[parts.index(name)], -1)


def fused_whole(tensors: list[torch.Tensor], rows: tuple[int, ...], groups: int, conv: bool) -> torch.Tensor:
    """The tensor on disk that holds plait's `tensors` (in order: `fused_part`'s inverse)."""
    whole = torch.cat([t.reshape(groups, n, -1) for t, n in zip(tensors, rows)], 1).reshape(groups * sum(rows), -1)
    return whole[:, None] if conv else whole


# A linear block's tensors and Qwen3-Next's shared expert, on disk (the rest are named as Llama's relatives')
LINEAR_NAMES = {"attention.A_log": "linear_attn.A_log", "attention.dt_bias": "linear_attn.dt_bias",
                "attention.out_norm.weight": "linear_attn.norm.weight",
                "attention.wo.weight": "linear_attn.out_proj.weight",
                # (Qwen3.5's own tensors; Qwen3-Next holds them in in_proj_qkvz and in_proj_ba)
                "attention.wz.weight": "linear_attn.in_proj_z.weight",
                "attention.wb.weight": "linear_attn.in_proj_b.weight",
                "attention.wa.weight": "linear_attn.in_proj_a.weight"}
# OLMo hybrid's, on disk: a linear block's (it norms its inputs), an attention block's norms (after
# each sub-layer: transformers names its norm after attention feedforward_layer_norm on disk)
OLMO_LINEAR_NAMES = {f"attention.w{ours}.weight": f"linear_attn.{theirs}_proj.weight"
                     for ours, theirs in zip("qkvzbao", "qkvgbao")} | {
    "attention.A_log": "linear_attn.A_log", "attention.dt_bias": "linear_attn.dt_bias",
    "attention.out_norm.weight": "linear_attn.o_norm.weight", "attention_norm.weight": "attention_layer_norm.weight",
    "ffn_norm.weight": "feedforward_layer_norm.weight"}
OLMO_ATTENTION_NAMES = {"attention_norm.weight": "feedforward_layer_norm.weight",
                        "ffn_norm.weight": "post_feedforward_layernorm.weight"}
SHARED_EXPERT = {"feed_forward.shared.w1": "mlp.shared_expert.gate_proj", "feed_forward.shared.w3":
                 "mlp.shared_expert.up_proj", "feed_forward.shared.w2": "mlp.shared_expert.down_proj",
                 "feed_forward.shared_gate": "mlp.shared_expert_gate"}


def qwen_mtp_name(name: str, args: ModelArgs) -> str:
    """A Qwen hybrid's name on disk for a tensor plait's naming puts in the layers after the model's
    (`model.layers.<n_layers + k>.`, DeepSeek-V3's way): its MTP module's, at the folder's top
    (`mtp.fc`, `mtp.layers.<k>.`...). Other names as they are."""
    layer = re.match(r"model\.layers\.(\d+)\.(.+)", name)
    if args.family not in QWEN_HYBRIDS or layer is None or int(layer.group(1)) < args.n_layers:
        return name
    k, (module, kind) = int(layer.group(1)) - args.n_layers, layer.group(2).rsplit(".", 1)
    return f"mtp.{MTP_OWN[module]}.{kind}" if module in MTP_OWN else f"mtp.layers.{k}.{layer.group(2)}"


def holder(args: ModelArgs, block: int, rest: str) -> tuple[str, tuple[str, ...], tuple[int, ...], int] | None:
    """The tensor on disk that holds plait's `rest` of block `block` with others: (its name in the
    block, plait's names it holds, their rows per group, the groups); None where `rest` is one of its own."""
    return next(((held, *fused) for held, fused in fused_tensors(args, block).items() if rest in fused[0]), None)


def hybrid_name(args: ModelArgs, block: int, rest: str) -> str | None:
    """The name in the block on disk of plait's `rest` of block `block`, where the hybrid names it
    its own way (None: as Llama's relatives do)."""
    held = holder(args, block, rest)
    if held is not None:
        return held[0]
    if args.family == "olmo_hybrid":
        return (OLMO_LINEAR_NAMES if args.linear(block) else OLMO_ATTENTION_NAMES).get(rest)
    if args.family == "kimi_linear":
        return kimi_name(args, block, rest)
    if args.linear(block) and rest in LINEAR_NAMES:
        return LINEAR_NAMES[rest]
    module, kind = rest.rsplit(".", 1)
    return f"{SHARED_EXPERT[module]}.{kind}" if module in SHARED_EXPERT else None
