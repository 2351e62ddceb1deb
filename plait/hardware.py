"""What this machine computes natively, and how fast: the facts precision and MFU rest on.

bf16 is only worth asking for where the hardware multiplies in it: on an AVX2-only CPU oneDNN
emulates bf16 matmuls 60-280x slower than fp32, so `mixed_precision_param auto` picks fp32
there. MFU divides by a peak measured on the model's own linear layers (or a data sheet for
known GPUs), so a model cannot outrun its own denominator.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from plait.cache import cache_dir, cached_file
from plait.config import ConfigError

# Dense peak TFLOP/s (bf16 tensor cores, fp32 without TF32) from the vendors' data sheets, matched
# against torch.cuda.get_device_name() in order: the first pattern found in the name wins, so
# specific names come before the generic ones. "NVIDIA H100 80GB HBM3" is the SXM card, "NVIDIA
# H100 PCIe" and "NVIDIA H100 NVL" are not.
GPU_PEAK_TFLOPS = [
    ("B200", 2250.0, 80.0),
    ("GH200", 989.5, 66.9),
    ("H200", 989.5, 66.9),
    ("H100 PCIe", 756.0, 51.2),
    ("H100 NVL", 835.5, 60.0),
    ("H100", 989.5, 66.9),  # SXM: "H100 80GB HBM3", "H100 SXM5"
    ("H800", 989.5, 66.9),
    ("A100", 312.0, 19.5),  # SXM and PCIe share the dense bf16 peak
    ("L40S", 362.0, 91.6),
    ("A10G", 70.0, 31.2),
    ("RTX 4090", 165.2, 82.6),
]


def pick_device(device: str) -> torch.device:
    """`training.device`: auto = CUDA when present, else CPU."""
    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")



def local_ranks_warning(nproc: int, device: str) -> str:
    """What to say before `nproc` ranks start on this machine: a warning where they outnumber its
    CPU cores ("" where they do not). Oversubscribed cores are legitimate (a test of a world-4
    layout on a laptop) but slow. On CUDA each rank takes the GPU of its local rank, so more ranks
    than GPUs cannot start: ConfigError."""
    if pick_device(device).type == "cuda":
        if nproc > (gpus := torch.cuda.device_count()):
            raise ConfigError(f"nproc: {nproc} ranks need a GPU each, this machine has {gpus} "
                              "(training.device cpu runs them on CPU cores)")
        return ""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if nproc <= cores:
        return ""
    return (f"nproc: {nproc} ranks on {cores} CPU core{'s' * (cores > 1)} share {'them' if cores > 1 else 'it'}: "
            f"fine for a test, slower than {cores} rank{'s' * (cores > 1)} for training")

def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def native_bf16(device: torch.device) -> tuple[bool, str]:
    """Whether `device` multiplies bf16 in hardware, and why (for the start-up line)."""
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return True, f"{device_name(device)} has bf16 tensor cores"
        return False, f"{device_name(device)} has no bf16 tensor cores (compute capability < 8.0)"
    isa = torch.backends.cpu.get_cpu_capability()
    # oneDNN's own answer honours ONEDNN_MAX_CPU_ISA; cpuinfo's flags say which unit does the work.
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        if torch.cpu._is_amx_tile_supported():
            return True, f"this CPU ({isa}) has AMX bf16 units"
        if torch.cpu._is_avx512_bf16_supported():
            return True, f"this CPU ({isa}) has AVX512-BF16"
        if platform.machine() not in ("x86_64", "AMD64"):
            return True, f"oneDNN has native bf16 kernels for this {platform.machine()} CPU"
    return False, f"this CPU ({isa}) has neither AMX nor AVX512-BF16, so bf16 matmuls would be emulated"


def linear_shapes(weights: list[tuple[int, int]], tokens: int) -> list[tuple[int, int, int]]:
    """(tokens, in, out) of each distinct linear layer of weight (out, in) on `tokens` rows."""
    return sorted({(tokens, inp, out) for out, inp in weights})


def measure_peak(device: torch.device, dtype: torch.dtype, shapes: list[tuple[int, int, int]],
                 seconds_per_shape: float = 0.1) -> float:
    """The best FLOP/s of a linear layer's training step (forward, input and weight gradient:
    6 x tokens x in x out FLOPs) over the model's layer shapes: the ops, kernels and layouts
    the model itself runs, so a whole step (those matmuls plus slower ops) cannot beat it.
    Each shape repeats within a time budget and keeps its best round, which filters out the
    first call's warm-up and moments when other processes held the cores; a shape slower than
    the budget (emulated bf16) is measured by its one round."""
    best = 0.0
    for tokens, inp, out in shapes:
        x = torch.randn(tokens, inp, device=device).to(dtype).requires_grad_()
        w = torch.randn(out, inp, device=device).to(dtype).requires_grad_()
        grad = torch.randn(tokens, out, device=device).to(dtype)
        spent = 0.0
        while spent < seconds_per_shape:
            x.grad = w.grad = None
            begin = time.perf_counter()
            F.linear(x, w).backward(grad)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            elapsed = time.perf_counter() - begin
            spent += elapsed
            best = max(best, 6 * tokens * inp * out / elapsed)
    return best


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-")[:60]


def peak_cache_file(device: torch.device, dtype: torch.dtype, shapes: list[tuple[int, int, int]]) -> Path:
    """Per machine model, device type, dtype, thread count and shape set: a shared $HOME can
    serve several machines, and each thread count and model has its own practical peak."""
    key = f"{device_name(device)}|{torch.backends.cpu.get_cpu_capability()}|{shapes}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:10]
    return cache_dir() / (f"peak-{device.type}-{_slug(device_name(device))}-{str(dtype).removeprefix('torch.')}"
                          f"-{torch.get_num_threads()}threads-{digest}.json")


@dataclass(frozen=True)
class Peak:
    flops: float  # matmul FLOP/s of one device
    source: str  # where the number came from, for the start-up line
    cache: Path | None = None  # the file a measured peak is cached in

    def __str__(self) -> str:
        return f"peak {self.flops / 1e12:.3g} TFLOP/s per device ({self.source})"


def data_sheet_flops(device: torch.device, dtype: torch.dtype) -> tuple[float, str] | None:
    """(the data sheet's peak FLOP/s in `dtype`, its source) for a GPU plait knows, else None."""
    if device.type == "cuda":
        name = device_name(device)
        for pattern, bf16, fp32 in GPU_PEAK_TFLOPS:
            if pattern in name:
                return (fp32 if dtype == torch.float32 else bf16) * 1e12, f"data sheet, {pattern}"
    return None


def peak_flops(device: torch.device, dtype: torch.dtype, shapes: list[tuple[int, int, int]]) -> Peak:
    """Peak matmul FLOP/s of one device in `dtype`: a data sheet for known GPUs, else measured
    once on the model's linear layers and cached."""
    if sheet := data_sheet_flops(device, dtype):
        return Peak(*sheet)
    path = peak_cache_file(device, dtype, shapes)
    flops = cached_file(path, lambda: measure_peak(device, dtype, shapes),
                        lambda value, tmp: tmp.write_text(json.dumps(value)), lambda p: json.loads(p.read_text()))
    return Peak(flops, f"the model's fastest linear layer here, measured once, cached in {path}", path)
