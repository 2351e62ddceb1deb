"""Kimi Linear's config.json (`kimi_linear`: Kimi-Linear-48B-A3B) <-> plait's ModelArgs, and its
tensors' names.

Its blocks: Kimi Delta Attention (the gated delta rule with a gate per key channel, its gate and
output gate through bottlenecks: plait/models/linear_attention.py) among multi-head latent
attention blocks without RoPE (DeepSeek-V3's, NoPE: the positions are what the linear blocks
give); DeepSeek-V3's router (sigmoid scores, a balancing bias, shared experts), its first blocks
dense. Its config.json says things two ways, both read as transformers reads them: the released
folders' `linear_attn_config` (1-indexed `full_attn_layers`, `kda_layers`) and
`first_k_dense_replace`, or the `layer_types` and `mlp_layer_types` transformers writes; and its
expert fields by transformers' attribute map (`num_experts_per_token` is `num_experts_per_tok`).

On disk (the released names, which transformers writes back): a linear block's `self_attn.q_proj`,
`k_proj`, `v_proj`, `q_conv1d`/`k_conv1d`/`v_conv1d` (one tensor in transformers: plait/hf/
hybrid.py joins them as OLMo hybrid's), `f_a_proj`/`f_b_proj` (the gate), `g_a_proj`/`g_b_proj`
(the output gate), `b_proj`, `A_log` ([1, 1, heads, 1]), `dt_bias`, `o_norm`, `o_proj`; a sparse
block's feed-forward is `block_sparse_moe` (experts `experts.E.w1/w2/w3`, Mixtral's), a dense
one's `mlp` (transformers' own saves name it `block_sparse_moe` too: both are read).
"""

from __future__ import annotations

import re

from plait.config import ConfigError
from plait.hf.fields import Fields
from plait.models.args import ModelArgs

# Its switches: its config.json cannot turn them off
KIMI_LINEAR = {"linear_channel_gates": True, "router": "sigmoid", "linear_a_init": (1.0, 16.0),
               "linear_dt_init": (0.001, 0.1, 1e-4)}
# The fields its released config.json adds for its remote code: the one value transformers' class computes
REMOTE_FIELDS = {"moe_router_activation_func": "sigmoid", "mla_use_nope": True, "moe_layer_freq": 1}
# transformers' attribute map: config.json's name -> the class's (either may be written)
ALIASES = {"num_experts_per_tok": "num_experts_per_token", "norm_topk_prob": "moe_renormalize",
           "n_shared_experts": "num_shared_experts", "n_group": "num_expert_group",
           "max_position_embeddings": "model_max_length"}
KINDS = ("full_attention", "linear_attention")


def aliased(fields: Fields, name: str) -> str:
    """The name config.json gives the class's field `name` (its alias where it holds that one)."""
    return ALIASES[name] if name in ALIASES and fields.has(ALIASES[name]) else name


