"""The transformer: embedding, blocks of attention and a feed-forward layer (dense SwiGLU, or a
mixture of experts where the flavor says so), a final norm and the output layer (optionally tied
to the embedding); its init, loss and FLOP counts.

Parameter names follow Meta's reference (tok_embeddings, layers.N.attention.wq, ..., output) so
parallelism plans and checkpoints can address them.
"""

from __future__ import annotations

import functools
import hashlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from plait.models.attention import Attention, KVCache
from plait.models.args import ModelArgs
from plait.models.latent_attention import LatentAttention
from plait.models.linear_attention import GatedDeltaNet, conv_init_std
from plait.models.loss import OutputLoss, whole_logits_loss
from plait.models.mlp import FeedForward
from plait.models.moe import EXPERT_BIASES, AuxLoss, MoE, in_backward, moe_layers
from plait.models.norms import model_norm
from plait.models.rope import rope_table


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, index: int):
        super().__init__()
        # (a linear block norms its inputs whatever the attention blocks do: OLMo hybrid's)
        self.post_norm, self.sandwich_norm = args.post_norm and not args.linear(index), args.sandwich_norm
        self.attention_norm = model_norm(args.dim, args)
        self.attention = GatedDeltaNet(args) if args.linear(index) else \
            LatentAttention(args, args.window(index), rope=index not in args.nope_layers) if args.kv_lora_rank else \
            Attention(args, rope=index not in args.nope_layers, window=args.window(index), chunk=args.chunk(index))
        self.ffn_norm = model_norm(args.dim, args)
        self.feed_forward = MoE(args.dim, args) if args.sparse(index) else FeedForward(args)
        if args.sandwich_norm:  # (ffn_norm is then the norm before the feed-forward layer)
            self.post_attention_norm, self.post_ffn_norm = model_norm(args.dim, args), model_norm(args.dim, args)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask=None, cache: KVCache | None = None) -> torch.Tensor:
        # (mask and cache by keyword: tensor parallelism's input plan covers the positional inputs)
        if self.post_norm:
            x = x + self.attention_norm(self.attention(x, rope, mask=mask, cache=cache))
            return x + self.ffn_norm(self.feed_forward(x))
        if self.sandwich_norm:
            x = x + self.post_attention_norm(self.attention(self.attention_norm(x), rope, mask=mask, cache=cache))
            return x + self.post_ffn_norm(self.feed_forward(self.ffn_norm(x)))
        x = x + self.attention(self.attention_norm(x), rope, mask=mask, cache=cache)
        return x + self.feed_forward(self.ffn_norm(x))


class TokenPredictor(nn.Module):
    """DeepSeek-V3's multi-token prediction module (GLM-4.5's, Qwen3-Next's and Qwen3.5's too): from
    the model's output h_i after its final norm and the embedding of token t+1 it predicts token
    t+2 through one more block (`index`: its place after the model's), the model's own embedding
    and output layer (shared, not copied): block(eh_proj([enorm(embedding); hnorm(h)])), then
    `norm` before the output layer. (h after the final norm: as vLLM, SGLang and Megatron-Core
    hand it over, the checkpoints' modules trained on it.)"""

    def __init__(self, args: ModelArgs, index: int):
        super().__init__()
        self.enorm, self.hnorm = model_norm(args.dim, args), model_norm(args.dim, args)
        self.eh_proj = nn.Linear(2 * args.dim, args.dim, bias=False)
        self.block = TransformerBlock(args, index)
        self.norm = model_norm(args.dim, args)

    def forward(self, h: torch.Tensor, embedded: torch.Tensor, rope: torch.Tensor, mask=None) -> torch.Tensor:
        return self.block(self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(h)], -1)), rope, mask=mask)


