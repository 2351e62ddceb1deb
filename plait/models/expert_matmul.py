"""Each expert's rows of a token matrix times that expert's weight, as one operator the compiler
keeps whole, in any dtype.

`torch._grouped_mm` multiplies every expert's rows in one call, but the shape function the
compiler traces it with accepts bf16 alone, and CUDA's kernel is bf16-only too. In fp32 the
experts were then split on the host (`counts.tolist()`): a graph break in every MoE block that
compiles. `expert_matmul` is a custom operator with its own shape function and backward: the
compiler keeps it in the graph as one call. Inside it, `_grouped_mm` where it runs (a CPU, any
dtype; measured bitwise against its own autograd, forward and both gradients), else one matmul
per expert (CUDA outside bf16, where the host split is the operator's own business).
"""

from __future__ import annotations

import torch


def _ends(offsets: torch.Tensor) -> list[tuple[int, int]]:
    """Each expert's first and last-plus-one row (a host read: the loop's sizes)."""
    ends = offsets.tolist()
    return list(zip([0, *ends[:-1]], ends))


def _kernel_runs(x: torch.Tensor) -> bool:
    return not x.is_cuda or x.dtype == torch.bfloat16


@torch.library.custom_op("plait::expert_matmul", mutates_args=())
def expert_matmul(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x [rows sorted by expert, n] -> [rows, m]: expert e's rows times w[e] [n, m]; `offsets`
    (int32) where each expert's rows end."""
    if _kernel_runs(x):
        return torch._grouped_mm(x, w, offs=offsets).contiguous()
    return torch.cat([x[a:b] @ w[e] for e, (a, b) in enumerate(_ends(offsets))])


@expert_matmul.register_fake
def _(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[-1])


@torch.library.custom_op("plait::expert_weight_gradient", mutates_args=())
def expert_weight_gradient(x: torch.Tensor, grad: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """[E, n, m]: each expert's rows of x [rows, n] transposed times its rows of grad [rows, m]."""
    if _kernel_runs(x):
        return torch._grouped_mm(x.t(), grad, offs=offsets).contiguous()
    return torch.stack([x[a:b].t() @ grad[a:b] for a, b in _ends(offsets)])


@expert_weight_gradient.register_fake
def _(x: torch.Tensor, grad: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return x.new_empty(offsets.shape[0], x.shape[1], grad.shape[1])


def _keep(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad: torch.Tensor):
    x, w, offsets = ctx.saved_tensors
    # (the formulas of _grouped_mm's own backward: its gradients, bitwise)
    return expert_matmul(grad, w.transpose(-2, -1), offsets), expert_weight_gradient(x, grad, offsets), None


expert_matmul.register_autograd(_backward, setup_context=_keep)


def expert_linear(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """F.linear of each expert's rows of x with its weight w[e] [out, in]. bf16 calls
    `torch._grouped_mm` by name (torchao's float8 and MXFP8 experts replace it there)."""
    if x.dtype == torch.bfloat16:
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)
    return expert_matmul(x, w.transpose(-2, -1), offsets)

