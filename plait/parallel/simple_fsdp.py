"""SimpleFSDP: data parallelism as a DTensor parametrization, visible to the compiler.

Every parameter is stored as a DTensor on the data-parallel mesh — Shard(0) on `dp_shard`,
Replicate on `dp_replicate` — and each access goes through `replicate_compute`:
`redistribute(Replicate, forward_dtype=compute, backward_dtype=reduce)`. So FSDP's all-gather
(in the compute dtype) is the forward of that redistribute, and its reduce-scatter (in the
reduce dtype) is the backward; for replicated parameters the backward is an all-reduce (DDP);
both on a 2-D mesh is HSDP. Gradients come back averaged over the data-parallel ranks.

The parametrization is a property on a per-module subclass rather than
`torch.nn.utils.parametrize` so parameter names (and state-dict keys) stay those of the
plain model. `raw_parameters()` switches it off for init, inspection and state-dict work.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from plait.parallel.activation_checkpoint import apply_ac
from plait.parallel.mesh import DP_DIMS
from plait.config import ActivationCheckpoint
from plait.precision import Precision

_parametrization_on = True


@contextlib.contextmanager
def raw_parameters():
    """Inside, `module.weight` is the stored (sharded) DTensor, not the gathered compute tensor."""
    global _parametrization_on
    previous, _parametrization_on = _parametrization_on, False
    try:
        yield
    finally:
        _parametrization_on = previous


class ReplicateComputation:
    """Turns a stored DTensor parameter into the compute tensor of this rank: the full tensor,
    or under TP the rank's TP shard as a DTensor on the tp mesh (what the TP plan expects)."""

    def __init__(self, tp_mesh: DeviceMesh, precision: Precision):
        self.tp_mesh = tp_mesh
        self.forward_dtype = precision.compute if precision.mode == "param" else None
        self.backward_dtype = precision.reduce

    def __call__(self, param: DTensor) -> torch.Tensor:
        if not _parametrization_on:
            return param
        tp = list(param.placements[len(DP_DIMS):])  # empty unless the parameter is TP-sharded
        full = param.redistribute(placements=[Replicate()] * len(DP_DIMS) + tp, forward_dtype=self.forward_dtype,
                                  backward_dtype=self.backward_dtype)
        # The gradient of the local copy is one rank's contribution: averaged over the dp ranks.
        local = full.to_local(grad_placements=[Partial("avg")] * len(DP_DIMS) + tp)
        if not tp:
            return local
        return DTensor.from_local(local, self.tp_mesh, tp, run_check=False, shape=param.shape, stride=param.stride())


def _parametrize(module: nn.Module, compute: ReplicateComputation, classes: dict) -> None:
    """Swap in a subclass whose parameter attributes are computed properties. Modules of one
    class share one subclass: torch.compile guards on types, and a class per module would
    recompile every transformer block."""
    names = tuple(name for name, _ in module.named_parameters(recurse=False))
    key = (module.__class__, names)
    if key not in classes:
        properties = {name: property(lambda self, name=name: compute(self._parameters[name])) for name in names}
        classes[key] = type(f"SimpleFSDP{module.__class__.__name__}", (module.__class__,), properties)
    module.__class__ = classes[key]


def storage_placements(param: torch.Tensor, tp_size: int) -> list:
    """Where a parameter lives on the (dp_replicate, dp_shard[, tp]) mesh: replicated over
    dp_replicate, split on dim 0 over dp_shard, and, for a TP DTensor, its TP placement kept.
    When TP already splits dim 0, dp_shard splits each TP piece further; `_StridedShard` says
    so (plain Shard(0) would mean dp_shard first, then tp: other rows per rank). This is the
    layout FSDP2 gives the same parameter, so checkpoints move between the two backends."""
    if not isinstance(param, DTensor):
        return [Replicate(), Shard(0)]
    (tp,) = param.placements
    dp_shard = _StridedShard(0, split_factor=tp_size) if tp == Shard(0) else Shard(0)
    return [Replicate(), dp_shard, tp]


def apply_simple_fsdp(model: nn.Module, mesh: DeviceMesh, precision: Precision, reshard: bool,
                      ac: ActivationCheckpoint, n_blocks: int) -> None:
    """Store every parameter as a DTensor on the data-parallel mesh (with the tp dimension for
    TP-sharded parameters) and parametrize its access."""
    tp_mesh = mesh["tp"]
    compute = ReplicateComputation(tp_mesh, precision)
    classes: dict = {}
    for module in list(model.modules()):
        params = dict(module.named_parameters(recurse=False))
        if not params:
            continue
        for name, param in params.items():
            storage_mesh = mesh[(*DP_DIMS, "tp")] if isinstance(param, DTensor) else mesh[DP_DIMS]
            # src_data_rank=None: no communication; the values are filled in after `to_empty`.
            full = torch.empty(param.shape, dtype=param.dtype, device=param.device)
            stored = distribute_tensor(full, storage_mesh, storage_placements(param, tp_mesh.size()), src_data_rank=None)
            module.register_parameter(name, nn.Parameter(stored, requires_grad=param.requires_grad))
        _parametrize(module, compute, classes)
    # Resharding is selective activation checkpointing of each block: matmul and attention
    # outputs are kept, the gathered parameters (and what is cheaply derived from them) are
    # recomputed in backward, so between forward and backward only the shards stay in memory.
    # So every block is checkpointed at least selectively; `full` where activation_checkpoint asks.
    reshard = reshard and mesh["dp_shard"].size() > 1
    apply_ac(model, ac.mode, ac.every, n_blocks, at_least_selective=reshard)


def _gathered_numel(param: DTensor) -> int:
    """Elements one rank's gather of `param` produces: all of them, or under TP its TP piece."""
    tp_sharded = param.device_mesh.ndim > len(DP_DIMS) and param.placements[-1].is_shard()
    return param.numel() // (param.device_mesh.size(-1) if tp_sharded else 1)


def compile_whole_model(model: nn.Module, precision: Precision, bucket_per_block: bool) -> None:
    """torch.compile the model in place (FQNs unchanged), optionally bucketing its collectives.

    Inductor's bucketing passes merge adjacent all-gathers (reduce-scatters) greedily up to a
    size cap. Capping a bucket at one transformer block's parameter bytes gives about one
    collective per block and phase: few collectives, while at most about a block's parameters
    are gathered at once, as in FSDP2.
    """
    if bucket_per_block:
        import torch._inductor.config as inductor

        block_numel = sum(map(_gathered_numel, next(iter(model.layers.values())).parameters()))
        gathered = precision.compute if precision.mode == "param" else torch.float32
        # Bytes / 2**20 is exact in floating point, so the cap is exactly one block.
        inductor.bucket_all_gathers_fx = "all"
        inductor.bucket_all_gathers_fx_bucket_size_determinator = \
            lambda _: block_numel * gathered.itemsize / 2**20
        inductor.bucket_reduce_scatters_fx = "all"
        inductor.bucket_reduce_scatters_fx_bucket_size_determinator = \
            lambda _: block_numel * precision.reduce.itemsize / 2**20
    model.compile(fullgraph=True)