class TiedOutput(nn.Module):
    """The output layer of a tied model: logits = x @ embedding matrix^T. It owns no parameter:
    the embedding owns the one matrix, so every wrapper (sharding, initialisation, checkpoints)
    meets it once, and both uses' gradients reach it through autograd."""

    def __init__(self, embedding: nn.Embedding):
        super().__init__()
        self.embedding = [embedding]  # in a list: not a submodule, so the matrix is not registered twice

    @property
    def weight(self) -> torch.Tensor:
        return self.embedding[0].weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # A ModuleDict keeps FQNs stable ("layers.3") when pipeline stages drop some layers.
        # Stages also drop the embedding (all but the first) and norm + output (all but the last).
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args, i) for i in range(args.n_layers)})
        self.norm = model_norm(args.dim, args)
        self.output = TiedOutput(self.tok_embeddings) if args.tie_embeddings else \
            nn.Linear(args.dim, args.vocab_size, bias=False)
        self.loss = OutputLoss()  # (the trainer sets its chunk: training.loss_chunk)
        # Training only (generation and evaluation forward without `next_tokens`); its losses, each
        # forward's, are added to the gradient (scale: mtp_scale, which the trainer sets) and
        # recorded for the step's metric.
        self.mtp = nn.ModuleDict({str(k): TokenPredictor(args, args.n_layers + k) for k in range(args.mtp_layers)})
        self.mtp_scale, self.mtp_records = 0.0, []
        self.register_buffer("rope", torch.empty(0), persistent=False)
        self.register_buffer("local_rope", torch.empty(0), persistent=False)  # (the sliding blocks' own, if any)
        self.register_buffer("temperature", torch.empty(0), persistent=False)  # (Llama 4's, if any)
        self.reset_buffers()

    def blocks(self) -> list[TransformerBlock]:
        """Every block: the model's, then its MTP modules' (each block is a unit of its own to
        sharding, compilation and context parallelism's hooks)."""
        return [*self.layers.values(), *(predictor.block for predictor in self.mtp.values())]

    def reset_buffers(self) -> None:
        """(Re)compute the RoPE tables: after `to_empty` a non-persistent buffer holds garbage. (On the
        buffers' device: with the optimizer offloaded the parameters' shards live on the host.)"""
        device = self.rope.device
        a = self.args
        self.rope = rope_table(a.rope_dim, a.max_seq_len, a.rope_theta, a.rope_scaling).to(device)
        if a.local_rope_theta:
            self.local_rope = rope_table(a.rope_dim, a.max_seq_len, a.local_rope_theta, a.local_rope_scaling).to(device)
        if a.nope_temperature:  # (as transformers' Llama 4 computes it, in fp32)
            steps = torch.floor((torch.arange(a.max_seq_len, dtype=torch.float32) + 1.0) / a.temperature_floor)
            self.temperature = (torch.log1p(steps) * a.nope_temperature + 1.0).to(device)
        for moe in moe_layers(self):  # (a checkpoint's router biases are loaded after this)
            if moe.router.bias is not None:
                moe.router.bias.zero_()

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None, positions: torch.Tensor | None = None,
                mask=None, next_tokens: tuple[torch.Tensor, torch.Tensor] | None = None,
                labels: torch.Tensor | None = None, per_token: bool = False) -> torch.Tensor:
        """`positions` [batch, seq]: each token's RoPE position (None: 0, 1, ... after the cache);
        `mask` (plait/models/masking.py): which keys each query sees: None = causal over the
        sequence; the document id of each key [batch, seq]; or FlexAttention's BlockMasks by (window,
        chunk) with the document ids ("documents": linear attention's). `next_tokens`: (token t+1, token
        t+2) at each position (-100: none), for multi-token prediction's loss. `labels`: return
        the mean next-token loss over the labels not -100 instead of the logits (`per_token`: each
        token's, 0 where -100, without gradient)."""
        # A pipeline stage lacks some parts: what it lacks, the activations pass through. A later
        # stage's input is the hidden state (the last may hold the embedding too: MTP's).
        x = tokens if tokens.is_floating_point() else self.embed(tokens)
        start = cache.length if cache is not None else 0
        rope = self.rope[positions] if positions is not None else self.rope[start:]
        tables = {"rope": rope}  # (each block's kind of table: RoPE's, the sliding blocks', Llama 4's temperature)
        for kind, table in (("local_rope", self.local_rope), ("temperature", self.temperature)):
            if table.numel():
                tables[kind] = table[positions] if positions is not None else table[start:]
        for name, layer in self.layers.items():
            x = layer(x, tables[self.args.block_table(int(name))], mask=mask, cache=cache)
        if next_tokens is not None and len(self.mtp) and torch.is_grad_enabled():
            x = self.predict_further(x, rope, mask, *next_tokens)
        if cache is not None:
            cache.advance(tokens.shape[1])
        if self.output is None:
            return x
        return self.output(self.norm(x)) if labels is None else \
            self.loss_of(self.norm(x), labels, per_token=per_token, z=True)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        # (Gemma: times sqrt(dim) in the embedding's dtype, as transformers rounds it)
        return x * torch.tensor(self.args.dim ** 0.5, dtype=x.dtype) if self.args.embed_scale else x

    def loss_of(self, hidden: torch.Tensor, labels: torch.Tensor, divisor: torch.Tensor | int | None = None,
                per_token: bool = False, z: bool = False) -> torch.Tensor:
        """The loss of final hidden states (after the norm): the mean over the labels not -100,
        or their sum / `divisor`; `z`: z-loss's gradient joined to it in training. With a loss
        chunk, chunk by chunk (plait/models/loss.py); without one, from the whole logits."""
        if self.loss.chunk:
            return self.loss(hidden, self.output.weight, labels, divisor, per_token, z)
        logits = self.output(hidden).flatten(0, 1).float()
        if per_token:
            return F.cross_entropy(logits, labels.flatten(), reduction="none").view(labels.shape)
        z_loss = self.loss.z_loss if z and torch.is_grad_enabled() else 0.0
        loss, term = whole_logits_loss(logits, labels.flatten(), divisor, z_loss)
        if term is not None:
            self.loss.record(term)
        return loss

    def predict_further(self, h: torch.Tensor, rope: torch.Tensor, mask, following: torch.Tensor,
                        targets: torch.Tensor) -> torch.Tensor:
        """h, with the MTP loss's gradient (times mtp_scale) joined to it in backward: the cross-
        entropy of token t+2 summed over the positions that have one and divided by all of them
        (so that the ranks of context parallelism, each a mean over its chunks, average to the
        sequence's loss)."""
        predictor = self.mtp["0"]
        out = predictor(self.norm(h), self.embed(following), rope, mask)
        loss = self.loss_of(predictor.norm(out), targets, divisor=targets.numel())
        if torch.compiler.is_compiling() or not in_backward():  # (once per step's forward, not in a recompute)
            self.mtp_records.append(loss.detach())
        return AuxLoss.apply(h, loss, self.mtp_scale)

    def init_std(self, name: str) -> float | None:
        """Init scale of parameter `name`: None = ones (norms), 0 = zeros (biases), else a
        truncated normal's std.

        Residual-branch outputs (wo, w2) shrink with depth as in torchtitan, so the residual
        stream keeps its scale at init however deep the model is.
        """
        if name.endswith("out_norm.weight"):  # linear attention's gated norm: a plain gain
            return None
        if name.endswith(("conv_q", "conv_k", "conv_v")):
            return conv_init_std(self.args)
        if name.endswith("dt_bias") and not self.args.linear_dt_init:  # (ones, as transformers' Qwen3-Next)
            return None
        if name.endswith("norm.weight"):  # (a zero-centred norm's weight is its offset from 1)
            return 0.0 if self.args.zero_centered_norms else None
        # (sinks from 0: at first a sink takes what one zero score would; experts' biases are b1, b2, b3)
        if name.endswith((".bias", ".sinks", *EXPERT_BIASES)):
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
    key = int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") >> 1
    generator = torch.Generator().manual_seed(key)
    if name.endswith("A_log"):  # linear attention's gate rates e^A_log, uniform per head (Mamba's)
        return torch.empty(shape).uniform_(*model.args.linear_a_init, generator=generator).log()
    if name.endswith("dt_bias") and model.args.linear_dt_init:  # softplus^-1 of a log-uniform dt (Mamba's)
        low, high, floor = model.args.linear_dt_init
        dt = (torch.rand(shape, generator=generator) * (math.log(high) - math.log(low)) + math.log(low)).exp()
        dt = dt.clamp(min=floor)
        return dt + torch.log(-torch.expm1(-dt))
    std = model.init_std(name)
    if std is None:
        return torch.ones(shape)
    if std == 0:
        return torch.zeros(shape)
    return nn.init.trunc_normal_(torch.empty(shape), std=std, a=-3 * std, b=3 * std, generator=generator)