def kimi_switches(fields: Fields, n_layers: int) -> dict:
    """The ModelArgs switches of a kimi_linear config.json."""
    for name, allowed in REMOTE_FIELDS.items():
        if fields.config.get(name, allowed) != allowed:
            fields.refuse(name, repr(allowed).lower(), ", which transformers' KimiLinear does not compute")
    linear = Fields(fields.table("linear_attn_config") or {}, fields.where, name="linear_attn_config")
    types = fields.texts("layer_types", n_layers)
    if types is None and linear.has("full_attn_layers") and linear.has("kda_layers"):
        full, kda = linear.integers("full_attn_layers"), linear.integers("kda_layers")
        if sorted(full + kda) != list(range(1, n_layers + 1)):
            linear.refuse("full_attn_layers", f"with kda_layers, each block 1 to {n_layers} once")
        types = ["full_attention" if i + 1 in full else "linear_attention" for i in range(n_layers)]
    if types is None:
        types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n_layers)]
    if not set(types) <= set(KINDS):
        fields.refuse("layer_types", "a list of full_attention and linear_attention")
    mlp = fields.texts("mlp_layer_types", n_layers)
    if mlp is None:
        first_dense = fields.integer("first_k_dense_replace", minimum=0) if fields.has("first_k_dense_replace") else 1
        mlp = ["dense" if i < first_dense else "sparse" for i in range(n_layers)]
    if not set(mlp) <= {"dense", "sparse"}:
        fields.refuse("mlp_layer_types", "a list of dense and sparse")
    heads = linear.integer("num_heads") if linear.has("num_heads") else fields.integer("linear_num_heads")
    head_dim = linear.integer("head_dim") if linear.has("head_dim") else fields.integer("linear_head_dim")
    taps = linear.integer("short_conv_kernel_size") if linear.has("short_conv_kernel_size") else \
        fields.integer("linear_conv_kernel_dim")
    experts = fields.integer("num_local_experts" if fields.has("num_local_experts") else "num_experts", required=True)
    groups, top_groups = fields.integer(aliased(fields, "n_group")), fields.integer("topk_group")
    full = tuple(i for i, kind in enumerate(types) if kind == "full_attention")
    return KIMI_LINEAR | {
        "linear_layers": tuple(i for i in range(n_layers) if i not in full), "nope_layers": full,
        "linear_key_heads": heads, "linear_value_heads": heads, "linear_key_dim": head_dim,
        "linear_value_dim": head_dim, "linear_conv": taps,
        "q_lora_rank": fields.integer("q_lora_rank", minimum=0) or 0, "kv_lora_rank": fields.integer("kv_lora_rank"),
        "qk_nope_head_dim": fields.integer("qk_nope_head_dim"), "qk_rope_head_dim": fields.integer("qk_rope_head_dim"),
        "v_head_dim": fields.integer("v_head_dim"), "n_experts": experts,
        "top_k": fields.integer(aliased(fields, "num_experts_per_tok")),
        "moe_hidden": fields.integer("moe_intermediate_size", required=True),
        "n_shared_experts": fields.integer(aliased(fields, "n_shared_experts")),
        "route_scale": fields.number("routed_scaling_factor"),
        "normalize_top_k": bool(fields.flag(aliased(fields, "norm_topk_prob"))),
        "n_groups": groups if groups > 1 else 0, "topk_groups": top_groups if groups > 1 else 0,
        "dense_layers": tuple(i for i, kind in enumerate(mlp) if kind == "dense")}


def kimi_fields(args: ModelArgs) -> dict:
    """config.json's Kimi Linear fields for `args` (both ways: transformers' and the released
    folders'), refused in one line where it is not Kimi Linear's model."""
    full = tuple(i for i in range(args.n_layers) if not args.linear(i))
    if not (args.linear_layers and args.kv_lora_rank and args.nope_layers == full and args.n_experts
            and args.linear_key_heads == args.linear_value_heads and args.linear_key_dim == args.linear_value_dim
            and all(getattr(args, k) == v for k, v in KIMI_LINEAR.items())
            and args.qk_norm == "none" and not args.linear_norm_eps and not args.linear_negative_eigenvalues
            and not (args.sliding_window or args.post_norm or args.sandwich_norm
                     or args.attention_sinks or args.attention_gate or args.zero_centered_norms or args.ffn_bias
                     or args.expert_bias or args.router_bias or args.shared_expert_gate or args.mtp_layers)):
        raise ConfigError("checkpoint: a kimi_linear config.json has Kimi Delta Attention blocks among latent "
                          "attention ones without RoPE, experts with DeepSeek-V3's router, and no MLP biases, q/k "
                          "norms, windows, sinks, gates or MTP module; this model differs")
    return {"layer_types": ["linear_attention" if args.linear(i) else "full_attention" for i in range(args.n_layers)],
            "mlp_layer_types": ["sparse" if args.sparse(i) else "dense" for i in range(args.n_layers)],
            "linear_attn_config": {"full_attn_layers": [i + 1 for i in full],
                                   "kda_layers": [i + 1 for i in args.linear_layers],
                                   "num_heads": args.linear_key_heads, "head_dim": args.linear_key_dim,
                                   "short_conv_kernel_size": args.linear_conv},
            "linear_num_heads": args.linear_key_heads, "linear_head_dim": args.linear_key_dim,
            "linear_conv_kernel_dim": args.linear_conv, "mla_use_nope": True, "q_lora_rank": args.q_lora_rank or None,
            "kv_lora_rank": args.kv_lora_rank, "qk_nope_head_dim": args.qk_nope_head_dim,
            "qk_rope_head_dim": args.qk_rope_head_dim, "v_head_dim": args.v_head_dim,
            "head_dim": args.qk_rope_head_dim, "num_key_value_heads": args.n_heads, "num_experts": args.n_experts,
            "num_experts_per_token": args.top_k,
            "moe_intermediate_size": args.moe_hidden, "num_shared_experts": args.n_shared_experts,
            "routed_scaling_factor": args.route_scale, "moe_renormalize": args.normalize_top_k,
            "num_expert_group": args.n_groups or 1, "topk_group": args.topk_groups or 1,
            # (the released folders' way, where it says it: mlp_layer_types, which transformers reads first, else)
            "first_k_dense_replace": len(args.dense_layers) if args.dense_layers == tuple(
                range(len(args.dense_layers))) else None}


