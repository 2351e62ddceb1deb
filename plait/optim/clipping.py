"""Gradient clipping by the global norm, the same in every layout to the last bit."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate


# Elements per chunk of `clip_and_norm`'s float64 sums. Squaring a gradient whole allocates a
# copy of it (fresh pages every step for small's embedding): in chunks of this size the norm of
# small's gradients takes 40 ms where torch's fp32 clip_grad_norm_ takes 31 (and fp64 norms of
# whole gradients, plait's earlier way, 73). On a GPU the caching allocator reuses a copy's memory,
# and each chunk costs three kernel launches: llama3_1b's gradients in chunks of 2^18 took ~11,000
# launches, 0.13 s of host time a step on an H200 (half the step), so chunks there are 2^26 (256 MiB).
NORM_CHUNK = {"cpu": 1 << 18, "cuda": 1 << 26}


def local_squares(grad: torch.Tensor) -> tuple:
    """(kind of sharding, float64 sum of the squares of the values this rank holds) of a gradient.
    The kind: None for a plain tensor, else (mesh, which of its dimensions shard it: Shard, or
    FSDP2+TP's _StridedShard; a one-rank dimension has nothing to add)."""
    key = None
    if isinstance(grad, DTensor):
        if any(pl.is_partial() for pl in grad.placements):  # (a pending sum: completed first)
            grad = grad.redistribute(placements=[Replicate() if pl.is_partial() else pl for pl in grad.placements])
        key = (grad.device_mesh, tuple(not pl.is_replicate() and size > 1
                                       for pl, size in zip(grad.placements, grad.device_mesh.shape)))
        grad = grad.to_local()
    chunks = grad.reshape(-1).split(NORM_CHUNK.get(grad.device.type, NORM_CHUNK["cpu"]))
    return key, sum((chunk.square().sum(dtype=torch.float64) for chunk in chunks),
                    torch.zeros((), dtype=torch.float64, device=grad.device))


def clip_and_norm(model: torch.nn.Module, max_norm: float, pp_group=None, counted_elsewhere=frozenset()) -> float:
    """Global gradient norm over all shards, clipping to max_norm unless it is 0.

    Squares are summed in float64: each layout sums shards in its own order, and in fp32 those
    orders differ in the last bit, enough to change the clipping coefficient and break the
    bitwise equality of layouts. In fp64 the fp32-rounded result is the same in every layout.
    (Each square is rounded to fp32 first: the same rounding of the same element in every
    layout, and 1.3x faster than converting the gradients to fp64.)
    Each rank sums the squares of the values it holds; gradients sharded over some mesh
    dimensions (FSDP2's over dp, TP's over tp) add those sums over exactly those dimensions,
    once per kind of sharding. Under pipeline parallelism each stage's sum is added over
    `pp_group`, without the parameters `counted_elsewhere` (a pipeline's copy of a parameter
    another stage holds too: clipped, not counted twice). Clipping goes per mesh: one foreach call
    cannot mix meshes.
    """
    by_mesh: dict = {}
    squares: dict = {}  # (mesh, which of its dimensions shard) or None (a plain tensor): float64 sum
    for p in model.parameters():
        if p.grad is not None:
            by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
            if p in counted_elsewhere:
                continue
            key, value = local_squares(p.grad)
            squares[key] = squares.get(key, 0) + value
    total = torch.zeros((), dtype=torch.float64, device=next(model.parameters()).device)
    for key, value in squares.items():
        if key is not None:  # summed over the dimensions that shard, as they are
            mesh, sharded = key
            value = DTensor.from_local(value, mesh, [Partial() if s else Replicate() for s in sharded]).full_tensor()
        total = total + value
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    total = total.sqrt().float()
    if max_norm:
        for params in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
    return total.item()
