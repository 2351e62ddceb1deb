"""RMSNorm, and the RMSNorm over a whole projection that OLMo 2 puts on queries and keys."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class ProjectionNorm(RMSNorm):
    """RMSNorm over a whole query or key projection (OLMo 2), written out as transformers does.
    Under tensor parallelism that dimension is split over ranks and the TP plan gives it a forward
    that completes the mean square with an all-reduce; the same formula here keeps the two alike."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight).type_as(x)
