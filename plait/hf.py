"""Hugging Face Llama interchange: export to and import from `LlamaForCausalLM` folders.

Parameter names (plait -> Hugging Face):
    tok_embeddings.weight                  -> model.embed_tokens.weight
    layers.N.attention.w{q,k,v,o}.weight   -> model.layers.N.self_attn.{q,k,v,o}_proj.weight
    layers.N.feed_forward.w1/w3/w2.weight  -> model.layers.N.mlp.gate_proj/up_proj/down_proj.weight
    layers.N.attention_norm.weight         -> model.layers.N.input_layernorm.weight
    layers.N.ffn_norm.weight               -> model.layers.N.post_attention_layernorm.weight
    norm.weight                            -> model.norm.weight
    output.weight                          -> lm_head.weight

RoPE layout: plait (like Meta's reference) rotates interleaved pairs (x0, x1), (x2, x3), ...
of each head; Hugging Face rotates the two halves (x_i, x_{i+d/2}). The rotation is the same
once each head's rows of wq and wk are reordered: plait row 2i -> HF row i, plait row 2i+1 ->
HF row i + d/2 (`to_hf_rope_order`; `from_hf_rope_order` is its inverse).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from plait.config import ConfigError
from plait.model import ModelArgs

LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
TOP_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
LAYER = re.compile(r"layers\.(\d+)\.(.+)")
WEIGHTS = "model.safetensors"


def hf_name(name: str) -> str:
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    index, rest = LAYER.match(name).groups()
    return f"model.layers.{index}.{LAYER_NAMES[rest]}"


def to_hf_rope_order(weight: torch.Tensor, head_dim: int) -> torch.Tensor:
    heads = weight.shape[0] // head_dim
    return weight.view(heads, head_dim // 2, 2, -1).transpose(1, 2).reshape(weight.shape)


def from_hf_rope_order(weight: torch.Tensor, head_dim: int) -> torch.Tensor:
    heads = weight.shape[0] // head_dim
    return weight.view(heads, 2, head_dim // 2, -1).transpose(1, 2).reshape(weight.shape)


def hf_config(args: ModelArgs, dtype: torch.dtype) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": args.dim, "intermediate_size": args.ffn_hidden, "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads, "head_dim": args.head_dim,
        "vocab_size": args.vocab_size, "rms_norm_eps": args.norm_eps, "rope_theta": args.rope_theta,
        "max_position_embeddings": args.max_seq_len, "tie_word_embeddings": False, "attention_bias": False,
        "mlp_bias": False, "torch_dtype": str(dtype).removeprefix("torch."),
    }


def export(state_dict: dict[str, torch.Tensor], args: ModelArgs, out: Path, dtype: torch.dtype) -> None:
    """Write `out/model.safetensors` and `out/config.json` from a full plait state dict."""
    converted = {}
    for name, tensor in state_dict.items():
        if name.endswith(("wq.weight", "wk.weight")):
            tensor = to_hf_rope_order(tensor, args.head_dim)
        converted[hf_name(name)] = tensor.to(dtype).contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(converted, str(out / WEIGHTS), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(args, dtype), indent=1))


def is_hf_folder(folder: Path) -> bool:
    return (folder / "config.json").is_file()


def check(folder: Path, args: ModelArgs, option: str) -> dict[str, Path]:
    """Fail with one line unless `folder` holds this model's shape and every weight; reads the
    config and the safetensors headers only. Returns the weight files."""
    config = json.loads((folder / "config.json").read_text())
    expected = hf_config(args, torch.float32)
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "vocab_size")
    mismatched = [f"{k} {config.get(k)} vs {expected[k]}" for k in keys if config.get(k) != expected[k]]
    if mismatched:
        raise ConfigError(f"{option}: {folder} holds another model shape ({', '.join(mismatched)} in this run)")
    theirs, ours = math_options(config), math_options(expected)
    differ = [f"{k} {theirs[k]} vs {ours[k]}" for k in ours if theirs[k] != ours[k]]
    if differ:
        raise ConfigError(f"{option}: {folder} computes differently from this run's model ({', '.join(differ)} in this "
                          "run); plait would load its weights into the wrong function")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{option}: {folder} has config.json but no .safetensors weights")
    present = {}  # Hugging Face name -> the file holding it
    for f in files:
        with safe_open(str(f), "pt") as weights:
            present.update(dict.fromkeys(weights.keys(), f))
    missing = [hf_name(n) for n in _plait_names(args) if hf_name(n) not in present]
    if missing:
        raise ConfigError(f"{option}: {folder} lacks {missing[:3]}{' ...' if len(missing) > 3 else ''}")
    return present


def math_options(config: dict) -> dict:
    """The fields of a Llama config.json beyond the shape that change what the model computes,
    with transformers' defaults; both layouts of the RoPE fields (classic `rope_theta` +
    `rope_scaling`, and transformers 5's `rope_parameters`)."""
    rope = config.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    scaling = config.get("rope_scaling") or ({k: v for k, v in rope.items() if k != "rope_theta"}
                                             if rope_type != "default" else None)
    return {"rope_theta": float(config.get("rope_theta", rope.get("rope_theta", 10000.0))), "rope_scaling": scaling,
            "rms_norm_eps": float(config.get("rms_norm_eps", 1e-6)),
            "head_dim": config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
            "tie_word_embeddings": bool(config.get("tie_word_embeddings", False)),
            "attention_bias": bool(config.get("attention_bias", False)), "mlp_bias": bool(config.get("mlp_bias", False))}


def _plait_names(args: ModelArgs) -> list[str]:
    from plait.model import Transformer

    with torch.device("meta"):
        return list(Transformer(args).state_dict())


class HFWeights(Mapping):
    """A Hugging Face Llama folder's weights as a plait state dict (fp32, plait names and RoPE
    order), checked against `args` up front and read one tensor at a time, memory-mapped, when
    asked for: a rank holds one full tensor at a time while it cuts its shard, never the model."""

    def __init__(self, folder: Path, args: ModelArgs, option: str):
        self.args, self.names, self.files = args, _plait_names(args), check(folder, args, option)

    def __getitem__(self, name: str) -> torch.Tensor:
        with safe_open(str(self.files[hf_name(name)]), "pt") as weights:
            tensor = weights.get_tensor(hf_name(name)).float()
        if name.endswith(("wq.weight", "wk.weight")):
            tensor = from_hf_rope_order(tensor, self.args.head_dim)
        return tensor

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)
