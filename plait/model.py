"""Llama 3 and its close relatives in plain PyTorch: RMSNorm, RoPE (with llama3/linear scaling),
grouped-query attention, SwiGLU, an optionally tied output layer, and a KV cache for generation.

The relatives differ from Llama by a few switches of one model, not by copies of it: biases
(Qwen2's q/k/v, Llama's and OLMo 2's `attention_bias`, `mlp_bias`), RMSNorm on queries and keys
(per head as Qwen3, over the whole projection as OLMo 2), norms after each sub-layer instead of
before it (OLMo 2) and blocks without RoPE (SmolLM3).

No parallelism lives here; plait/parallel applies it from outside. Parameter names follow
Meta's reference (tok_embeddings, layers.N.attention.wq, ..., output) so plans and checkpoints
can address them, and RoPE rotates interleaved pairs as Meta's reference does.
"""

from __future__ import annotations

import functools
import hashlib
import math
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from plait.masking import additive
from plait.moe import MoE, moe_layers
from plait.shapes import FLAVORS, ModelArgs, model_args  # noqa: F401 (the model's interface)


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


@functools.cache
def flex_kernel(compiled: bool):
    """FlexAttention, compiled where it trains (CUDA: a fused kernel; eager it materialises the
    scores), eager elsewhere (CPU forward, as the tests compare it)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention) if compiled else flex_attention


QUERY_BLOCK = 512  # query rows per SDPA call under a mask


class ScaledDotProduct(nn.Module):
    """softmax(q k^T / sqrt(d)) v over q, k, v [batch, heads, seq, head_dim], k and v with the
    key/value heads (grouped-query attention, which SDPA's `enable_gqa` computes without a
    repeated copy of k and v: 20% less time forward + backward than repeating them). `mask`:
    None = causal over the sequence, SDPA's causal path; a mask tensor: `masked_attention`; a
    BlockMask: FlexAttention. `queries`: where this rank's query rows lie in the sequence, as
    (first index, length) runs (default: the last q.shape[2] keys' positions, one run). A module
    of its own so context parallelism can hand it the whole sequence's keys and values, and its
    queries' runs (a forward pre-hook), without touching the model."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None,
                queries: tuple[tuple[int, int], ...] = ()) -> torch.Tensor:
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        if isinstance(mask, torch.Tensor):
            return masked_attention(q, k, v, mask, queries or ((k.shape[2] - q.shape[2], q.shape[2]),))
        return flex_kernel(q.is_cuda)(q, k, v, block_mask=mask, enable_gqa=True)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     queries: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """SDPA under a mask that is causal within (the document mask, or cp's causal rows): each
    block of QUERY_BLOCK query rows attends over the keys up to its last row only. SDPA's causal
    path skips the blocks above the diagonal, but under a mask it computes every block and
    discards the masked ones: at seq 8192 that doubled attention's work. `enable_gqa` keeps k and
    v unrepeated (saved so for backward; on a 2-core CPU at seq 2048 also 3x faster than
    repeating them under a mask). Block outputs are joined in the [batch, seq, heads, head_dim]
    layout SDPA writes, so the join is the one copy the output projection reads (no transpose
    copy after it)."""
    outputs, row = [], 0
    for start, length in queries:
        for offset in range(0, length, QUERY_BLOCK):
            rows = slice(row + offset, row + min(offset + QUERY_BLOCK, length))
            end = start + rows.stop - row  # one past this block's last query: the keys it may see
            out = F.scaled_dot_product_attention(q[:, :, rows], k[:, :, :end], v[:, :, :end],
                                                 attn_mask=mask[..., rows, :end], enable_gqa=True)
            outputs.append(out.transpose(1, 2))
        row += length
    return (torch.cat(outputs, dim=1) if len(outputs) > 1 else outputs[0]).transpose(1, 2)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, rope: bool = True):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=args.qkv_bias)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=args.out_bias)
        self.qk_norm, self.rope = args.qk_norm, rope
        if args.qk_norm == "head":  # one weight of head_dim, shared by every head
            self.q_norm, self.k_norm = RMSNorm(args.head_dim, args.norm_eps), RMSNorm(args.head_dim, args.norm_eps)
        elif args.qk_norm == "projection":  # a weight per entry of the projection (split with the heads under TP)
            self.q_proj_norm = ProjectionNorm(args.n_heads * args.head_dim, args.norm_eps)
            self.k_proj_norm = ProjectionNorm(args.n_kv_heads * args.head_dim, args.norm_eps)
        self.core = ScaledDotProduct()

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask=None, cache: KVCache | None = None) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 instead of the head counts: under tensor parallelism each rank holds a slice of heads.
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        if self.qk_norm == "projection":
            q, k = self.q_proj_norm(q), self.k_proj_norm(k)
        q, k, v = (t.view(batch, seq, -1, self.head_dim) for t in (q, k, v))
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope:
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        if cache is not None:  # generation: attend to every earlier position's keys and values too
            k, v = cache.extend(self, k, v)
            # Causal within the new positions; every cached one lies before them all.
            mask = torch.ones(seq, k.shape[1], dtype=torch.bool, device=x.device).tril(k.shape[1] - seq)
        out = self.core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class KVCache:
    """Keys and values of the positions seen so far, per attention layer, for generation."""

    def __init__(self):
        self.layers: dict[Attention, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def length(self) -> int:
        return next(iter(self.layers.values()))[0].shape[1] if self.layers else 0

    def extend(self, layer: Attention, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layer in self.layers:
            k, v = (torch.cat([old, new], dim=1) for old, new in zip(self.layers[layer], (k, v)))
        self.layers[layer] = (k, v)
        return k, v


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_hidden, bias=args.ffn_bias)
        self.w2 = nn.Linear(args.ffn_hidden, args.dim, bias=args.ffn_bias)
        self.w3 = nn.Linear(args.dim, args.ffn_hidden, bias=args.ffn_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, index: int):
        super().__init__()
        self.post_norm = args.post_norm
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args, rope=index not in args.nope_layers)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = MoE(args.dim, args) if args.sparse(index) else FeedForward(args)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask=None, cache: KVCache | None = None) -> torch.Tensor:
        # (mask and cache by keyword: tensor parallelism's input plan covers the positional inputs)
        if self.post_norm:
            x = x + self.attention_norm(self.attention(x, rope, mask=mask, cache=cache))
            return x + self.ffn_norm(self.feed_forward(x))
        x = x + self.attention(self.attention_norm(x), rope, mask=mask, cache=cache)
        return x + self.feed_forward(self.ffn_norm(x))


