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
import functools

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

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
    """Turns a stored DTensor parameter into the full compute tensor of this rank."""

    def __init__(self, mesh: DeviceMesh, precision: Precision):
        self.mesh = mesh
        self.forward_dtype = precision.compute if precision.mode == "param" else None
        self.backward_dtype = precision.reduce

    def __call__(self, param: DTensor) -> torch.Tensor:
        if not _parametrization_on:
            return param
        full = param.redistribute(placements=[Replicate()] * self.mesh.ndim, forward_dtype=self.forward_dtype,
                                  backward_dtype=self.backward_dtype)
        # The gradient of the local copy is one rank's contribution: averaged over the mesh.
        return full.to_local(grad_placements=[Partial("avg")] * self.mesh.ndim)


# Outputs worth keeping from forward to backward; everything else in a block (the parameter
# all-gathers and casts, views, element-wise ops) is recomputed in backward.
SAVED_OPS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
             torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
             torch.ops.aten._scaled_dot_product_flash_attention.default,
             torch.ops.aten._scaled_dot_product_efficient_attention.default}


def _save_only_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_SAVE if op in SAVED_OPS else CheckpointPolicy.MUST_RECOMPUTE


def reshard_after_forward(block: nn.Module) -> None:
    """Free each block's gathered parameters after its forward, as FSDP does.

    Selective activation checkpointing of the block: matmul and attention outputs are kept,
    while the gathered parameters (and everything cheap derived from them) are recomputed in
    backward, so between forward and backward only the shards stay in memory.
    """
    forward = block.forward
    context = functools.partial(create_selective_checkpoint_contexts, _save_only_matmuls)

    def resharding_forward(*args):
        if not torch.is_grad_enabled():
            return forward(*args)
        return checkpoint(forward, *args, use_reentrant=False, context_fn=context)

    block.forward = resharding_forward


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


def apply_simple_fsdp(model: nn.Module, dp_mesh: DeviceMesh, precision: Precision, reshard: bool) -> None:
    """Store every parameter as a DTensor on the dp mesh and parametrize its access."""
    placements = [Replicate(), Shard(0)]
    compute = ReplicateComputation(dp_mesh, precision)
    classes: dict = {}
    for module in list(model.modules()):
        params = dict(module.named_parameters(recurse=False))
        if not params:
            continue
        for name, param in params.items():
            if isinstance(param, DTensor):
                raise NotImplementedError("parallelism.dp_backend simple_fsdp: composing with tensor parallelism "
                                          "is not implemented yet")
            # src_data_rank=None: no communication; the values are filled in after `to_empty`.
            stored = distribute_tensor(param, dp_mesh, placements, src_data_rank=None)
            module.register_parameter(name, nn.Parameter(stored, requires_grad=param.requires_grad))
        _parametrize(module, compute, classes)
    if reshard and dp_mesh["dp_shard"].size() > 1:
        for block in model.layers.values():
            reshard_after_forward(block)
