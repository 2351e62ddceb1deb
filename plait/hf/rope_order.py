"""RoPE layout: plait (like Meta's reference) rotates interleaved pairs (x0, x1), (x2, x3), ...
of each head; Hugging Face rotates the two halves (x_i, x_{i+d/2}). The rotation is the same
once each head's entries of the query and key projections are reordered: plait entry 2i -> HF
entry i, plait 2i+1 -> HF i + d/2 (`to_hf_rope_order`; `from_hf_rope_order` is its inverse),
in wq and wk's rows, their biases and the q/k norms' weights alike; where RoPE rotates a head's
first `rotary_dim` entries alone (GLM-4.5), those are reordered and the rest stay. (Blocks
without RoPE are reordered too: q and k permuted alike leave every q.k, so the model, unchanged.)
"""

from __future__ import annotations

import re

import torch

from plait.models.args import ModelArgs

ROPE_ORDERED = ("wq.weight", "wk.weight", "wq.bias", "wk.bias", "q_norm.weight", "k_norm.weight", "q_proj_norm.weight",
                "k_proj_norm.weight")
LAYER = re.compile(r"layers\.(\d+)\.(.+)")  # a block's parameter: (block, its name in the block)


def rope_reordered(name: str, args: ModelArgs) -> bool:
    """Whether `name`'s rows are in RoPE's interleaved order here and in halves on disk (latent
    attention's and Llama 4's are interleaved on disk too)."""
    layer = LAYER.match(name)
    linear = layer is not None and args.linear(int(layer.group(1)))  # (a linear block's q and k: no RoPE)
    return name.endswith(ROPE_ORDERED) and not args.kv_lora_rank and args.family != "llama4_text" and not linear


def to_hf_rope_order(weight: torch.Tensor, head_dim: int, rotary: int) -> torch.Tensor:
    """Each head's first `rotary` entries (those RoPE rotates) from interleaved pairs to halves."""
    heads = weight.shape[0] // head_dim
    head = weight.reshape(heads, head_dim, -1)
    rotated = head[:, :rotary].unflatten(1, (rotary // 2, 2)).transpose(1, 2).flatten(1, 2)
    return torch.cat([rotated, head[:, rotary:]], 1).reshape(weight.shape)


def from_hf_rope_order(weight: torch.Tensor, head_dim: int, rotary: int) -> torch.Tensor:
    heads = weight.shape[0] // head_dim
    head = weight.reshape(heads, head_dim, -1)
    rotated = head[:, :rotary].unflatten(1, (2, rotary // 2)).transpose(1, 2).flatten(1, 2)
    return torch.cat([rotated, head[:, rotary:]], 1).reshape(weight.shape)
