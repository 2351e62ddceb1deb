"""Data parallelism (DDP, FSDP2, HSDP) as FSDP2's `fully_shard` on the (dp_replicate, dp_shard) mesh
(dp_shard x cp under context parallelism: cp ranks hold the same parameters).

One mechanism covers every data-parallel layout: shard degree 1 is DDP (all-reduce only),
replicate degree 1 is FSDP (all-gather + reduce-scatter), both is HSDP, and (1, 1) is a single
device. Applying it everywhere, single device included, means mixed precision and gradient
reduction follow one policy instead of differing per layout.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from plait.float8 import ByteAllGather
from plait.moe import MoE
from plait.parallel.mesh import shard_dim
from plait.precision import Precision


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, precision: Precision, pipelined: bool = False,
               experts: DeviceMesh | None = None) -> nn.Module:
    """`experts`: the experts' mesh under expert parallelism (plait/parallel/expert_parallel.py)."""
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
    sharded = mesh[shard].size() > 1 and not pipelined
    # On a 2-D mesh FSDP2 takes its HSDP path and all-reduces gradients over dp_replicate even
    # when that group is one rank (about 1 MiB per step on the debug model, seen in traces).
    dp_mesh = mesh[shard] if mesh["dp_replicate"].size() == 1 else mesh[("dp_replicate", shard)]
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        reshard = sharded and i < len(blocks) - 1
        if experts is not None and isinstance(block.feed_forward, MoE):
            shard_experts(block.feed_forward, experts, policy, reshard)
        fully_shard(block, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard)
    # Embedding, final norm and output share the root unit.
    fully_shard(model, mesh=dp_mesh, mp_policy=policy)
    if precision.float8 != "none":  # float8 all-gather: the bytes as uint8 (gloo has no float8 type)
        for unit in [*blocks, model]:
            unit.set_custom_all_gather(ByteAllGather())
    return model


def shard_experts(moe: MoE, experts: DeviceMesh, policy: MixedPrecisionPolicy, reshard: bool) -> None:
    """Under ep, the experts a unit of their own on the experts' data-parallel ranks."""
    replicate = experts["dp_replicate"].size() > 1
    fully_shard(moe.experts, mesh=experts[("dp_replicate", "edp_shard")] if replicate else experts["edp_shard"],
                mp_policy=policy, reshard_after_forward=reshard and experts["edp_shard"].size() > 1)
