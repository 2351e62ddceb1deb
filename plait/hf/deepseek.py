"""DeepSeek-V3's config.json (and Kimi K2's, the same architecture) <-> plait's ModelArgs:
multi-head latent attention, the grouped sigmoid router with its shared experts, the dense
first blocks. The fields DeepSeek's own config.json adds for its remote code (scoring_func,
topk_method, moe_layer_freq) must say what transformers' DeepseekV3 computes, or are refused."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open

from plait.config import ConfigError
from plait.hf.fields import Fields
from plait import jsonl
from plait.jsonl import is_int
from plait.models.args import ModelArgs

# DeepSeek's remote-code fields: the one value transformers' DeepseekV3 computes
REMOTE_FIELDS = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1}


def deepseek_switches(fields: Fields) -> dict:
    """The ModelArgs switches of a deepseek_v3 config.json."""
    config, where = fields.config, fields.where
    for field, allowed in REMOTE_FIELDS.items():
        if config.get(field, allowed) != allowed:
            raise ConfigError(f"{where} sets {field} {config[field]!r}, which transformers' DeepseekV3 does not "
                              f"compute; allowed: {allowed!r}")
    if not fields.flag("rope_interleave"):
        raise ConfigError(f"{where} sets rope_interleave {json.dumps(config['rope_interleave'])} (RoPE over halves of "
                          "the rope entries); plait reads DeepSeek's interleaved pairs; allowed: true")
    return {"q_lora_rank": fields.integer("q_lora_rank", minimum=0) or 0,
            "kv_lora_rank": fields.integer("kv_lora_rank"), "qk_nope_head_dim": fields.integer("qk_nope_head_dim"),
            "qk_rope_head_dim": fields.integer("qk_rope_head_dim"), "v_head_dim": fields.integer("v_head_dim"),
            **grouped_router_switches(fields)}


def grouped_router_switches(fields: Fields) -> dict:
    """The sigmoid router over groups of experts with a balancing bias and shared experts, the
    dense first blocks and the MTP module, as DeepSeek-V3's and GLM-4.5's config.json set them."""
    config, where = fields.config, fields.where
    mtp_field = "num_mtp_layers" if "num_mtp_layers" in config and "num_nextn_predict_layers" not in config else \
        "num_nextn_predict_layers"
    mtp = config.get(mtp_field, 1)  # (transformers: 1; null: none, as transformers, which computes none, reads it)
    if mtp is not None and not (is_int(mtp) and 0 <= mtp <= 1):
        raise ConfigError(f"{where} sets {mtp_field} {json.dumps(mtp)}; plait trains one MTP module; "
                          "allowed: 0 or 1")
    groups, top_groups = fields.integer("n_group"), fields.integer("topk_group")
    experts, top_k = fields.integer("n_routed_experts", required=True), fields.integer("num_experts_per_tok")
    if groups > 1 and (experts % groups or experts // groups < 2 or not 1 <= top_groups <= groups
                       or top_k > top_groups * (experts // groups)):
        raise ConfigError(f"{where} sets n_group {groups}, topk_group {top_groups} for {experts} experts of which "
                          f"{top_k} are chosen; allowed: n_group dividing the experts into groups of at least 2, "
                          "topk_group at most n_group, and the chosen groups holding at least num_experts_per_tok")
    return {"n_experts": experts, "top_k": top_k, "moe_hidden": fields.integer("moe_intermediate_size", required=True),
            "router": "sigmoid", "n_shared_experts": fields.integer("n_shared_experts"),
            "route_scale": fields.number("routed_scaling_factor"),
            "normalize_top_k": bool(fields.flag("norm_topk_prob")), "mtp_layers": mtp or 0,
            "n_groups": groups if groups > 1 else 0, "topk_groups": top_groups if groups > 1 else 0,
            "dense_layers": tuple(range(fields.integer("first_k_dense_replace", minimum=0)))}


def holds_mtp(folder: Path, name: str) -> bool:
    """Whether a folder's weights include the MTP module (its tensor `name`: DeepSeek-V3's
    `model.layers.<n_layers>.eh_proj.weight`): from the index, or the safetensors headers (no tensor is read)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = jsonl.document(index, str(index)).get("weight_map", {})
            return isinstance(weight_map, dict) and name in weight_map
        except (ConfigError, AttributeError):
            return False  # (weights.py refuses the unreadable index by name)
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), "pt") as weights:
            if name in weights.keys():
                return True
    return False


def deepseek_fields(args: ModelArgs) -> dict:
    """config.json's DeepSeek-V3 fields for `args`, refused with one line where it is not DeepSeek-V3's model."""
    if not (args.kv_lora_rank and args.router == "sigmoid" and args.n_shared_experts and args.qk_norm == "none"
            and args.dense_layers == tuple(range(len(args.dense_layers))) and not args.expert_bias
            and not args.router_bias and not args.attention_sinks and not args.sliding_window and not args.ffn_bias):
        raise ConfigError("checkpoint: a deepseek_v3 config.json has latent attention, the sigmoid router with shared "
                          "experts, its dense blocks first, no q/k norm, windows, sinks or expert biases; this model "
                          "differs")
    return {"q_lora_rank": args.q_lora_rank or None, "kv_lora_rank": args.kv_lora_rank,
            "qk_nope_head_dim": args.qk_nope_head_dim, "qk_rope_head_dim": args.qk_rope_head_dim,
            "v_head_dim": args.v_head_dim, "head_dim": args.qk_rope_head_dim, "num_key_value_heads": args.n_heads,
            "rope_interleave": True, **grouped_router_fields(args)}


def grouped_router_fields(args: ModelArgs) -> dict:
    """config.json's fields of the grouped sigmoid router, the dense first blocks and the MTP module."""
    return {"n_routed_experts": args.n_experts, "num_experts_per_tok": args.top_k,
            "moe_intermediate_size": args.moe_hidden, "n_shared_experts": args.n_shared_experts,
            "routed_scaling_factor": args.route_scale, "norm_topk_prob": args.normalize_top_k,
            "n_group": args.n_groups or 1, "topk_group": args.topk_groups or 1,
            "first_k_dense_replace": len(args.dense_layers), "num_nextn_predict_layers": args.mtp_layers}
