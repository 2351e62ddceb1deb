"""Linear attention by the gated delta rule (Gated DeltaNet: Qwen3-Next's and Qwen3.5's token
mixer in three of every four blocks), in plain PyTorch.

Each head keeps a state S (key dim x value dim) in place of a cache of keys and values. At each
position t it decays, is corrected toward the new value, and is read by the query:

    S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T,    o_t = S_t^T q_t

with a_t = exp(g_t) in (0, 1] (the gate) and b_t in (0, 1) (the step). The chunked form computes
the positions of a chunk at once (the state's corrections inside a chunk are a triangular system,
solved in one call) and carries the state from chunk to chunk: O(seq x chunk) work, not seq^2.

Under the document mask each document starts from a zero state and a zero convolution window,
as it would alone: every term that would cross a document boundary is masked to zero (in exact
arithmetic, never by a decay that underflows), so a packed sequence computes what its documents
compute alone.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from plait.models.args import ModelArgs


def causal_conv(x: torch.Tensor, weight: torch.Tensor, documents: torch.Tensor | None = None,
                history: torch.Tensor | None = None) -> torch.Tensor:
    """SiLU of the causal depthwise convolution of x [batch, seq, channels] by weight [channels,
    taps]: out_t = sum_s weight[:, taps - 1 - s] x_{t-s}, in fp32 (each of the taps' sums rounded
    once). `documents` [batch, seq]: a tap that would reach into an earlier document reads zero.
    `history` [batch, taps - 1, channels]: the inputs before the first position (generation's
    cache, a context-parallel chunk's predecessor; default zeros); `documents` then covers its
    positions too [batch, taps - 1 + seq]."""
    seq = x.shape[1]
    if history is not None:
        x = torch.cat([history.to(x.dtype), x], 1)
    if documents is not None:  # (the positions before the first read document -1: none)
        documents = F.pad(documents, (x.shape[1] - documents.shape[1], 0), value=-1)
    x32, w = x.float(), weight.float()
    # Each tap's product keeps its shifted copy of x for the weight's gradient: taps - 1 fp32
    # copies of the input (Qwen3-Next's: 96 KiB a token in each linear block). Recomputed in backward
    # from x instead (element-wise work; compiled, the partitioner decides what backward keeps).
    recompute = torch.is_grad_enabled() and not torch.compiler.is_compiling()
    out = checkpoint(taps_sum, x32, w, documents, seq, use_reentrant=False) if recompute else \
        taps_sum(x32, w, documents, seq)
    return F.silu(out).to(x.dtype)


def taps_sum(x32: torch.Tensor, w: torch.Tensor, documents: torch.Tensor | None, seq: int) -> torch.Tensor:
    """causal_conv's sum over the taps, for the last `seq` positions of x32."""
    length = x32.shape[1]
    out = x32[:, -seq:] * w[:, -1]
    for s in range(1, w.shape[1]):
        earlier = F.pad(x32, (0, 0, s, 0))[:, length - seq: length]  # x_{t-s}
        if documents is not None:
            same = documents[:, -seq:] == F.pad(documents, (s, 0), value=-1)[:, length - seq: length]
            earlier = earlier * same[..., None]
        out = out + earlier * w[:, -1 - s]
    return out


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     documents: torch.Tensor | None = None, state: torch.Tensor | None = None,
                     chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over q, k [batch, seq, heads, key dim] (normalised and scaled), v
    [batch, seq, heads, value dim], g (log of the gate, <= 0) and beta [batch, seq, heads], in
    fp32, chunk by chunk. g [batch, seq, heads] gates a head's state as a whole (Gated DeltaNet);
    g [batch, seq, heads, key dim] gates each key channel's row of it (Kimi Delta Attention: S_t =
    (I - b k k^T) diag(a_t) S_{t-1} + b k v^T). `documents` [batch, seq]: each document from a zero
    state (default: one document); `state` [batch, heads, key dim, value dim]: the state before
    the first position, which continues the first position's document. Returns the output [batch,
    seq, heads, value dim] and the state after the last position."""
    batch, seq, heads, dk = k.shape
    chunk = min(chunk, seq)
    pad = -seq % chunk
    if documents is None:
        documents = torch.zeros(batch, seq, dtype=torch.long, device=q.device)
    g = g if g.ndim == 4 else g[..., None]  # (a head's gate: one channel, broadcast over the key dim)
    # (padding after the last position: k = v = 0 and g = 0 leave the state as it is)
    q, k, v, g = (F.pad(t.float().transpose(1, 2), (0, 0, 0, pad)) for t in (q, k, v, g))
    beta = F.pad(beta.float().transpose(1, 2), (0, pad))
    documents = torch.cat([documents, documents[:, -1:].expand(batch, pad)], 1)
    n = (seq + pad) // chunk
    q, k, v, g = (t.reshape(batch, heads, n, chunk, -1) for t in (q, k, v, g))
    beta = beta.reshape(batch, heads, n, chunk)
    docs = documents.reshape(batch, 1, n, chunk)
    # The state before each chunk belongs to the document of the position before it.
    before = torch.cat([docs[:, :, :1, :1], docs[:, :, :-1, -1:]], 2)  # [batch, 1, n, 1]

    decay = g.cumsum(-2)  # log of the gates' product from the chunk's start to each position [.., chunk, 1 or dk]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    within = causal & (docs[..., :, None] == docs[..., None, :])  # j <= i, one document
    # the incoming state's decay at each position
    carried = torch.where((docs == before)[..., None], decay.exp(), 0.0)
    # The corrections u_i = b_i (v_i - k_i^T S before i) solve (I + L) U = b V - b carried K S_0,
    # L strictly lower: L_ij = b_i k_i^T diag(decay_i - decay_j) k_j.
    kb = k * beta[..., None]
    lower = decayed_products(kb, k, decay, within.tril(-1))
    system = lower + torch.eye(chunk, device=q.device)
    values = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    keys = torch.linalg.solve_triangular(system, kb * carried, upper=False, unitriangular=True)
    scores = decayed_products(q, k, decay, within)
    last = docs[..., -1:]  # the document the state leaves each chunk in
    # each position's decay to the end; S_0's
    to_end = torch.where((docs == last)[..., None], (decay[..., -1:, :] - decay).exp(), 0.0)
    through = torch.where(last == before, decay[..., -1, :].exp(), 0.0)[..., None]  # [.., n, 1 or dk, 1]
    state = q.new_zeros(batch, heads, dk, v.shape[-1]) if state is None else state.float()
    outputs = []
    for i in range(n):
        u = values[:, :, i] - keys[:, :, i] @ state
        outputs.append((q[:, :, i] * carried[:, :, i]) @ state + scores[:, :, i] @ u)
        state = state * through[:, :, i] + (k[:, :, i] * to_end[:, :, i]).transpose(-1, -2) @ u
    out = torch.stack(outputs, 2).reshape(batch, heads, n * chunk, -1)[:, :, :seq]
    return out.transpose(1, 2), state


def decayed_products(a: torch.Tensor, b: torch.Tensor, decay: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    """sum_c a_ic b_jc exp(decay_ic - decay_jc) for the pairs j <= i that `pairs` [.., chunk, chunk]
    holds (0 elsewhere), of a and b [.., chunk, width] and decay [.., chunk, 1 or width], which
    falls (never rises) along the chunk: every exponential is of a difference <= 0. With one
    channel, the pairwise factor of a @ b^T; per channel, `channel_products`, recomputed in
    backward from its inputs: what it would keep ([block, block, width] per position) measured
    74 x key dim fp32 values a head and token, 1.2 MB a token in each of Kimi-Linear-48B's linear
    blocks (compiled, the partitioner decides)."""
    if decay.shape[-1] == 1:
        gap = (decay[..., :, None, 0] - decay[..., None, :, 0]).masked_fill(~pairs, float("-inf"))
        return a @ b.transpose(-1, -2) * gap.exp()
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():
        return checkpoint(channel_products, a, b, decay, pairs, use_reentrant=False)
    return channel_products(a, b, decay, pairs)


def channel_products(a: torch.Tensor, b: torch.Tensor, decay: torch.Tensor, pairs: torch.Tensor,
                     block: int = 16) -> torch.Tensor:
    """`decayed_products` with a decay per channel: the chunk cut in blocks of `block`, a block's
    pairs with earlier positions as a matmul of a and b each decayed to the block's first position,
    its pairs within it summed over [block, block, width] (flash-linear-attention's split)."""
    chunk = a.shape[-2]
    block = next(size for size in range(min(block, chunk), 0, -1) if chunk % size == 0)
    blocks = chunk // block

    def cut(t: torch.Tensor) -> torch.Tensor:  # [.., chunk, width] -> [.., blocks, block, width]
        return t.unflatten(-2, (blocks, block))

    first = cut(decay)[..., :1, :]  # [.., blocks, 1, width]: each block's first position's
    ahead = (cut(decay) - first).exp()  # <= 1: decay from the block's start
    # b_j from j to each block's start, for j before the block (else -inf: an exponent that would rise)
    earlier = torch.arange(chunk, device=a.device) < torch.arange(0, chunk, block, device=a.device)[:, None]
    back = (first - decay[..., None, :, :]).masked_fill(~earlier[..., None], float("-inf")).exp()
    # [.., blocks, block, chunk]: 0 at and after each block's first position
    products = (cut(a) * ahead) @ (b[..., None, :, :] * back).transpose(-1, -2)
    diagonal = cut(decay)[..., :, None, :] - cut(decay)[..., None, :, :]  # [.., blocks, block, block, width]
    near = torch.ones(block, block, dtype=torch.bool, device=a.device).tril()
    inside = (cut(a)[..., :, None, :] * cut(b)[..., None, :, :] *
              diagonal.masked_fill(~near[..., None], float("-inf")).exp()).sum(-1)
    on_diagonal = torch.eye(blocks, device=a.device)[:, None, :, None]  # [blocks, 1, blocks, 1]
    products = products.unflatten(-1, (blocks, block)) + on_diagonal * inside[..., :, :, None, :]
    return torch.where(pairs, products.flatten(-2).flatten(-3, -2), 0.0)


def l2_normalized(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum x^2 + 1e-6) over the last dimension, in fp32 (flash-linear-attention's form)."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output, times its gate: weight x x / rms(x) x silu(z), as
    transformers' Qwen3-Next rounds it (the norm in fp32, back to the input dtype before the gain);
    `sigmoid`: weight x x / rms(x) x sigmoid(z), all in fp32 (Kimi Delta Attention's). One weight
    shared by every head (tensor parallelism's `gain` reads it whole on each rank)."""

    def __init__(self, dim: int, eps: float, sigmoid: bool = False):
        super().__init__()
        self.eps, self.sigmoid = eps, sigmoid
        self.weight = nn.Parameter(torch.ones(dim))

    def gain(self) -> torch.Tensor:
        return self.weight

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        if self.sigmoid:
            return (self.gain().float() * normed * torch.sigmoid(gate.float())).to(x.dtype)
        return (self.gain() * normed.to(x.dtype) * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """The token mixer of a linear block: q, k, v (each through the causal convolution and SiLU),
    the output gate z, the step b and the gate a from the block's input; q and k L2-normalised;
    the gated delta rule; each head's output normed and gated by z; the output projection.

    Kimi Delta Attention (`linear_channel_gates`): the gate a per key channel (a head's rate e^A_log
    times softplus of a dt per channel), a and z each from a key-dim-wide bottleneck (wa_down,
    wz_down), z through a sigmoid.

    Separate projections (transformers' Qwen3-Next fuses q/k/v/z and b/a, interleaved by key
    head): tensor parallelism splits each by heads column-wise, and the convolution's weights,
    A_log and dt_bias with them (their `local` is the rank's share); the bottlenecks are whole on
    each rank."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        heads = args.linear_value_heads
        self.key_dim, self.value_dim = args.linear_key_dim, args.linear_value_dim
        keys, values = args.linear_key_heads * self.key_dim, heads * self.value_dim
        self.wq = nn.Linear(args.dim, keys, bias=False)
        self.wk = nn.Linear(args.dim, keys, bias=False)
        self.wv = nn.Linear(args.dim, values, bias=False)
        self.channel_gates = args.linear_channel_gates
        if self.channel_gates:  # (Kimi's f_a/f_b and g_a/g_b)
            self.wa_down = nn.Linear(args.dim, self.key_dim, bias=False)
            self.wz_down = nn.Linear(args.dim, self.key_dim, bias=False)
        gate_input = self.key_dim if self.channel_gates else args.dim
        self.wz = nn.Linear(gate_input, values, bias=False)
        self.wb = nn.Linear(args.dim, heads, bias=False)
        self.wa = nn.Linear(gate_input, keys if self.channel_gates else heads, bias=False)
        self.conv_q = nn.Parameter(torch.empty(keys, args.linear_conv))
        self.conv_k = nn.Parameter(torch.empty(keys, args.linear_conv))
        self.conv_v = nn.Parameter(torch.empty(values, args.linear_conv))
        self.A_log = nn.Parameter(torch.empty(heads))  # the gate's rate per head: g = -e^A_log x dt
        self.dt_bias = nn.Parameter(torch.ones(keys if self.channel_gates else heads))
        self.out_norm = GatedRMSNorm(self.value_dim, args.linear_norm_eps or args.norm_eps, sigmoid=self.channel_gates)
        self.wo = nn.Linear(values, args.dim, bias=False)
        self.chunk = args.linear_chunk
        self.step_scale = 2.0 if args.linear_negative_eigenvalues else 1.0

    def local(self, name: str) -> torch.Tensor:
        """The parameter `name` as this rank computes with it (tensor parallelism hands its share)."""
        return getattr(self, name)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask=None, cache=None) -> torch.Tensor:
        """`rope`: unused (the blocks share one signature); `mask`: None (one sequence), the
        document id of each position [batch, seq], or a dict that holds them ("documents");
        `cache` (generation): the state and the convolutions' windows, per layer (plait/models/
        attention.py's KVCache)."""
        batch, seq, _ = x.shape
        documents = mask.get("documents") if isinstance(mask, dict) else mask  # (FlexAttention's: BlockMasks too)
        beta = torch.sigmoid(self.wb(x)) * self.step_scale
        rate = self.local("A_log").float().exp()
        if self.channel_gates:  # [batch, seq, heads, key dim]: each head's rate times each channel's dt
            dt = F.softplus(self.wa(self.wa_down(x)).float() + self.local("dt_bias"))
            g = -rate[:, None] * dt.view(batch, seq, -1, self.key_dim)
        else:  # [batch, seq, heads]
            g = -rate * F.softplus(self.wa(x).float() + self.local("dt_bias"))
        out = self.mix([self.wq(x), self.wk(x), self.wv(x)], g, beta, documents, cache)
        z = self.wz(self.wz_down(x) if self.channel_gates else x).view(batch, seq, -1, self.value_dim)
        out = self.out_norm(out.to(x.dtype), z)
        return self.wo(out.reshape(batch, seq, -1))


    def mix(self, qkv: list[torch.Tensor], g: torch.Tensor, beta: torch.Tensor, documents: torch.Tensor | None,
            cache=None) -> torch.Tensor:
        """The token mixing of the positions this call holds: the convolutions of q, k and v's
        projections, their heads, the rule. (Context parallelism replaces it with one that takes
        each chunk's convolution window and state from the ranks before it: plait/parallel/
        context_parallel.py.)"""
        held = cache.layers.get(self) if cache is not None else None
        windows = held[0] if held is not None else (None, None, None)
        convolved = [causal_conv(t, self.local(f"conv_{name}"), documents, window)
                     for t, name, window in zip(qkv, "qkv", windows)]
        out, state = gated_delta_rule(*self.heads(*convolved), g, beta, documents,
                                      held[1] if held is not None else None, self.chunk)
        if cache is not None:
            taps = self.conv_q.shape[1]
            # (each convolution's last taps - 1 inputs: the window the next position reads)
            kept = [(torch.cat([w, t], 1) if w is not None else F.pad(t, (0, 0, taps - 1, 0)))[:, -(taps - 1):]
                    for w, t in zip(windows, qkv)]
            cache.layers[self] = (kept, state)
        return out

    def heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The convolutions' outputs [batch, seq, width] as heads: q and k L2-normalised (q scaled
        by 1/sqrt(key dim)) and repeated to the value heads they serve."""
        batch, seq, _ = q.shape
        # (-1 for the head counts: under tensor parallelism each rank holds a slice of heads)
        q, k = (l2_normalized(t.view(batch, seq, -1, self.key_dim)) for t in (q, k))
        v = v.view(batch, seq, -1, self.value_dim)
        if v.shape[2] != q.shape[2]:  # each key head serves heads / key heads consecutive value heads
            q, k = (t.repeat_interleave(v.shape[2] // t.shape[2], dim=2) for t in (q, k))
        return q * self.key_dim ** -0.5, k, v


def conv_init_std(args: ModelArgs) -> float:
    """The convolution's init: the std of PyTorch's default for a Conv1d of linear_conv taps per
    channel (uniform within +-1/sqrt(taps))."""
    return 1 / math.sqrt(3 * args.linear_conv)
