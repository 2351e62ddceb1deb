"""RMSNorm, its zero-centred form (Gemma 3), and the RMSNorm over a whole projection that OLMo 2
puts on queries and keys."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from plait.models.args import ModelArgs


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class OffsetRMSNorm(RMSNorm):
    """RMSNorm whose weight is its gain's offset from 1, x / rms(x) * (1 + w), initialised at 0,
    computed in fp32 as transformers' Gemma 3 does (in bf16, 1 + w would round a small offset away)."""

    def __init__(self, dim: int, eps: float):
        super().__init__(dim, eps)
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), 1.0 + self.weight.float(), self.eps).type_as(x)


def model_norm(dim: int, args: ModelArgs) -> RMSNorm:
    """A norm of the model's hidden states or heads, in the form its family uses."""
    return (OffsetRMSNorm if args.zero_centered_norms else RMSNorm)(dim, args.norm_eps)


class ProjectionNorm(RMSNorm):
    """RMSNorm over a whole query or key projection (OLMo 2), written out as transformers does.
    Under tensor parallelism that dimension is split over ranks and the TP plan gives it a forward
    that completes the mean square with an all-reduce; the same formula here keeps the two alike."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight).type_as(x)
