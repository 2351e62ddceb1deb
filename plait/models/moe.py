"""A mixture-of-experts feed-forward layer in plain PyTorch: a router picks k of E experts per
token, the experts run as grouped matmuls, and their outputs come back weighted.

- Router: softmax over the experts then the top k, renormalised (Qwen3-MoE, Mixtral), or a
  sigmoid per expert with a load-balancing bias that steers the choice but not the weights
  (DeepSeek-V3; its top k from the best groups of experts only, which bounds the nodes a token's
  experts lie on under expert parallelism), and optionally its sequence-wise auxiliary loss.
  Always in float32, the gate's matmul included: a bf16 score would flip near-tied choices. (Its operands are what the block holds: under bf16 param mode the
  gate's weight arrives cast as the block's others do, as in torchtitan and transformers.)
  Ties go to the lower expert index (a stable sort), so every layout that computes the same
  scores picks the same experts.
- Dropless: every token reaches its k experts (no capacity factor), so routing never depends on
  how tokens are split over ranks.
- Experts: E SwiGLUs stored as [E, ...] tensors, run by `torch._grouped_mm` over the tokens
  sorted by expert, in the compute dtype (gpt-oss's: with biases, and the clamped SwiGLU).
- Auxiliary load-balancing loss (Switch Transformer's E * sum_e f_e * P_e over the batch; for a
  sigmoid router DeepSeek-V3's, per sequence): added to the gradient in backward without
  touching the loss the model returns, so every schedule (accumulation, pipelines) carries it as
  it carries the loss (the trainer sets its scale).

No parallelism here: expert parallelism (plait/parallel/expert_parallel.py) replaces the experts'
forward with one that sends tokens to the ranks that hold their experts and calls `swiglu_experts`
with its local weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from plait.models.expert_matmul import expert_linear

EXPERT_BIASES = ("experts.b1", "experts.b2", "experts.b3")  # gpt-oss's [E, n]: biases, though 2-D


class Router(nn.Module):
    def __init__(self, dim: int, n_experts: int, top_k: int, kind: str, normalize: bool, scale: float,
                 gate_bias: bool = False, groups: int = 0, top_groups: int = 0, balance_bias: bool = True):
        super().__init__()
        self.top_k, self.kind, self.normalize, self.scale = top_k, kind, normalize, scale
        self.groups, self.top_groups = groups, top_groups
        self.gate = nn.Linear(dim, n_experts, bias=gate_bias)  # (a trained bias on the logits: gpt-oss)
        # sigmoid: added to the scores to choose experts only; moved after each step towards balance
        # (plait/expert_load.py). A buffer: saved with the model, not trained.
        self.register_buffer("bias", torch.zeros(n_experts) if kind == "sigmoid" and balance_bias else None)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [tokens, dim] -> (scores [tokens, E], chosen experts [tokens, k], their weights [tokens, k]), fp32."""
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.float(), self.gate.weight.float(), None if self.gate.bias is None else
                              self.gate.bias.float())
        scores = logits.softmax(-1) if self.kind == "softmax" else logits.sigmoid()
        choosing = scores if self.bias is None else scores + self.bias
        if self.groups > 1:  # only experts of the top_groups groups whose two best scores sum highest
            grouped = choosing.unflatten(-1, (self.groups, -1))
            best = grouped.topk(2, dim=-1).values.sum(-1).sort(dim=-1, descending=True, stable=True).indices
            kept = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(-1, best[:, :self.top_groups], True)
            choosing = grouped.masked_fill(~kept[..., None], float("-inf")).flatten(-2)
        experts = choosing.sort(dim=-1, descending=True, stable=True).indices[:, :self.top_k]
        weights = scores.gather(-1, experts)
        if self.normalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return scores, experts, weights * self.scale


