"""Classic DistributedDataParallel: bucketed all-reduce of fp32 gradients, optionally compressed.

Parameters stay fp32 (DDP cannot cast them at module boundaries), so mixed precision comes from
autocast in the forward context. A bf16 reduce dtype installs a compression hook: each bucket is
cast to bf16, pre-divided by the world size and all-reduced, then written back into the fp32
gradients. PyTorch's `bf16_compress_hook` refuses to run unless the backend is NCCL, so the
same body (`_compress_hook`) is registered under bf16 directly; it works on gloo and NCCL.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import _compress_hook
from torch.distributed.device_mesh import DeviceMesh

from plait.precision import Precision


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh, precision: Precision, compiled_autograd: bool) -> nn.Module:
    if compiled_autograd:
        # The C++ reducer cannot run under compiled autograd; the Python reducer traces into it.
        torch._dynamo.config.optimize_ddp = "python_reducer"
    ddp = nn.parallel.DistributedDataParallel(model, process_group=dp_mesh.get_group(), 
                                          forward_sync_buffers=False)  # RoPE is recomputed, never changes
    if precision.reduce == torch.bfloat16:
        ddp.register_comm_hook(dp_mesh.get_group(), bf16_all_reduce)
    return ddp


def bf16_all_reduce(process_group, bucket):
    return _compress_hook(torch.bfloat16, process_group, bucket)
