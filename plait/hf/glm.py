"""GLM-4.5's config.json (`glm4_moe`: GLM-4.5, GLM-4.5-Air, GLM-4.6) <-> plait's ModelArgs:
grouped-query attention with biases on q, k and v (none on the output projection), a per-head
q/k norm where `use_qk_norm` says, RoPE on the first part of each head (`partial_rotary_factor`,
read with the RoPE fields), and DeepSeek-V3's router: sigmoid scores over groups of experts with
a balancing bias, shared experts, the dense first blocks and an MTP module."""

from __future__ import annotations

from plait.config import ConfigError
from plait.hf.deepseek import grouped_router_fields, grouped_router_switches
from plait.hf.fields import Fields
from plait.models.args import ModelArgs


def glm_switches(fields: Fields) -> dict:
    """The ModelArgs switches of a glm4_moe config.json (but the rotated share: `rotary_fraction`)."""
    return {"qkv_bias": bool(fields.flag("attention_bias")), "out_bias": False,
            "qk_norm": "head" if fields.flag("use_qk_norm") else "none", **grouped_router_switches(fields)}


def glm_fields(args: ModelArgs) -> dict:
    """config.json's GLM-4.5 fields for `args`, refused in one line where it is not GLM-4.5's model."""
    if not (args.router == "sigmoid" and args.n_experts and not args.kv_lora_rank and not args.out_bias
            and args.qk_norm in ("none", "head") and args.dense_layers == tuple(range(len(args.dense_layers)))
            and not (args.expert_bias or args.router_bias or args.attention_sinks or args.sliding_window
                     or args.ffn_bias or args.post_norm)):
        raise ConfigError("checkpoint: a glm4_moe config.json has grouped-query attention without an output bias, "
                          "DeepSeek-V3's sigmoid router with its dense blocks first, no windows, sinks, post-norms or "
                          "expert biases; this model differs")
    return {"attention_bias": args.qkv_bias, "use_qk_norm": args.qk_norm == "head",
            "partial_rotary_factor": args.rope_dim / args.head_dim, **grouped_router_fields(args)}
