"""Rotary position embeddings (RoPE): the per-position angles, with Llama 3's and linear
scaling, and the rotation of interleaved pairs as Meta's reference does it."""

from __future__ import annotations

import math
import warnings

import torch


def rope_frequencies(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """The angle per position of each pair, as transformers computes it for Llama (bitwise):
    `linear` divides every frequency by `factor`; `llama3` divides only the low ones (wavelength
    beyond the original context / low_freq_factor), keeps the high ones and blends in between."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "linear":
        return freqs / scaling["factor"]
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        context = scaling["original_max_position_embeddings"]
        wavelength = 2 * math.pi / freqs
        scaled = torch.where(wavelength > context / low, freqs / factor, freqs)
        smooth = (context / wavelength - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelength < context / high) * ~(wavelength > context / low)
        return torch.where(medium, blended, scaled)
    return freqs


def rope_table(head_dim: int, max_seq_len: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """cos/sin of every (position, pair) as a [max_seq_len, head_dim/2, 2] float32 table."""
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), rope_frequencies(head_dim, theta, scaling))
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


# Inductor leaves apply_rope's complex product to its eager kernel and warns that this may be
# slow. Measured on a CPU: compiled, the complex product and the real formula it replaced take
# the same time; eager, the complex product is 3-5x faster than the real formula.
warnings.filterwarnings("ignore", "Torchinductor does not support code generation for complex operators")


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x0, x1) of x [batch, seq, heads, head_dim] by their position's
    angle; `table` [positions, pairs, 2] starts at x's first position, or is [batch, seq, pairs, 2]
    where each sequence has positions of its own (documents, context parallelism)."""
    table = table[: x.shape[1]] if table.ndim == 3 else table
    # As complex numbers the rotation is one product, (x0 + i x1)(cos + i sin): forward values
    # bit for bit those of the four real products, in a third of their time forward + backward.
    # In fp32 whatever x's dtype, so a bf16 x's gradient is rounded to bf16 once, not per term.
    rotation = torch.view_as_complex(table.float())[..., None, :]  # (fully_shard may cast it as a block input)
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * rotation).flatten(-2).type_as(x)
