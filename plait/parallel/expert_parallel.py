"""Expert parallelism: each MoE layer's experts split over `ep` ranks, tokens sent to the ranks
that hold their experts and back by all-to-all (uneven splits: dropless routing sends what it
sends).

ep borrows its ranks from the data-parallel ones (dp_shard x cp, as torchtitan does): those ranks
read different tokens, so an expert's rank receives them from all its ep peers. The experts' own
mesh splits dp_shard x cp into (edp_shard, ep): FSDP2 shards an expert's parameters over the
edp_shard ranks ep leaves (x dp_replicate for HSDP), and every other parameter over all
dp_shard x cp ranks, as without ep.

Gradients: a rank's expert gradient sums what every token of its ep group contributed, each
token's through its own rank's mean loss; the data-parallel mean divides by every data-parallel
rank (dp_replicate x dp_shard x cp), where the experts' FSDP2 units divide by their own mesh's
size, ep times fewer: the experts' backward divides by ep first (exact for ep a power of two).
FSDP2's own divide factor would do it in the reduction, as NCCL's PREMUL_SUM, which gloo lacks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from plait.config import ConfigError, JobConfig
from plait.models.moe import GroupedExperts, moe_layers, swiglu_experts
from plait.models.args import ModelArgs


def check_expert_options(cfg: JobConfig) -> None:
    """What ep asks of the other options, the model aside (before any process group)."""
    p = cfg.parallelism
    if p.ep == 1:
        return
    if p.dp_backend != "fsdp2":
        raise ConfigError(f"parallelism.ep: expert parallelism shards experts with fully_shard; allowed with "
                          f"parallelism.dp_backend fsdp2 only, got {p.dp_backend}")
    if (p.dp_shard * p.cp) % p.ep:
        raise ConfigError(f"parallelism.ep: {p.ep} must divide dp_shard x cp = {p.dp_shard * p.cp} (ep borrows its "
                          f"ranks from them)")


def check_experts(args: ModelArgs, cfg: JobConfig) -> None:
    """The model against ep and tp (after the model's shape is known)."""
    p = cfg.parallelism
    if not args.n_experts:
        if p.ep > 1:
            raise ConfigError(f"parallelism.ep: {p.ep} needs a mixture-of-experts model (e.g. --model.flavor "
                              f"debug_moe); this model is dense")
        return
    if args.n_experts % p.ep:
        raise ConfigError(f"parallelism.ep: {p.ep} must divide the model's {args.n_experts} experts")
    if args.router == "softmax" and cfg.training.moe_sequence_aux_coef:
        raise ConfigError(f"training.moe_sequence_aux_coef: {cfg.training.moe_sequence_aux_coef} weighs a sigmoid "
                          "router's loss (DeepSeek-V3's); this model's router is softmax, whose loss "
                          "training.moe_aux_loss_coef weighs; allowed here: 0")


def expert_mesh(mesh: DeviceMesh, ep: int) -> DeviceMesh:
    """The experts' mesh (pp, dp_replicate, edp_shard, ep, tp): the job's with dp_shard x cp
    (adjacent, so their ranks are contiguous) split into edp_shard x ep. Every rank builds it."""
    pp, replicate, shard, cp, tp = mesh.mesh.shape
    ranks = mesh.mesh.reshape(pp, replicate, shard * cp // ep, ep, tp)
    return DeviceMesh(mesh.device_type, ranks, mesh_dim_names=("pp", "dp_replicate", "edp_shard", "ep", "tp"))


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh, compiled: bool = False) -> None:
    """Keep this rank's experts of every MoE layer (a DTensor sharded on the expert dimension) and
    route each layer's tokens to the ranks of their experts. On the meta device, before FSDP2.
    `compiled`: the experts' computation between the all-to-alls is one compiled graph."""
    for moe in moe_layers(model):
        experts = moe.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            # (empty_like of a slice: a weight wrapper, torchao's MXFP8 experts', keeps its class)
            local = torch.empty_like(param.narrow(0, 0, param.shape[0] // ep_mesh.size()))
            experts.register_parameter(name, nn.Parameter(DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)))
        experts.forward = DispatchedExperts(experts, ep_mesh.get_group(), compiled)


class DispatchedExperts:
    """The experts' forward under ep: (tokens sorted by expert, counts per expert, all E) in and
    out as without ep; in between, each rank runs its own experts on every token sent to them."""

    def __init__(self, experts: GroupedExperts, group: dist.ProcessGroup, compiled: bool = False):
        self.experts, self.group, self.compiled = [experts], group, compiled  # (a list: not a submodule)
        self.local_experts = torch.compile(local_experts, fullgraph=True) if compiled else local_experts

    def __call__(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ep, experts = dist.get_world_size(self.group), self.experts[0]
        local = counts.numel() // ep
        with torch.no_grad():  # received[i, e]: how many tokens rank i sends to my expert e
            received = torch.empty_like(counts)
            dist.all_to_all_single(received, counts, group=self.group)
            received = received.view(ep, local)
        send, receive = counts.view(ep, local).sum(1).tolist(), received.sum(1).tolist()
        tokens = all_to_all_single_autograd(x, receive, send, self.group)
        if self.compiled:
            # Waited on here, not inside the graph, where a checkpoint's forward would not see the
            # wait that its recomputation (eager, at the first use) does.
            tokens = dynamic_rows(wait_tensor(tokens))
        weights = [ScaleGradient.apply(w.to_local(), 1 / ep) for w in (experts.w1, experts.w2, experts.w3,
                                                                       *experts.biases())]
        out = self.local_experts(tokens, received, weights, experts.limit, experts.alpha)
        return all_to_all_single_autograd(out, send, receive, self.group)


def dynamic_rows(tokens: torch.Tensor) -> torch.Tensor:
    """`tokens`, their count a dynamic size of the compiled experts' graph: the count a rank
    receives varies by step. (0 or 1 tokens, which dynamo specializes, compile apart: a recompile
    in the rare step where a rank receives so few.)"""
    torch._dynamo.maybe_mark_dynamic(tokens, 0)
    return tokens


def local_experts(tokens: torch.Tensor, received: torch.Tensor, weights: list[torch.Tensor], limit: float,
                  alpha: float) -> torch.Tensor:
    """This rank's experts (`weights`: w1, w2, w3 and any biases, local) on the tokens it received,
    grouped by sender, then expert (`received` [senders, experts] of each), returned in that order.
    The experts want them grouped by expert, then sender: each expert's tokens in the order the
    ranks hold them, as on one device."""
    order = regroup(received, tokens.shape[0])
    out = swiglu_experts(tokens[order], received.sum(0), *weights[:3], tuple(weights[3:]), limit, alpha)
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel(), device=order.device)
    return out[back]


class ScaleGradient(torch.autograd.Function):
    """x unchanged; its gradient times `scale`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def regroup(received: torch.Tensor, rows: int) -> torch.Tensor:
    """The permutation that takes `rows` rows grouped (sender, expert) to rows grouped (expert,
    sender), given the count of each (sender, expert) group [senders, experts] (`rows` their sum:
    every size known without reading the counts on the host)."""
    starts = (received.flatten().cumsum(0) - received.flatten()).view_as(received)
    counts, starts = received.t().flatten(), starts.t().flatten()
    within = torch.arange(rows, device=counts.device) - torch.repeat_interleave(counts.cumsum(0) - counts, counts,
                                                                                output_size=rows)
    return torch.repeat_interleave(starts, counts, output_size=rows) + within
