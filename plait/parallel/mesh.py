"""The job's one device mesh: every parallelism addresses its dimensions by name."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from plait.config import JobConfig

# Pipeline parallelism outermost: its point-to-point traffic is the lightest, so it is the
# dimension that crosses nodes; tensor parallelism, the heaviest, stays innermost (one node).
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")
DP_DIMS = ("dp_replicate", "dp_shard")


def build_mesh(cfg: JobConfig, device_type: str) -> tuple[DeviceMesh, DeviceMesh]:
    """The job's mesh with every dimension named (size-1 ones included, so every layout
    addresses the same names), and its flattened data-parallel view: the ranks that read
    different data, over which the loader splits batches and the loss is averaged."""
    p = cfg.parallelism
    mesh = init_device_mesh(device_type, (p.pp, p.dp_replicate, p.dp_shard, p.tp), mesh_dim_names=MESH_DIMS)
    return mesh, mesh[DP_DIMS]._flatten("dp")


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
    if sizes["tp"] > 1:
        layout = "TP" if layout == "single device" else f"{layout}+TP"
    if sizes["pp"] > 1:
        layout = "PP" if layout == "single device" else f"PP+{layout}"
    return f"{layout} on mesh {sizes} ({mesh.device_type}, {torch.distributed.get_backend()})"