def gated(gate: torch.Tensor, up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """SwiGLU's product: silu(gate) * up, or with a `limit` gpt-oss's clamped form."""
    if not limit:
        return F.silu(gate) * up
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return gate * torch.sigmoid(gate * alpha) * (up + 1)


def swiglu_experts(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                   w3: torch.Tensor, biases: tuple[torch.Tensor, ...] = (), limit: float = 0.0,
                   alpha: float = 1.702) -> torch.Tensor:
    """Each expert's SwiGLU on its rows of x [tokens sorted by expert, dim]: `counts` [E] rows per
    expert, weights [E, hidden, dim] (w1, w3) and [E, dim, hidden] (w2), local tensors; with
    `biases` (b1, b2, b3: [E, hidden], [E, dim], [E, hidden]) each row adds its expert's.
    Runs in x's dtype, or autocast's where it is on (grouped matmuls are not on autocast's lists)."""
    dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
    x, w1, w2, w3 = (t.to(dtype) for t in (x, w1, w2, w3))
    b1, b2, b3 = (b.to(dtype) for b in biases) if biases else (None, None, None)
    offsets = counts.cumsum(0, dtype=torch.int32)
    # (the output's size given: each row's expert without a host read of the counts)
    row_expert = torch.repeat_interleave(torch.arange(len(counts), device=x.device), counts,
                                         output_size=x.shape[0]) if biases else None

    def grouped(a: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        out = expert_linear(a, w, offsets)
        return out if b is None else out + b[row_expert]

    return grouped(gated(grouped(x, w1, b1), grouped(x, w3, b3), limit, alpha), w2, b2)


class GroupedExperts(nn.Module):
    def __init__(self, dim: int, hidden: int, n_experts: int, bias: bool = False, limit: float = 0.0,
                 alpha: float = 1.702):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))  # gate
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))  # down
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim))  # up
        if bias:  # (gpt-oss)
            self.b1, self.b2, self.b3 = (nn.Parameter(torch.empty(n_experts, n)) for n in (hidden, dim, hidden))
        self.limit, self.alpha = limit, alpha

    def biases(self) -> tuple[torch.Tensor, ...]:
        return (self.b1, self.b2, self.b3) if hasattr(self, "b1") else ()

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return swiglu_experts(x, counts, self.w1, self.w2, self.w3, self.biases(), self.limit, self.alpha)


