"""Rotary position embeddings (RoPE): the per-position angles, with Llama 3's, linear and YaRN
scaling, and the rotation of interleaved pairs as Meta's reference does it."""

from __future__ import annotations

import math
import warnings

import torch


def rope_frequencies(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """The angle per position of each pair, as transformers computes it for Llama (bitwise):
    `linear` divides every frequency by `factor`; `llama3` divides only the low ones (wavelength
    beyond the original context / low_freq_factor), keeps the high ones and blends in between;
    `yarn` likewise divides the pairs that turn fewer than beta_slow times over the original
    context, keeps those that turn more than beta_fast times, and ramps linearly in between."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "linear":
        return freqs / scaling["factor"]
    if kind == "yarn":
        return yarn_frequencies(head_dim, theta, scaling)
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


def yarn_frequencies(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN's frequencies (arXiv 2309.00071), as transformers' `_compute_yarn_parameters`."""
    context, factor = scaling["original_max_position_embeddings"], scaling["factor"]
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def pair_turning(rotations: float) -> float:  # the pair index that turns `rotations` times over the context
        return head_dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = pair_turning(fast), pair_turning(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    high += 0.001 if low == high else 0  # (no zero-width ramp)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    base = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    kept = 1 - ramp  # 1: the pair keeps its frequency (extrapolation); 0: divided by factor
    return 1.0 / (factor * base) * (1 - kept) + 1.0 / base * kept


def attention_factor(scaling: dict | None) -> float:
    """YaRN's scale of q and k (cos and sin times it): attention_factor, else from factor (and
    mscale / mscale_all_dim where both are set, as DeepSeek-V3's configs do); 1 otherwise."""
    if (scaling or {}).get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = scaling["factor"]
    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return float(yarn_mscale(factor, scaling["mscale"]) / yarn_mscale(factor, scaling["mscale_all_dim"]))
    return yarn_mscale(factor)


def yarn_mscale(factor: float, weight: float = 1.0) -> float:
    """YaRN's magnitude correction for a context `factor` times the original."""
    return 1.0 if factor <= 1 else 0.1 * weight * math.log(factor) + 1.0


def softmax_scale(head_dim: int, scaling: dict | None) -> float:
    """DeepSeek's attention scale: 1/sqrt(head_dim), under any RoPE scaling with mscale_all_dim times
    yarn_mscale(factor, mscale_all_dim) squared (q and k's share of it, which the table leaves out).
    Any scaling, not YaRN's alone: transformers' DeepseekV3 (yarn_apply_mscale) scales under each."""
    weight = (scaling or {}).get("mscale_all_dim")
    return head_dim ** -0.5 * (yarn_mscale(scaling["factor"], weight) ** 2 if weight else 1.0)


def rope_table(head_dim: int, max_seq_len: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """cos/sin of every (position, pair) as a [max_seq_len, head_dim/2, 2] float32 table (under
    YaRN times its attention factor, which so scales q and k)."""
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), rope_frequencies(head_dim, theta, scaling))
    table = torch.stack([angles.cos(), angles.sin()], dim=-1)
    scale = attention_factor(scaling)
    return table * scale if scale != 1.0 else table


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
