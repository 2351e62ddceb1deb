"""Llama 4's text config.json (`llama4_text`: Scout and Maverick's language model) <-> plait's
ModelArgs: a mixture of experts on every `interleave_moe_layer_step`-th block (or those
`moe_layers` names), each with a shared expert and a router that picks the top k logits and
weighs each chosen expert's input by its sigmoid; dense blocks of `intermediate_size_mlp`;
blocks without RoPE (`no_rope_layers`, else every `no_rope_layer_interval`-th) whose queries are
temperature-tuned; weightless L2 q/k norms in the blocks with RoPE; chunked attention in those
(`attention_chunk_size`: a query sees the earlier keys of its chunk only; docs/families.md).
Its RoPE is Meta's interleaved pairs, plait's own: q and k are not reordered."""

from __future__ import annotations

from plait.config import ConfigError
from plait.hf.fields import Fields
from plait.models.args import ModelArgs


def llama4_switches(fields: Fields, n_layers: int, nope: tuple[int, ...]) -> dict:
    """The ModelArgs switches of a llama4_text config.json (`nope`: its blocks without RoPE)."""
    step = fields.integer("interleave_moe_layer_step")
    sparse = fields.integers("moe_layers")
    if sparse is None:  # (transformers' default: every step-th block, from step - 1)
        sparse = list(range(step - 1, n_layers, step))
    if not all(0 <= i < n_layers for i in sparse):
        fields.refuse("moe_layers", f"indices of the {n_layers} blocks")
    return {"n_experts": fields.integer("num_local_experts", required=True),
            "top_k": fields.integer("num_experts_per_tok"),
            "moe_hidden": fields.integer("intermediate_size", required=True),
            "ffn_hidden": fields.integer("intermediate_size_mlp", required=True),
            "dense_layers": tuple(i for i in range(n_layers) if i not in sparse), "n_shared_experts": 1,
            "router": "sigmoid", "balance_bias": False, "normalize_top_k": False, "route_inputs": True,
            "nope_layers": nope, "qk_norm": "l2" if fields.flag("use_qk_norm") else "none",
            "nope_temperature": fields.number("attn_scale") if fields.flag("attn_temperature_tuning") else 0.0,
            "temperature_floor": fields.integer("floor_scale"),
            "attention_chunk": fields.integer("attention_chunk_size") or 0}


def llama4_fields(args: ModelArgs) -> dict:
    """config.json's Llama 4 fields for `args`, refused in one line where it is not Llama 4's model."""
    if not (args.n_experts and args.router == "sigmoid" and not args.balance_bias and args.route_inputs
            and not args.normalize_top_k and args.n_shared_experts == 1 and args.route_scale == 1
            and not args.n_groups and args.qk_norm in ("none", "l2") and not args.sliding_window
            and not (args.post_norm or args.attention_sinks or args.expert_bias or args.router_bias or args.ffn_bias)):
        raise ConfigError("checkpoint: a llama4_text config.json has experts with a shared one, weighed on their "
                          "inputs by an unbiased sigmoid router, L2 q/k norms or none, no windows, sinks, post-norms "
                          "or biases on the MLP; this model differs")
    sparse = [i for i in range(args.n_layers) if args.sparse(i)]
    # (the interleaving that says which blocks are sparse, where one does: transformers then derives moe_layers)
    step = next((s for s in range(1, args.n_layers + 1) if sparse == list(range(s - 1, args.n_layers, s))), 1)
    return {"num_local_experts": args.n_experts, "num_experts_per_tok": args.top_k, "intermediate_size": args.moe_hidden,
            "intermediate_size_mlp": args.ffn_hidden, "moe_layers": sparse, "interleave_moe_layer_step": step,
            "no_rope_layers": [int(i not in args.nope_layers) for i in range(args.n_layers)],
            "use_qk_norm": args.qk_norm == "l2", "attn_temperature_tuning": bool(args.nope_temperature),
            "attn_scale": args.nope_temperature or 0.1, "floor_scale": args.temperature_floor,
            "attention_chunk_size": args.attention_chunk or None,
            "layer_types": ["chunked_attention" if args.attention_chunk and i not in args.nope_layers else
                            "full_attention" for i in range(args.n_layers)]}

