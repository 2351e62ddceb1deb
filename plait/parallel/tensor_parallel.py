"""Tensor parallelism for the Llama model: a declarative plan applied from outside the model.

Megatron-style: q/k/v and SwiGLU w1/w3 are split column-wise (each rank owns whole heads and a
slice of the FFN hidden units), wo and w2 row-wise, so each block needs one all-gather and one
reduce-scatter per sub-layer. With sequence parallelism the norms and the residual stream are
split along the sequence between those points, so no rank holds the full activations. With loss
parallelism the logits stay split over the vocabulary and cross-entropy is computed on shards;
the chunked loss (training.loss_chunk) always computes them so, each rank its vocabulary slice of
each chunk, reducing the softmax's statistics over TP (`vocab_parallel_loss`).

The switches of Llama's relatives follow their weights: q/k/v and w1/w3 biases split with their
columns, wo and w2 biases are added once after the reduction; a per-head q/k norm (one weight
shared by every head) is replicated and normalises the rank's heads; a q/k norm over the whole
projection splits its weight with the heads and completes its mean square with one all-reduce.

A linear-attention block (the gated delta rule) splits its heads too: q, k, v, the output gate
and the per-head step and gate projections column-wise, the output projection row-wise; the
convolution's channels, A_log and dt_bias with their heads (`LinearHeadsParallel`); its output
norm's one weight is whole on every rank, with partial gradients.

Latent attention (DeepSeek-V3) splits its heads the same way (wq or wq_b, wkv_b column-wise, wo
row-wise) and keeps the latent projections and their norms (wq_a, q_a_norm, wkv_a, kv_a_norm)
whole on every rank, as torchtitan's plan does: they are small (the latents are 512-1536 wide
where the heads are 16K-24K), and split they would need an all-gather each before the heads.
Each rank then computes them on the whole input and back-propagates its own heads' share, so
their gradients are partial sums over TP, completed as sequence parallelism's norms' are.

A mixture-of-experts layer is not split: its experts are whole on every TP rank (split them over
ranks with parallelism.ep), which runs it on the whole sequence (gathered under SP, as the dense
FFN's input is) and hands back its own part. Every TP rank computes the same routing, outputs and
gradients, so its parameters need no reduction over TP.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput,
                                               PrepareModuleInputOutput, RowwiseParallel, SequenceParallel,
                                               parallelize_module)

from plait.config import ConfigError, JobConfig
from plait.models.args import ModelArgs
from plait.models.latent_attention import LatentAttention
from plait.models.linear_attention import GatedDeltaNet
from plait.models.loss import VocabShard
from plait.models.moe import MoE
from plait.models.transformer import TiedOutput


def check_divisibility(args: ModelArgs, cfg: JobConfig) -> None:
    """Every split dimension must divide evenly: a one-line error before any process group."""
    tp, p = cfg.parallelism.tp, cfg.parallelism
    if tp == 1:
        return
    sizes = {"model n_heads": args.n_heads, "model n_kv_heads": args.n_kv_heads, "model FFN hidden size": args.ffn_hidden}
    if args.linear_layers:
        sizes |= {"model linear_key_heads": args.linear_key_heads, "model linear_value_heads": args.linear_value_heads}
    if p.loss_parallel or cfg.training.loss_chunk:
        sizes["vocabulary size (parallelism.loss_parallel or training.loss_chunk)"] = args.vocab_size
    if p.sequence_parallel:
        sizes["training.seq_len (parallelism.sequence_parallel)"] = cfg.training.seq_len
    for what, size in sizes.items():
        if size % tp:
            raise ConfigError(f"parallelism.tp: {tp} does not divide the {what} {size}; "
                              f"allowed: a divisor of {size}")


class _AllReduceSum(torch.autograd.Function):
    """A sum over the TP ranks whose gradient is the sum of the ranks' gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return funcol.all_reduce(x, "sum", group).wait()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return funcol.all_reduce(grad, "sum", ctx.group).wait(), None


class ProjectionNormParallel(ParallelStyle):
    """A norm over the whole of a column-split projection (OLMo 2's q/k norm): its weight is split
    as the projection's columns are, and each rank normalises its piece by the mean square of
    the whole projection, one all-reduced value per token in forward and in backward. (Left to
    DTensor, the backward would reduce-scatter a gradient the size of the whole projection.)"""

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        module.register_parameter("weight", nn.Parameter(distribute_tensor(module.weight, mesh, [Shard(0)])))
        group, size = mesh.get_group(), module.weight.shape[0]

        def forward(x: torch.Tensor) -> torch.Tensor:
            x32 = x.float()
            squares = _AllReduceSum.apply(x32.pow(2).sum(-1, keepdim=True), group)
            return (x32 * torch.rsqrt(squares / size + module.eps) * module.weight.to_local()).type_as(x)

        module.forward = forward
        return module


