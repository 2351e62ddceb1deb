"""Per-step metrics: MFU against a known or measured peak, memory, console/JSONL/TensorBoard."""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from plait.data import cache_dir, cached_file

# Dense peak TFLOP/s (bf16 tensor cores, fp32 without TF32) from the vendors' data sheets.
GPU_PEAK_TFLOPS = {
    "B200": (2250.0, 80.0),
    "H200": (989.5, 66.9),
    "H100 SXM": (989.5, 66.9),
    "H100": (756.0, 51.2),  # PCIe
    "A100": (312.0, 19.5),
    "L40S": (362.0, 91.6),
    "A10G": (70.0, 31.2),
    "RTX 4090": (165.2, 82.6),
}


def peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """Peak FLOP/s of one device for matmuls in `dtype`, and where the number came from."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, (bf16, fp32) in GPU_PEAK_TFLOPS.items():
            if key in name:
                return (bf16 if dtype != torch.float32 else fp32) * 1e12, f"data sheet ({key})"
    # Measured once per machine, dtype and thread count, then cached: MFU of different runs
    # shares one denominator, and a noisy moment does not make one run's MFU jump.
    name = f"peak-{device.type}-{str(dtype).removeprefix('torch.')}-{torch.get_num_threads()}threads.json"
    flops = cached_file(cache_dir() / name, lambda: measure_matmul_flops(device, dtype),
                        lambda value, tmp: tmp.write_text(json.dumps(value)), lambda p: json.loads(p.read_text()))
    return flops, f"measured by a matmul calibration, cached in {cache_dir() / name}"


def measure_matmul_flops(device: torch.device, dtype: torch.dtype, n: int = 1024, seconds: float = 2.0) -> float:
    """Best square-matmul FLOP/s over a short run (after a warm-up): the practical peak of this
    device with this process's threads. Taking the best of many short rounds filters out
    moments when other processes held the cores."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    a @ b
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = max(best, 2 * n**3 / (time.perf_counter() - start))
    return best


def peak_memory_gib(device: torch.device) -> float:
    """Peak accelerator memory allocated, or on CPU the process's peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def state_memory_gib(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> float:
    """GiB of parameters, gradients and optimizer state this rank holds, counting a DTensor's
    local shard only: exact where peak memory (activations, gathered parameters, allocator or
    RSS slack) blurs what sharding saves. Call it between the optimizer step and zero_grad,
    while gradients exist. Communication buffers (DDP's buckets, FSDP2's gather buffers) are
    workspace, not state, and are not counted."""
    tensors = [t for p in model.parameters() for t in (p, p.grad) if t is not None]
    tensors += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    with torch.no_grad():
        local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in local) / 2**30


class MetricsLogger:
    """Rank 0's sinks: a console line every `log_interval` steps, JSONL and TensorBoard every step."""

    def __init__(self, jsonl: str, tensorboard: str, log_interval: int):
        self.log_interval = log_interval
        self.jsonl = None
        if jsonl:
            Path(jsonl).parent.mkdir(parents=True, exist_ok=True)
            self.jsonl = open(jsonl, "a")
        self.writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(tensorboard)

    def log(self, row: dict) -> None:
        step = row["step"]
        if step % self.log_interval == 0 or step == 1:
            print(f"step {step:5d} | loss {row['loss']:.4f} | grad_norm {row['grad_norm']:.3f} | lr {row['lr']:.2e}"
                  f" | {row['tokens_per_sec']:8.0f} tok/s | mfu {100 * row['mfu']:5.2f}% | mem {row['memory_gib']:.2f} GiB",
                  flush=True)
        if self.jsonl:
            self.jsonl.write(json.dumps(row) + "\n")
            self.jsonl.flush()
        if self.writer:
            for key, value in row.items():
                if key != "step":
                    self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        if self.jsonl:
            self.jsonl.close()
        if self.writer:
            self.writer.close()
