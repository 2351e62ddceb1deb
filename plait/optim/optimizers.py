"""The optimizer: AdamW, or Muon for the blocks' matrices with AdamW for the rest.

Muon (Keller Jordan; Moonlight, "Muon is scalable for LLM training"): each matrix's momentum
(Nesterov) is orthogonalised by Newton-Schulz iterations, and the result scaled by
0.2 x sqrt(max(rows, columns)) so its RMS matches AdamW's: lr and weight decay carry over from
AdamW. It applies to the blocks' 2-D weights and to the experts' [E, rows, columns] stacks (each
expert's matrix apart); the embedding, the output layer, norms, biases and routers stay on AdamW
(as Moonlight and torchtitan do).

A matrix is orthogonalised whole, in float32, so every layout computes the same update as one
device. Sharded (FSDP2, HSDP, TP, EP, SimpleFSDP: a DTensor), its momentum meets in one place:
`orthogonalize_all` spreads the matrices over the ranks that share them (see there).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from plait.config import ConfigError, JobConfig
from plait.models.moe import EXPERT_BIASES

# Keller Jordan's quintic iteration: drives every singular value towards ~1 in 5 steps.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def newton_schulz(g: torch.Tensor, steps: int) -> torch.Tensor:
    """The orthogonal factor of g (or of each matrix of a stack [..., rows, columns]), approximately,
    in float32."""
    a, b, c = NS_COEFFICIENTS
    x = g.float()
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) + 1e-7)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if tall else x


def muon_scale(shape: torch.Size) -> float:
    """Moonlight's factor: the update's RMS that of AdamW's (~0.2) for a matrix of this shape."""
    return 0.2 * math.sqrt(max(shape[-2], shape[-1]))


def is_matrix(name: str, param: nn.Parameter) -> bool:
    """A weight of a matmul (2-D, or an experts' [E, rows, columns] stack), not a bias or norm
    (the experts' biases are [E, n] stacks of vectors)."""
    return param.ndim >= 2 and not name.endswith(EXPERT_BIASES)


def uses_muon(name: str, param: nn.Parameter) -> bool:
    """A block's matrix but a router's (classic DDP's wrapper prefixes the names with `module.`)."""
    return name.removeprefix("module.").startswith("layers.") and is_matrix(name, param) and ".router." not in name


def check_optimizer(cfg: JobConfig) -> None:
    o = cfg.optimizer
    if len(o.betas) != 2 or not all(0 <= b < 1 for b in o.betas):
        raise ConfigError(f"optimizer.betas: two numbers in [0, 1), got {tuple(o.betas)}")
    if not o.eps > 0 or not 0 <= o.momentum < 1 or o.ns_steps < 1:
        raise ConfigError(f"optimizer: eps must be > 0, momentum in [0, 1), ns_steps >= 1; got {o.eps}, "
                          f"{o.momentum}, {o.ns_steps}")


def build_optimizer(model: nn.Module, cfg: JobConfig) -> torch.optim.Optimizer:
    """AdamW over every parameter (weight decay on matrices only), or Muon: the blocks' matrices
    in a Muon group first, the others in AdamW's two groups (`group_options`)."""
    t, o = cfg.training, cfg.optimizer
    named = list(model.named_parameters())
    muon = [p for n, p in named if o.name == "muon" and uses_muon(n, p)]
    chosen = {id(p) for p in muon}
    decay = [p for n, p in named if is_matrix(n, p) and id(p) not in chosen]
    no_decay = [p for n, p in named if not is_matrix(n, p)]
    params = [muon, decay, no_decay] if o.name == "muon" else [decay, no_decay]
    groups = [{"params": p, **options} for p, options in zip(params, group_options(cfg))]
    if o.name == "adamw":
        # (offloaded, the host steps it: fused, one pass over each tensor, 8.5x the default's speed on a CPU core)
        return torch.optim.AdamW(groups, lr=t.lr, betas=tuple(o.betas), eps=o.eps, fused=t.offload != "none" or None)
    return Muon(groups, lr=t.lr, betas=tuple(o.betas), eps=o.eps, momentum=o.momentum, ns_steps=o.ns_steps)


def group_options(cfg: JobConfig) -> list[dict]:
    """What sets `build_optimizer`'s groups apart, in order (the rest is the optimizer's defaults)."""
    decay, no_decay = {"weight_decay": cfg.training.weight_decay}, {"weight_decay": 0.0}
    return [{**decay, "muon": True}, decay, no_decay] if cfg.optimizer.name == "muon" else [decay, no_decay]