class HeadsParallel(ParallelStyle):
    """The attention kernel's parameter per head (sinks), split as the heads are: the kernel
    reads its share."""

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        module.register_parameter("sinks", nn.Parameter(distribute_tensor(module.sinks, mesh, [Shard(0)])))
        module.sink_logits = lambda: module.sinks.to_local()
        return module


class LinearHeadsParallel(ParallelStyle):
    """A linear-attention block's parameters per channel or head (the convolutions, A_log,
    dt_bias), split as its projections' heads are; its output norm's weight whole on each rank,
    whose gradient is the rank's heads' part (Partial: summed once)."""

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        for name in ("conv_q", "conv_k", "conv_v", "A_log", "dt_bias"):
            module.register_parameter(name, nn.Parameter(distribute_tensor(getattr(module, name), mesh, [Shard(0)])))
        norm = module.out_norm
        norm.register_parameter("weight", nn.Parameter(distribute_tensor(norm.weight, mesh, [Replicate()])))
        module.local = lambda name: getattr(module, name).to_local()
        norm.gain = lambda: norm.weight.to_local(grad_placements=[Partial()])
        return module


class Replicated(ParallelStyle):
    """A layer whole on each rank inside a DTensor computation (Kimi Delta Attention's gate
    bottlenecks): its parameters replicated DTensors, so its replicated input gives a replicated
    output, and its weights' gradients, the ranks' heads' parts, are summed by DTensor."""

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        for name, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(name, nn.Parameter(distribute_tensor(param, mesh, [Replicate()])))
        return module


class WholeOnEachRank(ParallelStyle):
    """A linear layer or norm of latent attention before its heads split: replicated, run on the
    rank's whole (local) input. Its output's gradient on each rank is that rank's heads' part, so
    its weights' gradients are partial: DTensor completes the sum (Partial)."""

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        for name, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(name, nn.Parameter(distribute_tensor(param, mesh, [Replicate()])))

        def local(name: str) -> torch.Tensor | None:
            param = getattr(module, name, None)
            return None if param is None else param.to_local(grad_placements=[Partial()])

        if isinstance(module, nn.Linear):
            module.forward = lambda x: F.linear(x, local("weight"), local("bias"))
        else:  # RMSNorm
            module.forward = lambda x: F.rms_norm(x, (x.shape[-1],), local("weight"), module.eps)
        return module


class HeadsColumns(ParallelStyle):
    """A projection into latent attention's heads, split column-wise: the rank's heads from its
    whole local input, whose gradient stays the rank's part (summed once, at the attention's
    input: `latent_input`)."""

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        module.register_parameter("weight", nn.Parameter(distribute_tensor(module.weight, mesh, [Shard(0)])))
        module.forward = lambda x: F.linear(x, module.weight.to_local())
        return module


def latent_input(between, mesh: DeviceMesh):
    """Latent attention's input, gathered (SP) into a local tensor every rank holds whole, whose
    gradients are the ranks' parts: summed (reduce-scattered under SP) on the way back."""

    def hook(module, args, kwargs):
        x = args[0] if isinstance(args[0], DTensor) else DTensor.from_local(args[0], mesh, [between], run_check=False)
        return (x.redistribute(placements=[Replicate()]).to_local(grad_placements=[Partial()]), *args[1:]), kwargs

    return hook


def latent_attention_plan(attention: LatentAttention, between) -> dict[str, ParallelStyle]:
    """Latent attention's heads split over TP, its latents whole on each rank."""
    plan = {f"attention.{name}": WholeOnEachRank() for name in ("wq_a", "q_a_norm", "wkv_a", "kv_a_norm")
            if hasattr(attention, name)}
    plan |= {f"attention.{name}": HeadsColumns() for name in ("wq", "wq_b", "wkv_b") if hasattr(attention, name)}
    return plan | {"attention.wo": RowwiseParallel(output_layouts=between)}


