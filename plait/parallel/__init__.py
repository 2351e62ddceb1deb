"""Parallelism applied from outside the model: one module per technique, one mesh for all.

`build_mesh` turns validated degrees into one named DeviceMesh; `build_model` builds the model
on the meta device, applies each technique's plan, then materialises and initialises only
what each rank owns.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor, wait_tensor
from torch.distributed.device_mesh import DeviceMesh

from plait import float8
from plait.config import JobConfig
from plait.models.args import ModelArgs
from plait.models.transformer import Transformer
from plait.models.moe import MoE
from plait.parallel.activation_checkpoint import apply_ac
from plait.parallel.context_parallel import BatchLayout, apply_cp  # noqa: F401 (BatchLayout: the package's interface)
from plait.parallel.data_parallel import apply_fsdp
from plait.parallel.ddp import apply_ddp
from plait.parallel.expert_parallel import apply_ep, expert_mesh
from plait.parallel.mesh import DP_DIMS, build_mesh, describe  # noqa: F401 (the package's interface)
from plait.parallel.simple_fsdp import apply_simple_fsdp, compile_whole_model, raw_parameters
from plait.parallel.tensor_parallel import apply_tp
from plait.precision import Precision
from plait.models.weights import init_weights


def build_model(args: ModelArgs, mesh: DeviceMesh, cfg: JobConfig, precision: Precision,
                device: torch.device) -> nn.Module:
    """The model, parallelised, on `device`, holding the layout-independent initial weights."""
    with torch.device("meta"):
        model = Transformer(args)
    return parallelize(model, mesh, cfg, precision, device)


def parallelize(model: Transformer, mesh: DeviceMesh, cfg: JobConfig, precision: Precision,
                device: torch.device, pipelined: bool = False) -> nn.Module:
    """Apply every plan to a model (or a pipeline stage's part of it) on the meta device, then
    materialise and initialise what this rank owns."""
    backend = cfg.parallelism.dp_backend
    ac, n_blocks = cfg.activation_checkpoint, model.args.n_layers
    model.loss.chunk, model.loss.z_loss = cfg.training.loss_chunk, cfg.training.z_loss
    if cfg.training.float8 != "none":  # first: the other plans wrap and shard the float8 layers
        float8.convert(model, cfg, precision.compute, device)
    if cfg.parallelism.cp > 1:  # start-up refuses cp with SimpleFSDP and classic DDP
        apply_cp(model, mesh["cp"], cfg.parallelism.cp_kind, cfg.parallelism.cp_ulysses,
                 latent=cfg.parallelism.cp_gather == "latent")
    if backend != "simple_fsdp":  # SimpleFSDP checkpoints its blocks itself: it reshards that way
        apply_ac(model, ac.mode, ac.every, n_blocks)
    # A mixture of experts records each training forward's token counts (a list's append) once; a
    # checkpointed block's compiled backward recomputes from its graph, not the Python, so the
    # record is not replayed there (else dynamo refuses the side effect inside the checkpoint).
    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = cfg.compile.enable
    if cfg.compile.enable and backend != "simple_fsdp":
        # Compile each block's (checkpointed) forward in place: FQNs stay those of the plain model, and the
        # hooks that sharding adds around the module call stay outside the compiled graph.
        for block in model.blocks():
            if cfg.parallelism.ep > 1 and isinstance(block.feed_forward, MoE):
                compile_regions(block)
            else:
                block.forward = compiled_forward(block.forward)
        model.loss.compile_chunks()  # (each chunk's logits, loss and gradient: plait/models/loss.py)
        # Every block shares one code object, whose graphs dynamo caches together, each guarded on
        # its block's kind (window or chunk, RoPE, experts, linear attention): the blocks of K kinds
        # need K times the graphs of one (training, evaluation, their masks and lengths) before
        # dynamo gives up on recompiling.
        a = model.args
        kinds = len({(a.window(i), a.chunk(i), i in a.nope_layers, a.local_rope(i), a.sparse(i), a.linear(i))
                     for i in range(a.n_layers)})
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 8 * kinds)
    if cfg.parallelism.tp > 1:  # start-up refuses TP with classic DDP
        apply_tp(model, mesh["tp"], cfg.parallelism.sequence_parallel, cfg.parallelism.loss_parallel)
    experts = expert_mesh(mesh, cfg.parallelism.ep) if cfg.parallelism.ep > 1 else None
    if experts is not None:  # start-up allows ep with fsdp2 alone
        apply_ep(model, experts["ep"], cfg.compile.enable)
    if backend == "simple_fsdp":
        apply_simple_fsdp(model, mesh, precision, cfg.parallelism.reshard_after_forward, ac, n_blocks)
    elif backend == "fsdp2":
        apply_fsdp(model, mesh, precision, pipelined, experts)
    # Offloaded, fully_shard's shards live in host memory; the buffers (RoPE tables, router biases) are
    # computed with on the device.
    model.to_empty(device="cpu" if precision.offload else device)
    if precision.offload:
        for module in model.modules():
            for name, buffer in module.named_buffers(recurse=False):
                setattr(module, name, buffer.to(device))
    with raw_parameters():  # SimpleFSDP: write the stored shards, not gathered temporaries
        init_weights(model, cfg.training.seed)
    if cfg.compile.enable and backend == "simple_fsdp":
        # SimpleFSDP has no hooks: its collectives are ops the compiler sees, so the whole model
        # goes into one graph, where they can be bucketed.
        compile_whole_model(model, precision, cfg.compile.bucketing == "block")
    if backend == "ddp":
        # DistributedDataParallel wraps real parameters (it replicates them anyway), so it comes last.
        return apply_ddp(model, mesh["dp_replicate"], precision, cfg.compile.autograd)
    return model


def compiled_forward(forward):
    """`forward` compiled, taking its input waited on. Under TP the embedding hands the first
    block its output as an AsyncCollectiveTensor (its all-reduce not yet waited on), and a
    compiled graph given one returns no gradient for it: the embedding trained on zeros (torch
    2.13, fp32 and bf16, with or without SP). `wait_tensor` is differentiable and copies nothing.
    One graph (`fullgraph`: a break is an error)."""
    compiled = torch.compile(forward, fullgraph=True)

    def waited(x, *args, **kwargs):
        if isinstance(x, AsyncCollectiveTensor):
            x = wait_tensor(x)
        return compiled(x, *args, **kwargs)

    return waited


def compile_regions(block: nn.Module) -> None:
    """A mixture-of-experts block under ep, compiled by regions, each one graph: the block's
    other parts (norms, attention) and the layer's router and shared experts; ep compiles the
    experts' own computation between its all-to-alls (plait/parallel/expert_parallel.py). What is
    left eager is not traceable as one graph: the experts are an FSDP2 unit of their own inside
    the block, whose hooks dynamo does not trace, and the all-to-alls' split sizes are token
    counts read on the host. (torchtitan compiles its MoE blocks under ep the same way.)"""
    moe = block.feed_forward
    for parent, skipped in ((block, moe), (moe, moe.experts)):
        for child in parent.children():
            if child is not skipped:
                child.forward = compiled_forward(child.forward)


def gradient_sync(model: nn.Module, enabled: bool):
    """Context for one micro-batch's forward and backward: reduce gradients only when `enabled`
    (the last). DDP's `no_sync` must cover the forward: DDP prepares its reducer there."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return contextlib.nullcontext() if enabled else model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(enabled)
    # SimpleFSDP reduces in each micro-batch's backward (part of the graph); sharded fp32
    # gradients then accumulate.
    return contextlib.nullcontext()
