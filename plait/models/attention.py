"""Grouped-query attention: the projections, optional q/k norms, RoPE, the attention kernel
(SDPA causal, SDPA under a mask in query blocks, or FlexAttention) and the KV cache."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from plait.models.args import ModelArgs
from plait.models.masking import additive, allowed, chunk_segments
from plait.models.norms import ProjectionNorm, model_norm
from plait.models.rope import apply_rope


@functools.cache
def flex_kernel(compiled: bool):
    """FlexAttention, compiled where it trains (CUDA: a fused kernel; eager it materialises the
    scores), eager elsewhere (CPU forward, as the tests compare it)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention) if compiled else flex_attention


QUERY_BLOCK = 512  # query rows per SDPA call under a mask


def query_block(window: int) -> int:
    """Query rows per SDPA call: QUERY_BLOCK, or under a window half of it (at least 64): each
    block computes window - 1 + block keys per query, so smaller blocks compute fewer wasted
    ones, until the calls' own cost wins. Measured on a 2-core CPU (seq 8192, 12 heads of 64,
    window 512, forward + backward): blocks of 512, 256, 128, 64 took 0.48, 0.39, 0.44, 0.55 of
    SDPA's causal path over the whole sequence."""
    return min(QUERY_BLOCK, max(64, window // 2)) if window else QUERY_BLOCK


class ScaledDotProduct(nn.Module):
    """softmax(q k^T / sqrt(d)) v over q, k, v [batch, heads, seq, head_dim], k and v with the
    key/value heads (grouped-query attention, which SDPA's `enable_gqa` computes without a
    repeated copy of k and v: 20% less time forward + backward than repeating them). `mask`:
    None = causal over the sequence, SDPA's causal path; document ids [batch, keys]:
    `masked_attention`; a dict of BlockMasks by (window, chunk): FlexAttention. `queries`: where
    this rank's query rows lie in the sequence, as (first index, length) runs (default: the last
    q.shape[2] keys' positions, one run); `keys` likewise for k and v (default: from the first);
    `heads`: which of the module's heads q holds (default: all). `window` > 0: each query sees
    only itself and the window - 1 keys before it. `chunk` > 0: each query sees only the earlier
    keys of its chunk (masking.chunk_segments; Llama 4). `sink_heads` > 0: a learned sink logit per
    head joins each softmax's denominator (gpt-oss). `scale`: of the scores (default: 1/sqrt of
    q's head_dim). A module of its own so context parallelism
    can hand it the keys and values (and queries, and heads) it needs (forward hooks), without
    touching the model."""

    def __init__(self, window: int = 0, sink_heads: int = 0, scale: float | None = None, chunk: int = 0):
        super().__init__()
        self.window, self.scale, self.chunk = window, scale, chunk
        # (a parameter of the kernel's module: context parallelism's hooks hand the kernel its heads)
        self.sinks = nn.Parameter(torch.zeros(sink_heads)) if sink_heads else None

    @property
    def reach(self) -> int:
        """The most keys a query sees, itself included (0: all before it); context parallelism reads it."""
        return self.window or self.chunk

    def sink_logits(self) -> torch.Tensor | None:
        """The sinks of the heads this module holds (tensor parallelism hands back its share)."""
        return self.sinks

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None,
                queries: tuple[tuple[int, int], ...] = (), keys: tuple[tuple[int, int], ...] = (),
                heads: slice = slice(None)) -> torch.Tensor:
        width = v.shape[-1]
        if width > q.shape[-1] and (mask is None or isinstance(mask, torch.Tensor)):
            # Values wider than queries and keys (latent attention's v_head_dim above its q/k head
            # dim): q and k padded with zeros instead, which leaves every score as it was (its scale
            # is its own, never q's width).
            pad = (0, width - q.shape[-1])
            return self.forward(F.pad(q, pad), F.pad(k, pad), v, mask, queries, keys, heads)
        if width != q.shape[-1] and (mask is None or isinstance(mask, torch.Tensor)):
            # SDPA's fused kernels take one head_dim for q, k and v (else the math kernel runs,
            # on a CPU in fp32): latent attention's narrower values are padded with zeros, and
            # the output's padding dropped. (forward itself: hooks have run)
            return self.forward(q, k, F.pad(v, (0, q.shape[-1] - width)), mask, queries, keys, heads)[..., :width]
        sinks = self.sink_logits()
        sinks = sinks[heads] if sinks is not None else None  # (Ulysses: this rank's share of the heads)
        # (a chunk as long as the sequence cuts nothing: the causal path's exact result, faster)
        own = self.window or sinks is not None or 0 < self.chunk < k.shape[2]
        if mask is None and own:  # the masked path, one document
            mask = torch.zeros(k.shape[0], k.shape[2], dtype=torch.long, device=k.device)
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=self.scale)
        if isinstance(mask, torch.Tensor):
            return masked_attention(q, k, v, chunk_segments(mask, self.chunk),
                                    queries or ((k.shape[2] - q.shape[2], q.shape[2]),), self.reach,
                                    keys or ((0, k.shape[2]),), sinks, self.scale)
        if isinstance(mask, dict):
            mask = mask[self.window, self.chunk]
        if sinks is None:
            return flex_kernel(q.is_cuda)(q, k, v, block_mask=mask, enable_gqa=True, scale=self.scale)
        # A sink's share of each softmax: out x sum / (sum + e^sink) = out x sigmoid(lse - sink).
        from torch.nn.attention.flex_attention import AuxRequest

        out, aux = flex_kernel(q.is_cuda)(q, k, v, block_mask=mask, enable_gqa=True, scale=self.scale,
                                          return_aux=AuxRequest(lse=True))
        return out * torch.sigmoid(aux.lse - sinks[:, None].to(aux.lse.dtype))[..., None].to(out.dtype)


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor,
                    first: int, first_key: int, window: int, sinks: torch.Tensor | None = None,
                    scale: float | None = None) -> torch.Tensor:
    """One query block (sequence indices `first` on) over the keys k and v hold (sequence indices
    `first_key` on), under the mask built from `documents` here, in q's dtype (the compute dtype
    SDPA would convert it to). With `sinks`, one more key every query sees, whose score is its
    head's sink and whose value is zero: a coordinate appended to q (sink / scale) and k (0; the
    sink key's 1) gives it that score in SDPA's own kernel, gradients included."""
    rows = torch.arange(first, first + q.shape[2], device=q.device)
    mask = additive(allowed(documents, rows, first_key + k.shape[2], first_key, window), q.dtype)
    scale = scale or q.shape[-1] ** -0.5  # (the head's, fixed before q's last dimension grows by a sink's)
    if sinks is not None:
        (batch, heads, length, d), kv_heads = q.shape, k.shape[1]
        q = torch.cat([q, (sinks / scale).to(q.dtype)[None, :, None, None].expand(batch, heads, length, 1)], -1)
        sink_key = torch.cat([k.new_zeros(batch, kv_heads, 1, d), k.new_ones(batch, kv_heads, 1, 1)], -1)
        k = torch.cat([torch.cat([k, k.new_zeros(*k.shape[:3], 1)], -1), sink_key], 2)
        v = torch.cat([v, v.new_zeros(batch, kv_heads, 1, v.shape[-1])], 2)
        mask = torch.cat([mask, mask.new_zeros(*mask.shape[:3], 1)], -1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, scale=scale)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor,
                     queries: tuple[tuple[int, int], ...], window: int = 0,
                     keys: tuple[tuple[int, int], ...] = (), sinks: torch.Tensor | None = None,
                     scale: float | None = None) -> torch.Tensor:
    """SDPA under the document mask (or cp's causal rows: documents all zeros), one block of
    `query_block` rows at a time over the keys up to its last row only (under a `window`,
    from its first row's window on: O(seq x window), not seq^2): SDPA's causal path
    skips the blocks above the diagonal, but under a mask it computes every block and discards
    the masked ones (at seq 8192 that doubled attention's work). Each block's mask is built from
    the document ids, and each block is checkpointed (eager): backward builds the mask and the
    block's attention again rather than keep the mask (queries x keys, in the compute dtype) and
    the block's output and log-sum-exp; the recompute costs one more forward of attention, the
    memory is one block's mask at a time. `enable_gqa` keeps k and v unrepeated (on a 2-core
    CPU at seq 2048 also 3x faster than repeating them under a mask). Block outputs are joined
    in the [batch, seq, heads, head_dim] layout SDPA writes, so the join is the one copy the
    output projection reads (no transpose copy after it). `keys`: where k and v's rows lie in the
    sequence, as runs (default: one from 0); each block's keys lie in one of them."""
    outputs, row, block = [], 0, query_block(window)
    keys = keys or ((0, k.shape[2]),)
    key_rows = [sum(n for _, n in keys[:i]) for i in range(len(keys))]  # where each run starts in k
    for start, length in queries:
        for offset in range(0, length, block):
            rows = slice(row + offset, row + min(offset + block, length))
            first, end = start + offset, start + rows.stop - row  # the block's first query; one past its last
            first_key = max(0, first - window + 1) if window else 0
            run = next(i for i, (s, n) in enumerate(keys) if s <= first_key and end <= s + n)
            held = slice(key_rows[run] + first_key - keys[run][0], key_rows[run] + end - keys[run][0])
            inputs = (q[:, :, rows], k[:, :, held], v[:, :, held], documents, first, first_key, window, sinks, scale)
            # (Compiled, the partitioner decides what backward keeps: torch 2.13 cannot trace this
            # checkpoint around TP's tensors.)
            recompute = torch.is_grad_enabled() and not torch.compiler.is_compiling()
            out = checkpoint(block_attention, *inputs, use_reentrant=False) if recompute else block_attention(*inputs)
            outputs.append(out.transpose(1, 2))
        row += length
    return (torch.cat(outputs, dim=1) if len(outputs) > 1 else outputs[0]).transpose(1, 2)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, rope: bool = True, window: int = 0, chunk: int = 0):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=args.qkv_bias)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=args.out_bias)
        if args.attention_gate:  # (Qwen3-Next: the output times sigmoid of this, entry by entry)
            self.wg = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.gated = args.attention_gate
        self.qk_norm, self.rope, self.rotary, self.norm_eps = args.qk_norm, rope, args.rope_dim, args.norm_eps
        self.temperature = bool(args.nope_temperature) and not rope  # (its table comes in RoPE's place)
        if args.qk_norm == "head":  # one weight of head_dim, shared by every head
            self.q_norm, self.k_norm = model_norm(args.head_dim, args), model_norm(args.head_dim, args)
        elif args.qk_norm == "projection":  # a weight per entry of the projection (split with the heads under TP)
            self.q_proj_norm = ProjectionNorm(args.n_heads * args.head_dim, args.norm_eps)
            self.k_proj_norm = ProjectionNorm(args.n_kv_heads * args.head_dim, args.norm_eps)
        self.core = ScaledDotProduct(window, args.n_heads if args.attention_sinks else 0,
                                     args.attention_scalar ** -0.5 if args.attention_scalar else None, chunk)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask=None, cache: KVCache | None = None) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 instead of the head counts: under tensor parallelism each rank holds a slice of heads.
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        if self.qk_norm == "projection":
            q, k = self.q_proj_norm(q), self.k_proj_norm(k)
        q, k, v = (t.view(batch, seq, -1, self.head_dim) for t in (q, k, v))
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope and self.rotary < self.head_dim:  # (the rest of each head passes unrotated)
            q, k = (torch.cat([apply_rope(t[..., :self.rotary], rope), t[..., self.rotary:]], -1) for t in (q, k))
        elif self.rope:
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        if self.qk_norm == "l2" and self.rope:  # (weightless, in fp32, as transformers' Llama 4)
            q, k = (F.rms_norm(t.float(), (self.head_dim,), eps=self.norm_eps).type_as(t) for t in (q, k))
        if self.temperature:  # each query times its position's temperature
            scale = rope[: q.shape[1]] if rope.ndim == 1 else rope
            q = (q * scale[..., None, None]).to(q.dtype)
        if cache is not None:  # generation: attend to every earlier position's keys and values too
            k, v = cache.extend(self, k, v, self.core.window, self.core.chunk)
            # Causal within the new positions; every cached one lies before them all: one document
            # (whose first cached position begins a chunk: its chunks are cut as the sequence's).
            mask = torch.zeros(batch, k.shape[1], dtype=torch.long, device=x.device)
        out = self.core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)
        out = out.transpose(1, 2).reshape(batch, seq, -1)
        return self.wo(out * torch.sigmoid(self.wg(x)) if self.gated else out)


class KVCache:
    """Keys and values of the positions seen so far, per attention layer, for generation; of a
    layer with a window, only the window - 1 latest (all its next query can see); of a chunked
    one, those of the chunk its next query begins or continues."""

    def __init__(self):
        self.layers: dict[Attention, tuple[torch.Tensor, torch.Tensor]] = {}
        self.length = 0  # positions seen: where the next tokens' RoPE positions start

    def extend(self, layer: Attention, k: torch.Tensor, v: torch.Tensor, window: int = 0, chunk: int = 0
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's keys and values after the cached ones (what attention sees now)."""
        if layer in self.layers:
            k, v = (torch.cat([old, new], dim=1) for old, new in zip(self.layers[layer], (k, v)))
        # (a chunked layer's cache always starts at a chunk's first position: so k's own)
        kept = max(0, k.shape[1] - window + 1) if window else k.shape[1] // chunk * chunk if chunk else 0
        self.layers[layer] = (k[:, kept:], v[:, kept:])
        return k, v

    def advance(self, tokens: int) -> None:
        """The model has run `tokens` more positions through every layer."""
        self.length += tokens