class AuxLoss(torch.autograd.Function):
    """Returns `out` unchanged; in backward also sends `scale` as the gradient of `aux`: the
    gradient of loss + scale * aux, with the loss left as the model's."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.aux_gradient = torch.full_like(aux, scale)  # (aux's kind of tensor: a DTensor under loss parallelism)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, ctx.aux_gradient, None


def in_backward() -> bool:
    """True while autograd runs backward: a checkpointed block's forward is being recomputed
    (eagerly; a compiled block's recomputation does not re-run this Python)."""
    return torch._C._current_graph_task_id() != -1


class MoE(nn.Module):
    def __init__(self, dim: int, args):
        super().__init__()
        self.n_experts = args.n_experts
        self.router = Router(dim, args.n_experts, args.top_k, args.router, args.normalize_top_k, args.route_scale,
                             args.router_bias, args.n_groups, args.topk_groups, args.balance_bias)
        self.experts = GroupedExperts(dim, args.moe_hidden, args.n_experts, args.expert_bias, args.swiglu_limit,
                                      args.swiglu_alpha)
        self.shared = SharedExperts(dim, args.moe_hidden * args.n_shared_experts) if args.n_shared_experts else None
        # (Qwen3-Next: the shared expert's output times sigmoid of one projection of the token)
        self.shared_gate = nn.Linear(dim, 1, bias=False) if args.shared_expert_gate else None
        self.route_inputs = args.route_inputs
        self.aux_scale = 0.0  # set by the trainer: coefficient / (MoE layers x micro-batches)
        # How the ranks that each hold part of the same sequences sum a tensor (context parallelism
        # sets it), and how many they are: the auxiliary loss is then that of the whole sequences.
        self.sequence_sum, self.sequence_ranks = None, 1
        # (tokens per expert, auxiliary loss or None) of each training forward since the trainer
        # last read them (plait/expert_load.py; a pipeline drops its shape inference's: pipeline.py)
        self.records: list[tuple[torch.Tensor, torch.Tensor | None]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, k = x.shape, self.router.top_k
        x = x.reshape(-1, shape[-1])
        scores, experts, weights = self.router(x)
        flat = experts.flatten()
        # (not bincount: its output's size depends on the data, a graph break when compiled)
        counts = torch.zeros(self.n_experts, dtype=flat.dtype, device=flat.device).scatter_add_(
            0, flat, torch.ones_like(flat))
        order = flat.argsort(stable=True)  # (token, choice) pairs grouped by expert, tokens in order
        token = order // k
        if self.route_inputs:  # (Llama 4: each expert's input scaled, in the input's dtype)
            routed = self.experts(x[token] * weights.flatten()[order, None].to(x.dtype), counts)
        else:
            routed = self.experts(x[token], counts)
            routed = routed * weights.flatten()[order, None].to(routed.dtype)
        # Each token's outputs are added in ascending expert order (transformers' order too).
        out = torch.zeros(x.shape[0], routed.shape[-1], dtype=routed.dtype, device=x.device).index_add_(0, token, routed)
        if torch.is_grad_enabled():
            # The same ops in a checkpointed block's recomputation (its saved tensors must match),
            # but the step's record is kept once.
            aux = self.aux_loss(counts, scores) if self.router.kind == "softmax" else \
                self.sequence_aux_loss(experts, scores, shape[0]) if self.aux_scale else None
            if torch.compiler.is_compiling() or not in_backward():
                self.records.append((counts, None if aux is None else aux.detach()))
            if aux is not None and self.aux_scale:
                out = AuxLoss.apply(out, aux, self.aux_scale)
        if self.shared_gate is not None:
            out = out + torch.sigmoid(self.shared_gate(x)) * self.shared(x)
        elif self.shared is not None:
            out = out + self.shared(x)
        return out.view(shape)

    def aux_loss(self, counts: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """E x sum_e f_e P_e over the forward's tokens (f_e: the share of token-slots expert e got,
        P_e: its mean score; k when balanced). Where ranks split the sequences, f counts every
        rank's tokens and this rank's term sums its own tokens' scores: the ranks' terms add up to
        the whole sequences' loss, each with its own tokens' gradient."""
        tokens = scores.shape[0] * self.sequence_ranks
        if self.sequence_sum is not None:
            counts = self.sequence_sum(counts)
        return self.n_experts * (counts.float() / tokens * (scores.sum(0) / tokens)).sum()

    def sequence_aux_loss(self, experts: torch.Tensor, scores: torch.Tensor, sequences: int) -> torch.Tensor:
        """DeepSeek-V3's sequence-wise balance loss: the mean over sequences of sum_e f_e P_e, f_e
        = E / (k T) x the sequence's token-slots routed to e, P_e the mean over its T tokens of e's
        score normalised over the experts (1 when balanced). Where ranks split the sequences, f
        counts every rank's tokens and this rank's term sums its own tokens' scores, as `aux_loss`."""
        n, k = self.n_experts, self.router.top_k
        tokens = scores.shape[0] // sequences * self.sequence_ranks
        chosen = experts.reshape(sequences, -1)  # each sequence's tokens' k experts
        slots = torch.zeros(sequences, n, device=scores.device)
        slots.scatter_add_(1, chosen, torch.ones(chosen.shape, device=scores.device))
        if self.sequence_sum is not None:
            slots = self.sequence_sum(slots)
        shares = (scores / scores.sum(-1, keepdim=True)).view(sequences, -1, n).sum(1) / tokens
        return (slots * n / (k * tokens) * shares).sum(-1).mean()


class SharedExperts(nn.Module):
    """Experts every token goes through (DeepSeek-V3), as one SwiGLU."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]
