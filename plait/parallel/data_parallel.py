"""Data parallelism (DDP, FSDP2, HSDP) as FSDP2's `fully_shard` on the (dp_replicate, dp_shard) mesh
(dp_shard x cp under context parallelism: cp ranks hold the same parameters).

One mechanism covers every data-parallel layout: shard degree 1 is DDP (all-reduce only),
replicate degree 1 is FSDP (all-gather + reduce-scatter), both is HSDP, so mixed precision and
gradient reduction follow one policy instead of differing per layout. A world of one rank has
nothing to shard or reduce: there fully_shard would only copy parameters and gradients in and
out of its buffers, so `CastUnit` does the one thing its policy still does at degree 1, the
parameter cast (`Precision.one_device`).

`training.offload optimizer` is FSDP2's CPU offload: each unit's fp32 shard, its gradient and
AdamW's moments live in host memory; a gather copies the shard to the device (then casts and
gathers it as without offload), a reduce-scatter's output is copied back, and the host steps the
optimizer (torch's fused CPU AdamW: 8.5x the default's speed on one core here). The device keeps
only what a step computes with: the gathered units, activations and buffers.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from plait.config import ConfigError, JobConfig
from plait.float8 import ByteAllGather
from plait.models.moe import MoE
from plait.parallel.mesh import shard_dim
from plait.precision import Precision


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, precision: Precision, pipelined: bool = False,
               experts: DeviceMesh | None = None) -> nn.Module:
    """`experts`: the experts' mesh under expert parallelism (plait/parallel/expert_parallel.py)."""
    if precision.one_device:
        if precision.mode == "param" and precision.compute != torch.float32:
            blocks = model.blocks()
            for block in blocks:
                CastUnit(block, precision.compute)
            CastUnit(model, precision.compute, inner=blocks)
        return model
    policy = precision.fsdp_policy()
    # Each block is its own unit so only one block's full parameters exist at a time. The last
    # block is not resharded after forward: backward needs it immediately. Without a shard
    # dimension (DDP, single device) resharding saves no memory and would only repeat the
    # all-gather copies in backward, so parameters stay unsharded from forward to backward.
    # Under pipeline parallelism neither: a stage runs the forwards of several micro-batches
    # before their backwards, and resharding would re-gather every block once per micro-batch
    # in each phase; a stage holds 1/pp of the blocks, so keeping them gathered for the step
    # costs 1/pp of what it would without pipelining (torchtitan's choice too).
    shard = shard_dim(mesh)
    # (offloaded, a unit's parameters leave the device after each use, on one rank too: that is its point)
    sharded = (mesh[shard].size() > 1 or precision.offload) and not pipelined
    # On a 2-D mesh FSDP2 takes its HSDP path and all-reduces gradients over dp_replicate even
    # when that group is one rank (about 1 MiB per step on the debug model, seen in traces).
    dp_mesh = mesh[shard] if mesh["dp_replicate"].size() == 1 else mesh[("dp_replicate", shard)]
    blocks = model.blocks()
    for i, block in enumerate(blocks):
        reshard = sharded and i < len(blocks) - 1
        if experts is not None and isinstance(block.feed_forward, MoE):
            shard_experts(block.feed_forward, experts, policy, reshard, precision)
        fully_shard(block, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard,
                    offload_policy=precision.offload_policy())
    # Embedding, final norm and output share the root unit.
    fully_shard(model, mesh=dp_mesh, mp_policy=policy, offload_policy=precision.offload_policy())
    if precision.float8 != "none":  # float8 all-gather: the bytes as uint8 (gloo has no float8 type)
        for unit in [*blocks, model]:
            unit.set_custom_all_gather(ByteAllGather())
    return model