class TiedOutput(nn.Module):
    """The output layer of a tied model: logits = x @ embedding matrix^T. It owns no parameter:
    the embedding owns the one matrix, so every wrapper (sharding, initialisation, checkpoints)
    meets it once, and both uses' gradients reach it through autograd."""

    def __init__(self, embedding: nn.Embedding):
        super().__init__()
        self.embedding = [embedding]  # in a list: not a submodule, so the matrix is not registered twice

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.embedding[0].weight)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # A ModuleDict keeps FQNs stable ("layers.3") when pipeline stages drop some layers.
        # Stages also drop the embedding (all but the first) and norm + output (all but the last).
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args, i) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = TiedOutput(self.tok_embeddings) if args.tie_embeddings else \
            nn.Linear(args.dim, args.vocab_size, bias=False)
        self.register_buffer("rope", torch.empty(0), persistent=False)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """(Re)compute the RoPE table: after `to_empty` a non-persistent buffer holds garbage."""
        device = next(self.parameters()).device
        a = self.args
        self.rope = rope_table(a.head_dim, a.max_seq_len, a.rope_theta, a.rope_scaling).to(device)
        for moe in moe_layers(self):  # (a checkpoint's router biases are loaded after this)
            if moe.router.bias is not None:
                moe.router.bias.zero_()

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None, positions: torch.Tensor | None = None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """`positions` [batch, seq]: each token's RoPE position (None: 0, 1, ... after the cache);
        `mask` (plait/masking.py): which keys each query sees, None = causal over the sequence."""
        # A pipeline stage lacks some parts: what it lacks, the activations pass through.
        x = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        start = cache.length if cache is not None else 0
        rope = self.rope[positions] if positions is not None else self.rope[start:]
        if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:
            # Once for every layer, in the dtype q has (autocast's, else the activations'), so
            # SDPA neither converts nor saves a copy per layer.
            autocast = torch.is_autocast_enabled(x.device.type)
            mask = additive(mask, torch.get_autocast_dtype(x.device.type) if autocast else x.dtype)
        for layer in self.layers.values():
            x = layer(x, rope, mask=mask, cache=cache)
        return self.output(self.norm(x)) if self.output is not None else x

    def init_std(self, name: str) -> float | None:
        """Init scale of parameter `name`: None = ones (norms), 0 = zeros (biases), else a
        truncated normal's std.

        Residual-branch outputs (wo, w2) shrink with depth as in torchtitan, so the residual
        stream keeps its scale at init however deep the model is.
        """
        if name.endswith("norm.weight"):
            return None
        if name.endswith(".bias"):
            return 0.0
        if name == "tok_embeddings.weight":  # tied, it is the output layer's too: that scale
            return self.args.dim ** -0.5 if self.args.tie_embeddings else 1.0
        if name == "output.weight":
            return self.args.dim ** -0.5
        if name.endswith(("wo.weight", "w2.weight", "experts.w2")):
            return 0.02 / math.sqrt(2 * self.args.n_layers)
        return 0.02


