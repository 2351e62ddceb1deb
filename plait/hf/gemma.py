"""Gemma 3's text config.json (`gemma3_text`: Gemma 3 1B, and the language model of the larger
Gemma 3 folders) <-> plait's ModelArgs: norms before and after each sub-layer, every RMSNorm
zero-centred (x / rms * (1 + w)), the embedding scaled by sqrt(hidden_size), GeGLU with tanh's
GELU, a per-head q/k norm, the softmax scaled by query_pre_attn_scalar^-0.5, tied, and five
sliding blocks to one full one, each kind with its own RoPE (plait/hf/rope_fields.py)."""

from __future__ import annotations

from plait.config import ConfigError
from plait.hf.fields import Fields
from plait.hf.hybrid import QWEN_HYBRIDS
from plait.models.args import ModelArgs

# Gemma 3's switches: its config.json cannot turn them off, and no other family's can turn them on
GEMMA = {"qk_norm": "head", "sandwich_norm": True, "zero_centered_norms": True, "embed_scale": True,
         "activation": "gelu_tanh"}


def gemma_switches(fields: Fields) -> dict:
    """The ModelArgs switches of a gemma3_text config.json (bidirectional attention, EmbeddingGemma's,
    is refused with the fields no family computes)."""
    return GEMMA | {"attention_scalar": fields.integer("query_pre_attn_scalar")}


def gemma_fields(args: ModelArgs) -> dict:
    """config.json's Gemma 3 fields for `args`; refused in one line where `args` is not Gemma 3's model,
    or (another family) has a switch only Gemma 3's config.json says."""
    if args.family != "gemma3_text":
        shared = ("qk_norm", "zero_centered_norms") if args.family in QWEN_HYBRIDS else ("qk_norm",)
        gemma_only = [name for name, value in GEMMA.items() if getattr(args, name) == value and name not in shared]
        if gemma_only or args.attention_scalar:
            raise ConfigError(f"checkpoint: a {args.family} config.json has no {', '.join(gemma_only) or 'attention_scalar'}"
                              "; this model has (export it as gemma3_text)")
        return {}
    if any(getattr(args, name) != value for name, value in GEMMA.items()) or args.n_experts or args.post_norm or args.attention_sinks or args.ffn_bias or args.rotary_dim:
        raise ConfigError("checkpoint: a gemma3_text config.json has norms around each sub-layer (zero-centred), "
                          "the embedding scaled, GeGLU, per-head q/k norms, no experts, sinks or MLP biases; this "
                          "model differs")
    return {"hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": args.attention_scalar or args.head_dim,
            "final_logit_softcapping": None, "attn_logit_softcapping": None}