def shard_experts(moe: MoE, experts: DeviceMesh, policy: MixedPrecisionPolicy, reshard: bool,
                  precision: Precision) -> None:
    """Under ep, the experts a unit of their own on the experts' data-parallel ranks."""
    replicate = experts["dp_replicate"].size() > 1
    fully_shard(moe.experts, mesh=experts[("dp_replicate", "edp_shard")] if replicate else experts["edp_shard"],
                mp_policy=policy, offload_policy=precision.offload_policy(),
                reshard_after_forward=reshard and (experts["edp_shard"].size() > 1 or precision.offload))


def check_offload(cfg: JobConfig, device: torch.device | None = None) -> None:
    """`training.offload optimizer` where plait runs it, or one line why not. Without a device
    (`plait plan` pricing a GPU from any machine), what the options alone tell."""
    if cfg.training.offload == "none":
        return
    p, why = cfg.parallelism, ""
    if device is not None and device.type != "cuda":
        why = "on a CPU device the host is the device: there is nothing to move"
    elif p.dp_backend != "fsdp2":
        why = f"it is FSDP2's CPU offload, and parallelism.dp_backend is {p.dp_backend}"
    elif cfg.optimizer.name != "adamw":
        why = "the host steps torch's fused AdamW; Muon's Newton-Schulz matmuls belong on the device"
    elif cfg.training.float8 != "none":
        why = "float8's weights gather through their own all-gather (torchao's), not measured offloaded"
    elif cfg.fault_tolerance.enable:
        why = "replica groups reduce gradients over their own process group, which would receive host tensors"
    if why:
        raise ConfigError(f"training.offload: optimizer: {why}; allowed: none")


class CastUnit:
    """fully_shard's MixedPrecisionPolicy(param_dtype) at degree 1, without its buffers: the
    parameters of one unit (a block; or the model's own, the embedding, final norm and output
    layer, as fully_shard's root unit holds them) in the compute dtype from the unit's forward to
    its backward.

    On entering the unit's forward, each parameter is replaced in its module by a copy in the
    compute dtype, a leaf of its own (as fully_shard's unsharded parameter is), so backward sums
    its gradients in the compute dtype as there; a hook then adds the sum, in fp32, to the fp32
    parameter's .grad (micro-batches accumulate in fp32, as fully_shard's do before reducing) and
    puts the fp32 parameter back. The copies stay registered until then because an activation
    checkpoint's recomputation in backward reads them from the modules. Forward without
    gradients (evaluation) puts the parameters back when the unit returns.
    """

    def __init__(self, unit: nn.Module, dtype: torch.dtype, inner: list[nn.Module] = ()):
        """`inner`: units inside this one, which cast their own parameters."""
        self.dtype = dtype
        skipped = {id(p) for child in inner for p in child.parameters()}
        # (module, name) slots, not parameters: materialising the model replaces its parameters
        self.slots = [(module, name) for module in unit.modules()
                      for name, param in module.named_parameters(recurse=False) if id(param) not in skipped]
        unit.register_forward_pre_hook(self.cast)
        unit.register_forward_hook(self.after_forward)

    def cast(self, unit: nn.Module, args) -> None:
        for module, name in self.slots:
            held = module._parameters[name]
            param = getattr(held, "cast_of", held)  # a copy left by a forward that had no backward
            copy = nn.Parameter(param.detach().to(self.dtype), requires_grad=param.requires_grad)
            copy.cast_of = param
            if param.requires_grad and torch.is_grad_enabled():
                copy.register_post_accumulate_grad_hook(lambda copy, slot=(module, name): self.give_back(*slot, copy))
            module._parameters[name] = copy

    def after_forward(self, unit: nn.Module, args, output) -> None:
        if not torch.is_grad_enabled():
            for module, name in self.slots:
                held = module._parameters[name]
                module._parameters[name] = getattr(held, "cast_of", held)

    @staticmethod
    def give_back(module: nn.Module, name: str, copy: nn.Parameter) -> None:
        param = copy.cast_of
        if param.grad is None:
            param.grad = copy.grad.to(param.dtype)
        else:
            param.grad += copy.grad
        copy.grad = None
        module._parameters[name] = param
