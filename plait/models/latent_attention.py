"""Multi-head latent attention (DeepSeek-V2/V3): keys and values expanded from a small latent
per token, so a context-parallel gather moves the latent instead of every head's keys and values
(a KV cache could hold it too; plait's holds the expanded keys).

    queries: x -> wq_a -> q_a_norm -> wq_b (or x -> wq): per head, nope entries + rope entries
    keys:    x -> wkv_a -> [latent, rope key]; latent -> kv_a_norm -> wkv_b: per head, nope
             entries + value; each head's key is its nope entries + the one rope key (RoPE'd)

The attention kernel is plait's (ScaledDotProduct: SDPA, masked, FlexAttention) over query/key
heads of nope + rope entries and value heads of v_head_dim, at DeepSeek's softmax scale.
Parameter names follow torchtitan's DeepSeek-V3 (wq_a, wkv_a, wkv_b, wo).
"""

from __future__ import annotations

import torch
from torch import nn

from plait.models.attention import KVCache, ScaledDotProduct
from plait.models.args import ModelArgs
from plait.models.norms import RMSNorm
from plait.models.rope import apply_rope, softmax_scale

LATENT_NORM_EPS = 1e-6  # the latents' norms take no rms_norm_eps in DeepSeek's code or transformers'


class KeyLatents(nn.Module):
    """The normalised key latents and RoPE keys of the tokens at hand, returned as they are: a
    seam, not a computation. Context parallelism hooks it to return the whole sequence's instead
    (plait/parallel/context_parallel.py), which each rank then expands into every head's keys and
    values itself: kv_lora_rank + qk_rope_head_dim values per token travel, not heads x (key +
    value) entries."""

    def forward(self, latent: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return latent, k_rope


class LatentAttention(nn.Module):
    def __init__(self, args: ModelArgs, window: int = 0, rope: bool = True):
        super().__init__()
        self.rope = rope  # (False: Kimi Linear's, no position but the order the linear blocks give; the
        # rope entries computed and used unrotated, as transformers' KimiLinearAttention does)
        self.nope, self.rope_dim, self.v_dim = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        self.kv_rank, self.head_dim = args.kv_lora_rank, args.head_dim
        self.qk_norm = "none"  # (no per-head norm: what tensor parallelism's plan asks of any attention)
        queries = args.n_heads * args.head_dim
        if args.q_lora_rank:
            self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=args.qkv_bias)
            self.q_a_norm = RMSNorm(args.q_lora_rank, LATENT_NORM_EPS)
            self.wq_b = nn.Linear(args.q_lora_rank, queries, bias=False)
        else:
            self.wq = nn.Linear(args.dim, queries, bias=False)
        self.wkv_a = nn.Linear(args.dim, args.kv_lora_rank + args.qk_rope_head_dim, bias=args.qkv_bias)
        self.kv_a_norm = RMSNorm(args.kv_lora_rank, LATENT_NORM_EPS)
        self.key_latents = KeyLatents()
        self.wkv_b = nn.Linear(args.kv_lora_rank, args.n_heads * (args.qk_nope_head_dim + args.v_head_dim), bias=False)
        self.wo = nn.Linear(args.n_heads * args.v_head_dim, args.dim, bias=args.out_bias)
        self.core = ScaledDotProduct(window, scale=softmax_scale(args.head_dim, args.rope_scaling))

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask=None, cache: KVCache | None = None) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 for the head count: under tensor parallelism each rank holds a slice of heads.
        q = self.wq_b(self.q_a_norm(self.wq_a(x))) if hasattr(self, "wq_a") else self.wq(x)
        q_nope, q_rope = q.view(batch, seq, -1, self.head_dim).split([self.nope, self.rope_dim], -1)
        latent, k_rope = self.wkv_a(x).split([self.kv_rank, self.rope_dim], -1)
        # One RoPE key, every head's. Keys: the tokens at hand (under context parallelism the
        # sequence's), in the compute dtype (an autocast norm may return fp32; wkv_b would cast it).
        k_rope = apply_rope(k_rope.unsqueeze(2), rope) if self.rope else k_rope.unsqueeze(2)
        latent, k_rope = self.key_latents(self.kv_a_norm(latent).to(k_rope.dtype), k_rope)
        k_nope, v = self.wkv_b(latent).view(batch, latent.shape[1], -1, self.nope + self.v_dim).split(
            [self.nope, self.v_dim], -1)
        q = torch.cat([q_nope, apply_rope(q_rope, rope) if self.rope else q_rope], -1)
        k = torch.cat([k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1)], -1)
        if cache is not None:  # generation: every earlier position's keys and values too (expanded)
            k, v = cache.extend(self, k, v, self.core.window)
            mask = torch.zeros(batch, k.shape[1], dtype=torch.long, device=x.device)
        out = self.core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))