class Muon(torch.optim.AdamW):
    """Muon for the groups marked `muon`, torch's AdamW (the same code, bitwise) for the others.

    Per Muon parameter: momentum m = mu m + g; the Nesterov direction g + mu m, orthogonalised
    whole (`orthogonalize_all`) and scaled (`muon_scale`); p = p (1 - lr wd) - lr x update."""

    def __init__(self, params, *, momentum: float, ns_steps: int, **adamw):
        super().__init__(params, **adamw)
        self.momentum, self.ns_steps = momentum, ns_steps

    @torch.no_grad()
    def step(self, closure=None):
        adamw = [g for g in self.param_groups if not g.get("muon")]
        for group in self.param_groups:
            if group.get("muon"):
                self._muon_step(group)
        everything, self.param_groups = self.param_groups, adamw
        try:
            return super().step(closure)
        finally:
            self.param_groups = everything

    def _muon_step(self, group: dict) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        directions = []
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:  # (and a step count, as AdamW's: its state loader wants one)
                state["momentum_buffer"], state["step"] = torch.zeros_like(p.grad), torch.tensor(0.0)
            state["step"] += 1
            buffer = state["momentum_buffer"]
            buffer.mul_(self.momentum).add_(p.grad)
            directions.append(p.grad.add(buffer, alpha=self.momentum))
        for p, update in zip(params, orthogonalize_all(directions, self.ns_steps)):
            p.mul_(1 - group["lr"] * group["weight_decay"])
            p.add_(update.to(p.dtype), alpha=-group["lr"] * muon_scale(p.shape))


def orthogonalize_all(directions: list[torch.Tensor], steps: int) -> list[torch.Tensor]:
    """`newton_schulz` of each (whole) matrix, as local tensors or DTensors shaped and placed as
    given.

    A DTensor sharded on dim 0 over one mesh dimension (FSDP2's and HSDP's shards, SimpleFSDP's):
    the ranks of that dimension take the matrices in turn; one all-to-all brings
    each matrix's rows to the rank whose turn it is, which orthogonalises it whole, and a second
    sends the rows back: every rank sends and receives about its share of the parameters twice,
    and does 1/n of the work. (The ranks of other dimensions, replicas, each do the same.) Other
    placements (TP's, FSDP2 over TP, experts under ep): gathered whole on every rank, orthogonalised
    by each."""
    out: list[torch.Tensor | None] = [None] * len(directions)
    rounds: dict = {}
    for i, d in enumerate(directions):
        if not isinstance(d, DTensor):
            out[i] = newton_schulz(d, steps)
        elif (dim := row_sharded(d)) is not None:
            rounds.setdefault((d.device_mesh, dim), []).append(i)
        else:
            full = newton_schulz(d.full_tensor(), steps)
            out[i] = distribute_tensor(full, d.device_mesh, d.placements, src_data_rank=None)
    for (mesh, dim), indices in rounds.items():
        group = mesh.get_group(dim)
        n, rank = dist.get_world_size(group), dist.get_group_rank(group, dist.get_rank())
        if n == 1:  # the shard is the whole matrix (FSDP2 on one rank): nothing to exchange
            for i in indices:
                d = directions[i]
                out[i] = DTensor.from_local(newton_schulz(d.to_local(), steps), d.device_mesh, d.placements,
                                            run_check=False, shape=d.shape, stride=d.stride())
            continue
        for start in range(0, len(indices), n):  # one round: matrix start + r is rank r's
            turn = indices[start:start + n]
            for i, local in zip(turn, exchange([directions[i] for i in turn], group, n, rank, steps)):
                d = directions[i]
                out[i] = DTensor.from_local(local, d.device_mesh, d.placements, run_check=False,
                                            shape=d.shape, stride=d.stride())
    return out


def row_sharded(d: DTensor) -> int | None:
    """The mesh dimension a DTensor is sharded over on its dim 0 (plainly: not strided, as FSDP2
    over TP is), if it is replicated over every other."""
    split = [i for i, p in enumerate(d.placements) if not p.is_replicate()]
    return split[0] if len(split) == 1 and type(d.placements[split[0]]) is Shard and d.placements[split[0]].dim == 0 \
        else None


def rows_of(rows: int, n: int) -> list[int]:
    """Each of n ranks' rows of a dim-0 shard (torch.chunk's split, as DTensor's)."""
    sizes = [len(c) for c in torch.arange(rows).chunk(n)]
    return sizes + [0] * (n - len(sizes))


def exchange(matrices: list[DTensor], group: dist.ProcessGroup, n: int, rank: int, steps: int) -> list[torch.Tensor]:
    """One round: matrix r goes whole to rank r (of n), is orthogonalised there, and comes back
    as each rank's rows. Returns this rank's rows of each matrix's result."""
    locals_ = [m.to_local().float() for m in matrices]
    inner = [math.prod(m.shape[1:]) for m in matrices]
    send = [loc.numel() for loc in locals_] + [0] * (n - len(matrices))
    mine = rank < len(matrices)
    receive = [r * inner[rank] for r in rows_of(matrices[rank].shape[0], n)] if mine else [0] * n
    device = locals_[0].device
    pieces = torch.empty(sum(receive), device=device)
    dist.all_to_all_single(pieces, torch.cat([loc.flatten() for loc in locals_]) if locals_ else
                           torch.empty(0, device=device), receive, send, group=group)
    result = torch.empty(0, device=device)
    if mine:
        whole = matrices[rank]
        result = newton_schulz(pieces.view(whole.shape), steps).flatten()
    back = torch.empty(sum(send), device=device)
    dist.all_to_all_single(back, result, send, receive, group=group)
    return [piece.view(loc.shape) for piece, loc in zip(back.split(send[:len(matrices)]), locals_)]
