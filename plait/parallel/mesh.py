"""The job's one device mesh: every parallelism addresses its dimensions by name."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from plait.config import JobConfig

# Pipeline parallelism outermost: its point-to-point traffic is the lightest, so it is the
# dimension that crosses nodes; tensor parallelism, the heaviest, stays innermost (one node),
# with context parallelism's per-layer key/value all-gathers next to it.
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
DP_DIMS = ("dp_replicate", "dp_shard")


def build_mesh(cfg: JobConfig, device_type: str) -> tuple[DeviceMesh, DeviceMesh, DeviceMesh]:
    """The job's mesh with every dimension named (size-1 ones included, so every layout
    addresses the same names); its data-parallel view, the ranks that read different batches
    (the loader splits a step's batch over them); and the ranks the loss is averaged over: the
    data-parallel ranks x cp, whose ranks hold parts of the same sequences. Under cp > 1 the mesh
    also has `dp_shard_cp`, the dimension FSDP2 shards parameters over."""
    p = cfg.parallelism
    mesh = init_device_mesh(device_type, (p.pp, p.dp_replicate, p.dp_shard, p.cp, p.tp), mesh_dim_names=MESH_DIMS)
    dp = mesh[DP_DIMS]._flatten("dp")
    if p.cp == 1:
        return mesh, dp, dp
    mesh[("dp_shard", "cp")]._flatten("dp_shard_cp")
    return mesh, dp, mesh[(*DP_DIMS, "cp")]._flatten("dp_cp")


def shard_dim(mesh: DeviceMesh) -> str:
    """The dimension parameters are sharded over: dp_shard, times cp where cp > 1 (every cp rank
    holds the same parameters, so they shard them as data-parallel ranks do)."""
    return "dp_shard_cp" if mesh["cp"].size() > 1 else "dp_shard"


def describe(mesh: DeviceMesh) -> str:
    sizes = dict(zip(mesh.mesh_dim_names, mesh.shape))
    if sizes["dp_replicate"] > 1 and sizes["dp_shard"] > 1:
        layout = "HSDP"
    elif sizes["dp_replicate"] > 1:
        layout = "DDP"
    elif sizes["dp_shard"] > 1:
        layout = "FSDP2"
    else:
        layout = "single device"
    for dim, name in (("cp", "CP"), ("tp", "TP")):
        if sizes[dim] > 1:
            layout = name if layout == "single device" else f"{layout}+{name}"
    if sizes["pp"] > 1:
        layout = "PP" if layout == "single device" else f"PP+{layout}"
    return f"{layout} on mesh {sizes} ({mesh.device_type}, {torch.distributed.get_backend()})"
