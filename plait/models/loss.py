"""The next-token loss computed with the output layer, chunk by chunk over tokens: neither the
batch's logits nor their gradient is ever held whole.

At 2026 vocabularies the logits are a step's largest activation (Qwen3's 151,936 entries per
token, gpt-oss's 201,088: 5-6.6 GB for one 8192-token sequence in fp32), and backward wants a
gradient as large. Here each chunk of `chunk` tokens computes its logits, its losses and, when a
gradient is wanted, at once the gradients of its hidden states and of the output matrix (the
logits' gradient is softmax - one-hot, known in forward); then the chunk's logits are freed.
Backward only scales what forward computed, so the output layer costs the three matmuls it
always did and recomputes nothing (the scheme of Liger-Kernel's fused linear cross-entropy).

Numerics are those of the whole-logits loss: logits in the compute dtype (autocast's or the
parameters'), upcast to fp32 for the softmax; the logits' gradient cast back to the compute dtype
for its two matmuls. The output matrix's gradient is summed over chunks in fp32 and rounded to the
matrix's dtype once, as one matmul over all tokens would round it.

Under tensor parallelism the output matrix is split on the vocabulary: each rank computes its
slice of every chunk's logits and its log-sum-exp; the ranks' log-sum-exps (by their max and the
sum of their exponentials) and the label's logit are reduced over the ranks (`VocabShard`, which
plait/parallel/tensor_parallel.py sets).

z-loss (PaLM's; training.z_loss): z x the mean of log-sum-exp^2 over the counted tokens, which keeps
the softmax's normaliser near 1 (logits from drifting up together). Its gradient joins the loss's
(d z lse^2 / d logits = 2 z lse softmax); the value returned stays the cross-entropy, so a run's
loss compares with a run's without it, and the term is recorded for its own metric (z_loss).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

IGNORE = -100  # a label that counts for nothing (F.cross_entropy's ignore_index)


def _whole(t: torch.Tensor, op: str) -> torch.Tensor:
    return t


@dataclass
class VocabShard:
    """The vocabulary this rank's output rows cover, from `start`; `reduce(t, "max" | "sum")`
    combines a per-token value over the ranks that hold the other rows (none: the whole)."""
    start: int = 0
    reduce: Callable[[torch.Tensor, str], torch.Tensor] = field(default=_whole)


def _chunk_losses(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, shard: VocabShard):
    """One chunk's logits (fp32), log-sum-exp, and loss per token (0 where ignored)."""
    logits = F.linear(hidden, weight)
    compute = logits.dtype
    logits = logits.float()
    local = labels - shard.start
    own = (local >= 0) & (local < logits.shape[-1])
    picked = logits.gather(-1, local.clamp(0, logits.shape[-1] - 1)[:, None]).squeeze(-1)
    picked = shard.reduce(torch.where(own, picked, 0.0), "sum")
    lse = torch.logsumexp(logits, -1)  # over this rank's vocabulary, then over the ranks' (exact for one)
    peak = shard.reduce(lse, "max")
    lse = peak + shard.reduce((lse - peak).exp(), "sum").log()
    return logits, compute, lse, torch.where(labels != IGNORE, lse - picked, 0.0), own, local


