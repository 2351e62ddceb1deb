"""The dense feed-forward layer: SwiGLU (Llama's), or GeGLU with tanh's GELU (Gemma's)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from plait.models.args import ModelArgs


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_hidden, bias=args.ffn_bias)
        self.w2 = nn.Linear(args.ffn_hidden, args.dim, bias=args.ffn_bias)
        self.w3 = nn.Linear(args.dim, args.ffn_hidden, bias=args.ffn_bias)
        self.gelu = args.activation == "gelu_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = F.gelu(self.w1(x), approximate="tanh") if self.gelu else F.silu(self.w1(x))
        return self.w2(gate * self.w3(x))