def vocab_parallel_loss(model: nn.Module, between, mesh: DeviceMesh) -> None:
    """The chunked loss on this rank's rows of the output matrix (the output layer's split keeps
    them: Shard(0)), from the final hidden states gathered whole; its hidden-state gradient is
    this rank's part, summed on the way back (reduce-scattered under SP)."""
    group = mesh.get_group()
    rows = model.args.vocab_size // mesh.size()
    model.loss.shard = VocabShard(mesh.get_local_rank() * rows,
                                  lambda t, op: funcol.all_reduce(t, op, group).wait())
    gathered = latent_input(between, mesh)

    def hook(module, args, kwargs):
        (hidden, *rest), kwargs = gathered(module, args, kwargs)
        return (hidden, rest[0].to_local(), *rest[1:]), kwargs

    model.loss.register_forward_pre_hook(hook, with_kwargs=True)


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool, loss_parallel: bool) -> None:
    # Between blocks activations are split on the sequence (SP) or replicated.
    between = Shard(1) if sequence_parallel else Replicate()
    logits = Shard(-1) if loss_parallel else Replicate()
    outer = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
        "output": ColwiseParallel(input_layouts=between, output_layouts=logits, use_local_output=not loss_parallel),
    }
    if isinstance(model.output, TiedOutput):
        # The embedding's matrix, split on the vocabulary (rows), is the output layer's too:
        # what ColwiseParallel does, minus distributing a weight of its own.
        outer["output"] = PrepareModuleInputOutput(
            input_layouts=(between,), desired_input_layouts=(Replicate(),), use_local_input=False,
            output_layouts=(Shard(-1),), desired_output_layouts=(logits,), use_local_output=not loss_parallel)
    if sequence_parallel:
        outer["norm"] = SequenceParallel()
    # A pipeline stage holds some of these parts only; between stages activations travel as the
    # local pieces of `between`, which the next stage's first block expects.
    parallelize_module(model, tp_mesh, {name: plan for name, plan in outer.items() if getattr(model, name) is not None})
    if model.output is not None and model.loss.chunk:
        vocab_parallel_loss(model, between, tp_mesh)
    for predictor in model.mtp.values() if sequence_parallel else ():
        # Multi-token prediction's norms and projection run on the sequence shard, their weights
        # replicated with partial gradients (without SP every rank runs them whole: plain tensors);
        # its block is split as the others below, its embedding and output layer are the model's.
        parallelize_module(predictor, tp_mesh, {name: SequenceParallel(use_local_output=name != "norm")
                                                for name in ("enorm", "hnorm", "eh_proj", "norm")})
    for block in model.blocks():
        plan = {
            # The block input arrives split (SP) and is gathered once for q/k/v; RoPE's table
            # (second argument) is a plain tensor every rank already holds.
            "attention": PrepareModuleInput(input_layouts=(between, None), desired_input_layouts=(Replicate(), None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=between),
        }
        if isinstance(block.attention, GatedDeltaNet):
            plan |= {f"attention.{name}": ColwiseParallel() for name in ("wz", "wb", "wa")}
            if block.attention.channel_gates:  # (the gates' bottlenecks, whole on each rank)
                plan |= {f"attention.{name}": Replicated() for name in ("wa_down", "wz_down")}
            parallelize_module(block.attention, tp_mesh, LinearHeadsParallel())
        elif getattr(block.attention, "gated", False):  # (Qwen3-Next's output gate, split with the heads)
            plan["attention.wg"] = ColwiseParallel()
        if isinstance(block.attention, LatentAttention):
            plan = latent_attention_plan(block.attention, between)
            block.attention.register_forward_pre_hook(latent_input(between, tp_mesh), with_kwargs=True)
        if isinstance(block.feed_forward, MoE):
            plan["feed_forward"] = PrepareModuleInputOutput(
                input_layouts=(between,), desired_input_layouts=(Replicate(),), use_local_input=True,
                output_layouts=(Replicate(),), desired_output_layouts=(between,), use_local_output=True)
        else:
            plan["feed_forward"] = PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),))
            plan["feed_forward.w1"] = plan["feed_forward.w3"] = ColwiseParallel()
            plan["feed_forward.w2"] = RowwiseParallel(output_layouts=between)
        if sequence_parallel:
            # After a sub-layer (post_norm) a norm's output meets the local residual stream.
            plan["attention_norm"] = SequenceParallel(use_local_output=block.post_norm)
            plan["ffn_norm"] = SequenceParallel(use_local_output=block.post_norm)
            if block.sandwich_norm:  # (Gemma 3's norms after the sub-layers, as OLMo 2's)
                plan["post_attention_norm"] = plan["post_ffn_norm"] = SequenceParallel(use_local_output=True)
        qk_norm = getattr(block.attention, "qk_norm", "none")  # (a linear block has none)
        if qk_norm == "head":  # on [batch, seq, local heads, head_dim]: heads are dim 2
            plan["attention.q_norm"] = plan["attention.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        elif qk_norm == "projection":
            plan["attention.q_proj_norm"] = plan["attention.k_proj_norm"] = ProjectionNormParallel()
        if hasattr(block.attention, "core") and block.attention.core.sinks is not None:
            plan["attention.core"] = HeadsParallel()
        parallelize_module(block, tp_mesh, plan)