def row_log_likelihoods(token_losses: torch.Tensor) -> torch.Tensor:
    """[batch] log-likelihood of each row's labelled tokens, summed in float64 from the float32
    losses per token (`model(..., labels=labels, per_token=True)`: 0 where a label is -100)."""
    return -token_losses.double().sum(-1)


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


@functools.cache  # (a meta model each time it is asked: every step's metrics ask it)
def flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Training FLOPs per token: 6 per non-embedding parameter a token uses (of a mixture of
    experts, its top_k experts) plus attention scores.

    Attention counts the full (not causal) seq x seq products, 12 * layers * dim * seq, the
    convention of the PaLM paper and torchtitan, so MFU numbers are comparable with theirs; a
    sliding block's queries each meet at most its window of keys: 12 * dim * min(seq, window) (a
    chunked block's, its chunk's).
    Under latent attention a head's scores and values are head_dim and v_head_dim wide: dim is
    then n_heads x their mean. A linear block's token mixing counts what its chunked form
    multiplies per token (`linear_mixing_flops`) in place of scores.
    """
    with torch.device("meta"):
        n = num_params(Transformer(args), exclude_embedding=True, active=True)
    # a matmul, though no parameter of its own: a tied output layer, and the output layer's use by each MTP module
    tied_output = args.vocab_size * args.dim * (args.tie_embeddings + args.mtp_layers)
    blocks = [block for block in range(args.n_layers + args.mtp_layers) if not args.linear(block)]
    keys = sum(min(seq_len, args.reach(block) or seq_len) for block in blocks)
    width = args.n_heads * (args.head_dim + args.v_head_dim) / 2 if args.kv_lora_rank else args.dim
    return 6 * (n + tied_output) + 12 * width * keys + len(args.linear_layers) * linear_mixing_flops(args)


def linear_mixing_flops(args: ModelArgs) -> float:
    """Training FLOPs per token of one linear block's gated delta rule (3x its forward's), per
    value head: within its chunk k.k and q.k (2 x chunk x key dim), the scores times the
    corrections (chunk x value dim), the triangular solve for values and keys (chunk/2 x both
    widths), and the state read twice and written once (3 x key dim x value dim); 2 FLOPs a
    multiply-add. A gate per key channel (Kimi Delta Attention) adds the products within blocks of
    16 positions, per key channel (a multiply, a decay and a sum), in k.k and q.k, computed again
    in backward: 4/3 of 3 x 16 x key dim."""
    dk, dv = args.linear_key_dim, args.linear_value_dim
    chunk = args.linear_chunk
    per_head = chunk * (2 * dk + dv) + chunk * (dk + dv) / 2 + 3 * dk * dv + args.linear_channel_gates * 64 * dk
    return 3 * 2 * args.linear_value_heads * per_head


def linear_weight_shapes(args: ModelArgs) -> list[tuple[int, int]]:
    """The distinct (out, in) weight shapes of the model's linear layers: what its matmuls multiply."""
    with torch.device("meta"):
        model = Transformer(args)
    shapes = {tuple(m.weight.shape) for m in model.modules() if isinstance(m, nn.Linear)}
    return sorted(shapes | ({(args.vocab_size, args.dim)} if args.tie_embeddings else set()))
