"""Parallelism applied from outside the model: one module per technique, one mesh for all.

`build_mesh` turns validated degrees into one named DeviceMesh; `build_model` builds the model
on the meta device, applies each technique's plan, then materialises and initialises only
what each rank owns.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from plait.config import JobConfig
from plait.model import ModelArgs, Transformer
from plait.parallel.data_parallel import apply_fsdp
from plait.parallel.ddp import apply_ddp
from plait.parallel.simple_fsdp import apply_simple_fsdp, raw_parameters
from plait.parallel.tensor_parallel import apply_tp
from plait.precision import Precision
from plait.weights import init_weights

MESH_DIMS = ("dp_replicate", "dp_shard", "tp")
DP_DIMS = ("dp_replicate", "dp_shard")


def build_mesh(cfg: JobConfig, device_type: str) -> tuple[DeviceMesh, DeviceMesh]:
    """The job's mesh with every dimension named (size-1 ones included, so every layout
    addresses the same names), and its flattened data-parallel view: the ranks that read
    different data, over which the loader splits batches and the loss is averaged."""
    p = cfg.parallelism
    mesh = init_device_mesh(device_type, (p.dp_replicate, p.dp_shard, p.tp), mesh_dim_names=MESH_DIMS)
    return mesh, mesh[DP_DIMS]._flatten("dp")


def build_model(args: ModelArgs, mesh: DeviceMesh, cfg: JobConfig, precision: Precision,
                device: torch.device) -> nn.Module:
    """The model, parallelised, on `device`, holding the layout-independent initial weights."""
    with torch.device("meta"):
        model = Transformer(args)
    if cfg.compile.enable:
        # Compile each block's forward in place: FQNs stay those of the plain model, and the
        # hooks that sharding adds around the module call stay outside the compiled graph.
        for block in model.layers.values():
            block.forward = torch.compile(block.forward, fullgraph=True)
    backend = cfg.parallelism.dp_backend
    if cfg.parallelism.tp > 1:  # start-up refuses TP with classic DDP
        apply_tp(model, mesh["tp"], cfg.parallelism.sequence_parallel, cfg.parallelism.loss_parallel)
    if backend == "simple_fsdp":
        apply_simple_fsdp(model, mesh[DP_DIMS], precision, cfg.parallelism.reshard_after_forward)
    elif backend == "fsdp2":
        apply_fsdp(model, mesh[DP_DIMS], precision)
    model.to_empty(device=device)
    with raw_parameters():  # SimpleFSDP: write the stored shards, not gathered temporaries
        init_weights(model, cfg.training.seed)
    if backend == "ddp":
        # DistributedDataParallel wraps real parameters (it replicates them anyway), so it comes last.
        return apply_ddp(model, mesh["dp_replicate"], precision, cfg.compile.autograd)
    return model


def gradient_sync(model: nn.Module, enabled: bool):
    """Context for one micro-batch's backward: reduce gradients only when `enabled` (the last)."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return contextlib.nullcontext() if enabled else model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(enabled)
    # SimpleFSDP reduces in each micro-batch's backward (part of the graph); sharded fp32
    # gradients then accumulate.
    return contextlib.nullcontext()


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
    return f"{layout} on mesh {sizes} ({mesh.device_type}, {torch.distributed.get_backend()})"