def initial_value(model: Transformer, name: str, shape: torch.Size, seed: int) -> torch.Tensor:
    """The full fp32 initial value of one parameter, from (seed, name) alone, on the CPU.

    Keying the random stream on the name makes the init independent of layout, rank count
    and construction order: every layout slices its shard out of the same full tensor.
    """
    std = model.init_std(name)
    if std is None:
        return torch.ones(shape)
    if std == 0:
        return torch.zeros(shape)
    key = int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") >> 1
    value = torch.empty(shape)
    return nn.init.trunc_normal_(value, std=std, a=-3 * std, b=3 * std, generator=torch.Generator().manual_seed(key))


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss, computed in float32 whatever the logits' dtype."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def num_params(model: nn.Module, exclude_embedding: bool = False, active: bool = False) -> int:
    """Parameters of the model; `active`: those one token uses (top_k of each MoE layer's experts)."""
    total = sum(p.numel() for p in model.parameters())
    if exclude_embedding:
        total -= model.tok_embeddings.weight.numel()
    if active:
        for moe in moe_layers(model):
            idle = 1 - moe.router.top_k / moe.n_experts
            total -= round(idle * sum(p.numel() for p in moe.experts.parameters()))
    return total


def flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Training FLOPs per token: 6 per non-embedding parameter a token uses (of a mixture of
    experts, its top_k experts) plus attention scores.

    Attention counts the full (not causal) seq x seq products, 12 * layers * dim * seq, the
    convention of the PaLM paper and torchtitan, so MFU numbers are comparable with theirs.
    """
    with torch.device("meta"):
        n = num_params(Transformer(args), exclude_embedding=True, active=True)
    tied_output = args.vocab_size * args.dim if args.tie_embeddings else 0  # a matmul, though no parameter of its own
    return 6 * (n + tied_output) + 12 * args.n_layers * args.dim * seq_len


def linear_weight_shapes(args: ModelArgs) -> list[tuple[int, int]]:
    """The distinct (out, in) weight shapes of the model's linear layers: what its matmuls multiply."""
    with torch.device("meta"):
        model = Transformer(args)
    shapes = {tuple(m.weight.shape) for m in model.modules() if isinstance(m, nn.Linear)}
    return sorted(shapes | ({(args.vocab_size, args.dim)} if args.tie_embeddings else set()))