# A linear block's tensors on disk (its q/k/v and output projections are named as attention's)
LINEAR_NAMES = {f"attention.{ours}": f"self_attn.{theirs}" for ours, theirs in {
    "wb.weight": "b_proj.weight", "wa_down.weight": "f_a_proj.weight", "wa.weight": "f_b_proj.weight",
    "wz_down.weight": "g_a_proj.weight", "wz.weight": "g_b_proj.weight", "A_log": "A_log", "dt_bias": "dt_bias",
    "out_norm.weight": "o_norm.weight"}.items()}
SPARSE = "block_sparse_moe"  # a sparse block's feed-forward on disk (Mixtral's name)


def kimi_name(args: ModelArgs, block: int, rest: str) -> str | None:
    """The name in the block on disk of plait's `rest` of block `block`, where Kimi Linear names it
    its own way (None: as DeepSeek-V3 does)."""
    if args.linear(block) and rest in LINEAR_NAMES:
        return LINEAR_NAMES[rest]
    if args.sparse(block) and rest.startswith("feed_forward.router.gate."):
        return f"{SPARSE}.gate.{rest.rsplit('.', 1)[1]}"
    if args.sparse(block) and rest.startswith("feed_forward.shared."):
        module, kind = rest.removeprefix("feed_forward.shared.").rsplit(".", 1)
        return f"{SPARSE}.shared_experts.{dict(w1='gate_proj', w3='up_proj', w2='down_proj')[module]}.{kind}"
    return None


def disk_shape(args: ModelArgs, name: str) -> tuple[int, ...] | None:
    """The shape on disk of a tensor whose shape there is not plait's: Kimi Linear's A_log, [1, 1, heads, 1]."""
    return (1, 1, args.linear_key_heads, 1) if args.family == "kimi_linear" and name.endswith("self_attn.A_log") \
        else None


DENSE_AS_SPARSE = re.compile(rf"model\.layers\.(\d+)\.{SPARSE}\.((gate|up|down)_proj\.weight)")


def stored_names(present: dict, args: ModelArgs) -> dict[str, str]:
    """Kimi Linear's dense feed-forward as transformers' saves name it (`block_sparse_moe.gate_proj`):
    plait's name on disk (`mlp.gate_proj`, the released folders') -> the stored one."""
    if args.family != "kimi_linear":
        return {}
    found = {name: DENSE_AS_SPARSE.fullmatch(name) for name in present}
    return {f"model.layers.{m.group(1)}.mlp.{m.group(2)}": name for name, m in found.items()
            if m and not args.sparse(int(m.group(1)))}