def chunk_gradient(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, shard: VocabShard,
                   divisor: torch.Tensor, z: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk's summed loss, its summed lse^2 over the counted tokens (z-loss's), and d loss / d
    logits = (softmax (1 + 2 z lse) - one-hot) / divisor on the counted tokens, computed in place of
    the logits and returned in the compute dtype. Compiled (`OutputLoss.compile_chunks`), the
    logits' upcast, log-sum-exp and gradient fuse into a few passes over the chunk's logits instead
    of about ten."""
    logits, compute, lse, losses, own, local = _chunk_losses(hidden, weight, labels, shard)
    counted = labels != IGNORE
    grad = logits.sub_(lse[:, None]).exp_()
    if z:
        grad.mul_(1 + 2 * z * lse[:, None])
    grad.scatter_add_(-1, local.clamp(0, grad.shape[-1] - 1)[:, None], -own[:, None].to(grad.dtype))
    grad.mul_(counted[:, None] / divisor)
    return losses.sum(), torch.where(counted, lse.square(), 0.0).sum(), grad.to(compute)


class LinearCrossEntropy(torch.autograd.Function):
    """sum(loss per token) / divisor, and the z-loss term z x sum(lse^2) / divisor (no gradient of
    its own: its gradient is joined to the loss's), the gradients computed in forward chunk by chunk
    (`kernel`: `chunk_gradient`, or it compiled)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, divisor: torch.Tensor | int,
                chunk: int, shard: VocabShard, z: float, kernel: Callable) -> tuple[torch.Tensor, torch.Tensor]:
        total, squares = torch.zeros((), device=hidden.device), torch.zeros((), device=hidden.device)
        divisor = torch.as_tensor(divisor, device=hidden.device)  # (a tensor: a compiled kernel guards no value)
        grad_hidden = torch.empty_like(hidden)
        grad_weight = None
        for start in range(0, len(hidden), chunk):
            h = hidden[start:start + chunk]
            chunk_loss, chunk_squares, grad = kernel(h, weight, labels[start:start + chunk], shard, divisor, z)
            total += chunk_loss
            squares += chunk_squares
            grad_hidden[start:start + chunk] = grad @ weight
            if grad_weight is None:
                grad_weight = (grad.t() @ h).float()
            elif grad.dtype == h.dtype == torch.float32:
                grad_weight.addmm_(grad.t(), h)  # in place: no [vocabulary, dim] temporary
            else:
                grad_weight += grad.t() @ h  # a product in the compute dtype, summed in fp32
        ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype))
        z_term = z * squares / divisor
        ctx.mark_non_differentiable(z_term)
        return total / divisor, z_term

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor, _grad_z: torch.Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        # Not in place: the zero-bubble schedules run this backward twice (inputs', then weights').
        return grad_hidden * grad_loss, grad_weight * grad_loss, None, None, None, None, None, None


def whole_logits_loss(logits: torch.Tensor, labels: torch.Tensor, divisor: torch.Tensor | int | None, z: float
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The loss from the whole logits (fp32, [tokens, vocabulary]), as OutputLoss.forward's, and
    the z-loss term (None without z) joined to its gradient: loss + (term - term) is the loss's
    value exactly, with the term's gradient."""
    if divisor is None:
        loss = F.cross_entropy(logits, labels)
    else:
        loss = F.cross_entropy(logits, labels, reduction="sum") / divisor
    if not z:
        return loss, None
    counted = labels != IGNORE
    squares = torch.where(counted, torch.logsumexp(logits, -1).square(), 0.0).sum()
    term = z * squares / (counted.sum() if divisor is None else divisor)
    return loss + (term - term.detach()), term.detach()


class OutputLoss(nn.Module):
    """The model's loss from its final hidden states and output matrix (no parameter of its own:
    the matrix is the output layer's, or the embedding's when tied). `chunk` tokens at a time; 0
    means the model computes the whole logits instead (Transformer.forward). `z_loss`: z-loss's
    coefficient (0: none); each training forward's term is appended to `z_records`."""

    def __init__(self, chunk: int = 256):
        super().__init__()
        self.chunk, self.z_loss, self.z_records = chunk, 0.0, []
        self.shard = VocabShard()
        self.kernel = chunk_gradient

    def compile_chunks(self) -> None:
        """Each chunk's logits, loss and gradient as one compiled graph (`compile.enable`; one per
        chunk size: a batch's last chunk may be shorter)."""
        self.kernel = torch.compile(chunk_gradient, fullgraph=True, dynamic=False)

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                divisor: torch.Tensor | int | None = None, per_token: bool = False, z: bool = False) -> torch.Tensor:
        """The mean loss over the counted labels (or the sum / `divisor`); `per_token`: each
        token's loss, shaped as the labels (0 where ignored), without gradient. `z`: with a
        gradient, z-loss's joins it (the next-token loss's, not multi-token prediction's)."""
        shape = labels.shape
        hidden, labels = hidden.flatten(0, -2), labels.flatten()
        if divisor is None:
            divisor = (labels != IGNORE).sum()
        if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
            if per_token:
                raise ValueError("a loss per token is for evaluation: without gradient")
            loss, term = LinearCrossEntropy.apply(hidden, weight, labels, divisor, self.chunk, self.shard,
                                                  self.z_loss if z else 0.0, self.kernel)
            if z and self.z_loss:
                self.record(term)
            return loss
        losses = torch.cat([_chunk_losses(hidden[s:s + self.chunk], weight, labels[s:s + self.chunk], self.shard)[3]
                            for s in range(0, len(hidden), self.chunk)])
        return losses.view(shape) if per_token else losses.sum() / divisor

    def record(self, term: torch.Tensor) -> None:
        if torch.compiler.is_compiling() or torch._C._current_graph_task_id() == -1:  # (not in a recompute)
            self.z_records.append(term)
