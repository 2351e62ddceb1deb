"""The host beside a GPU, as `training.offload optimizer` uses it (plait/parallel/data_parallel.py):
how fast one rank copies between its pinned host memory and its GPU, and how many parameters
per second the host clips and steps (torch's fused AdamW) on the cores a rank has. `plait doctor`
measures both on every rank at once, as a job shares the host (a node's step rate: its ranks'
sum); a data sheet states them.
"""

from __future__ import annotations

import torch

from plait.plan.timing import timed

COPY_ELEMENTS = 1 << 26  # 256 MiB of fp32: far past any cache, as a block's shard is
STEP_ELEMENTS = 1 << 24


def measure_host(device: torch.device, seconds: float) -> dict[str, float]:
    """{"host_link": bytes/s of the slower way between host and GPU, "host_step": parameters/s}; 0 on a CPU."""
    if device.type != "cuda":
        return {"host_link": 0.0, "host_step": 0.0}
    host = torch.empty(COPY_ELEMENTS, pin_memory=True)
    gpu = torch.empty(COPY_ELEMENTS, device=device)
    ways = [timed(lambda: gpu.copy_(host, non_blocking=True), device, seconds / 4),
            timed(lambda: host.copy_(gpu, non_blocking=True), device, seconds / 4)]
    weights = torch.nn.Parameter(torch.zeros(STEP_ELEMENTS))
    weights.grad = torch.full_like(weights, 1e-3)
    optimizer = torch.optim.AdamW([weights], fused=True)

    def step():  # (what the host does to its shard each step: the norm, clipping, AdamW)
        torch.linalg.vector_norm(weights.grad)
        weights.grad.mul_(1.0)
        optimizer.step()

    return {"host_link": 4 * COPY_ELEMENTS / max(ways),
            "host_step": STEP_ELEMENTS / timed(step, device, seconds / 2)}
