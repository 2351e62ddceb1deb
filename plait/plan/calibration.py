"""What a device computes and moves per second: the numbers `plait plan` turns shapes into time.

A calibration comes from one of three places, and says which:
- `plait doctor --json FILE` on the real machine (`plait plan --calibration FILE`): matmul
  speed by size and dtype, element-wise memory speed by size, the host's time per operator
  (dispatch and autograd, measured on a tiny model's training step), and each collective's
  bus bandwidth by message size, within a node and across nodes;
- `--device cpu`: the same compute numbers measured here, in this process (collectives are
  then gloo on one host, at stated defaults);
- `--device h100|h200|b200`: the data sheet, with stated efficiencies (DATA_SHEETS).
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from plait.config import ConfigError
from plait.hardware import GPU_PEAK_TFLOPS, device_name, native_bf16
from plait.plan.host import measure_host
from plait.plan.timing import timed

Curve = list[tuple[float, float]]  # (size, rate) points, sizes ascending


@dataclass
class Calibration:
    device: str
    """the device the numbers describe"""
    source: str
    """where they came from"""
    matmul: dict[str, Curve]
    """dtype (float32, bfloat16; float8 where the device has `torch._scaled_mm`) -> (FLOPs of one
    matmul, FLOP/s) per rank"""
    memory: Curve
    """(bytes one element-wise op reads and writes, bytes/s) per rank"""
    op_seconds: float
    """host time per operator a training step runs (dispatch, autograd), beside its work"""
    collectives: dict[str, Curve]
    """kind -> (message bytes, bus bandwidth bytes/s) within a node"""
    inter_node: dict[str, Curve]
    """kind -> (message bytes, bus bandwidth bytes/s) across nodes"""
    latency: float
    """seconds of one small message between two ranks"""
    asynchronous: bool
    """a GPU: the host queues operators ahead of the device, collectives run beside compute"""
    cpu_share: float = 0.0
    """on a CPU: the cores each rank had while the compute numbers were measured (0 on a GPU)"""
    cores: int = 0
    """on a CPU: the cores of one node"""
    peak: dict[str, float] = field(default_factory=dict)
    """dtype -> the FLOP/s MFU divides by (a data sheet's, else the fastest matmul measured)"""
    native_bf16: bool = True
    """whether the device multiplies in bf16 (what `mixed_precision_param auto` picks)"""
    elementwise: dict[str, float] = field(default_factory=dict)
    """dtype -> bytes/s of element-wise work measured in a block of the job's model (else `memory`, as on GPUs)"""
    short: str = ""
    """the matmul curves a short budget stopped before their largest size (their speeds understate the device)"""
    host_link: float = 0.0
    """bytes/s of one rank's copies between pinned host memory and its GPU, the slower way (0: unknown, or a CPU)"""
    host_step: float = 0.0
    """parameters/s a node's host clips and steps with fused AdamW, its ranks together (plait/plan/host.py)"""

    def compute_bytes(self, param: str) -> int:
        """Bytes per element of the compute dtype `training.mixed_precision_param` asks for here."""
        return 2 if param == "bfloat16" or (param == "auto" and self.native_bf16) else 4

    def rate(self, dtype: str, flops: float, share: float) -> float:
        """FLOP/s of one matmul of `flops` FLOPs on a rank with `share` cores (CPU)."""
        return at(self.matmul[dtype], flops) * self.scale(share)

    def peak_of(self, dtype: str) -> float:
        """The fastest matmul of `dtype` the calibration holds."""
        return max(rate for _, rate in self.matmul[dtype])

    def bandwidth(self, nbytes: float, share: float) -> float:
        return at(self.memory, nbytes) * self.scale(share)

    def elementwise_rate(self, dtype: str, nbytes: float, share: float) -> float:
        rate = self.elementwise.get(dtype) or self.elementwise.get("float32")
        return (rate if rate else at(self.memory, nbytes)) * self.scale(share)

    def scale(self, share: float) -> float:
        """Compute on a CPU grows with the cores a rank has (a stated assumption: linearly)."""
        return share / self.cpu_share if self.cpu_share and share else 1.0


def at(curve: Curve, x: float) -> float:
    """The rate at size `x`, interpolated log-log between measured points, flat beyond them."""
    if x <= curve[0][0]:
        return curve[0][1]
    for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
        if x <= x1:
            w = math.log(x / x0) / math.log(x1 / x0)
            return math.exp((1 - w) * math.log(y0) + w * math.log(y1))
    return curve[-1][1]


GB = 1e9
# Data sheets (dense bf16 / fp32 TFLOP/s, HBM TB/s, NVLink GB/s per direction, network GB/s per
# GPU) and the efficiencies plan assumes where nothing was measured: large matmuls reach 70% of
# the peak (half at 1/64 of the FLOPs of a 8192^3 product), element-wise ops 80% of HBM,
# collectives 80% of the link, 8 us per operator the host queues and 10 us per message.
# The peaks are plait.hardware's table (what MFU divides by), found by the name given here.
DATA_SHEETS = {
    "h100": ("H100 SXM", "H100", 3.35, 450.0, 50.0),
    "h200": ("H200 SXM", "H200", 4.8, 450.0, 50.0),
    "b200": ("B200", "B200", 8.0, 900.0, 100.0),
}
MATMUL_EFFICIENCY, MEMORY_EFFICIENCY, LINK_EFFICIENCY = 0.7, 0.8, 0.8
# The host of an 8-GPU node: PCIe Gen5 x16 per GPU (GB/s each way), and DDR5 over two sockets (GB/s) shared by
# the ranks on the node, which step AdamW at 40 bytes a parameter (plait/plan/speed.py's ADAMW_BYTES).
PCIE_GBPS, HOST_MEMORY_GBPS, HOST_STEP_BYTES = 64.0, 600.0, 40
FLOAT8_SPEEDUP = 2  # dense float8 TFLOP/s over bf16's on every data sheet here (H100 SXM: 1979 / 989.5)
GPU_OP_SECONDS, GPU_LATENCY = 8e-6, 10e-6
# gloo between processes of one host, where no doctor measured it: bus bandwidth and latency.
GLOO_BUSBW, GLOO_LATENCY = 0.5 * GB, 100e-6
# nccl-tests' bus bandwidth: algorithm bandwidth x this factor of the group size n is what each
# link carries (github.com/NVIDIA/nccl-tests, doc/PERFORMANCE.md)
BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
              "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n}
KINDS = tuple(BUS_FACTOR)


def gloo_links() -> dict[str, Curve]:
    """Every collective at gloo's stated bus bandwidth, where none was measured."""
    return {kind: [(float(2**20), GLOO_BUSBW)] for kind in KINDS}


def data_sheet(name: str) -> Calibration:
    label, pattern, hbm, nvlink, network = DATA_SHEETS[name]
    bf16, fp32 = next(peaks for gpu, *peaks in GPU_PEAK_TFLOPS if gpu == pattern)
    big = 2 * 8192**3

    def curve(peak: float) -> Curve:
        return [(big / 64, peak * MATMUL_EFFICIENCY / 2 * 1e12), (big, peak * MATMUL_EFFICIENCY * 1e12)]

    def link(gbps: float) -> dict[str, Curve]:
        return {kind: [(float(2**20), gbps * LINK_EFFICIENCY * GB / 4), (float(2**28), gbps * LINK_EFFICIENCY * GB)]
                for kind in KINDS}

    return Calibration(device=label, source=f"{label} data sheet: {bf16:g} bf16 / {fp32:g} fp32 / "
                       f"{FLOAT8_SPEEDUP * bf16:g} float8 TFLOP/s, HBM "
                       f"{hbm:g} TB/s, NVLink {nvlink:g} GB/s, network {network:g} GB/s per GPU; assumed: matmuls "
                       f"{MATMUL_EFFICIENCY:.0%} of peak, memory {MEMORY_EFFICIENCY:.0%}, links {LINK_EFFICIENCY:.0%}; "
                       f"host: PCIe {PCIE_GBPS:g} GB/s, {HOST_MEMORY_GBPS:g} GB/s of memory for 8 GPUs",
                       matmul={"bfloat16": curve(bf16), "float32": curve(fp32), "float8": curve(FLOAT8_SPEEDUP * bf16)},
                       memory=[(float(2**30), hbm * 1e12 * MEMORY_EFFICIENCY)], op_seconds=GPU_OP_SECONDS,
                       collectives=link(nvlink), inter_node=link(network), latency=GPU_LATENCY, asynchronous=True,
                       peak={"bfloat16": bf16 * 1e12, "float32": fp32 * 1e12},
                       host_link=PCIE_GBPS * LINK_EFFICIENCY * GB,
                       host_step=HOST_MEMORY_GBPS * MEMORY_EFFICIENCY * GB / HOST_STEP_BYTES)


SQUARE_SIZES = {False: (128, 256, 512, 1024), True: (1024, 2048, 4096, 8192)}  # n of the n x n x n matmuls: CPU, GPU


def short_curves(matmul: dict[str, Curve], gpu: bool) -> str:
    """'float32 at n=128 only (of 128..1024)' for each curve that stopped before its largest size."""
    sizes = SQUARE_SIZES[gpu]
    measured = {dtype: [round((flops / 2) ** (1 / 3)) for flops, _ in curve] for dtype, curve in matmul.items()}
    return "; ".join(f"{dtype} at n={', '.join(map(str, ns))} only (of {sizes[0]}..{sizes[-1]})"
                     for dtype, ns in measured.items() if dtype != "float8" and ns and max(ns) < sizes[-1])


def square_curve(device: torch.device, seconds: float, matmuls: int, make) -> Curve:
    """(FLOPs of one n x n x n matmul, FLOP/s) from small to large, each size within its share of
    `seconds`: `make(n)` returns a call that runs `matmuls` of them. A size one call of which would
    not fit at the best rate so far (bf16 emulated on a CPU) is left out."""
    sizes = SQUARE_SIZES[device.type == "cuda"]
    curve: Curve = []
    for n in sizes:
        flops = 2.0 * n**3
        if curve and matmuls * flops / max(rate for _, rate in curve) > seconds / len(sizes):
            break  # (the best rate so far: a CPU's smallest float8 size runs far below its larger ones)
        curve.append((flops, matmuls * flops / timed(make(n), device, seconds / len(sizes))))
    return curve


def matmul_curve(device: torch.device, dtype: torch.dtype, seconds: float) -> Curve:
    """A square linear layer's three matmuls (forward, input and weight gradients: the transposed
    forms training runs) in `dtype`."""
    def linear(n: int):
        x, w, g = (torch.randn(n, n, device=device).to(dtype) for _ in range(3))
        # (torch.matmul: what the doctor's tests slow down to fake a throttled device)
        return lambda: (torch.matmul(x, w.t()), torch.matmul(g, w), torch.matmul(g.t(), x))
    return square_curve(device, seconds, 3, linear)


def float8_curve(device: torch.device, seconds: float) -> Curve:
    """A float8 matmul as torchao's tensorwise linear layer runs it: on a GPU `torch._scaled_mm`
    (e4m3 operands, one scale each, bf16 out); on a CPU the emulation plait trains with (the
    operands dequantised, multiplied in fp32: plait/float8.py); empty where the device has neither."""
    one = torch.ones((), device=device)

    def scaled(n: int):
        a, b = (torch.randn(n, n, device=device).to(torch.float8_e4m3fn) for _ in range(2))
        if device.type == "cpu":
            return lambda: torch.mm(a.float() / one, b.float().t() / one)
        # (b column-major, as the kernel wants its second operand)
        return lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    try:
        return square_curve(device, seconds, 1, scaled)
    except (RuntimeError, NotImplementedError):  # e.g. a GPU before sm89
        return []


def memory_curve(device: torch.device, seconds: float) -> Curve:
    """(bytes, bytes/s) of an element-wise add (two reads, one write) from cache-sized to large."""
    # (a CPU: from its L1 to past a 32 MiB L3; a GPU: to 1 GiB per tensor)
    counts = [1 << k for k in range(12, 25, 2)] if device.type != "cuda" else [1 << k for k in range(20, 29, 2)]
    curve: Curve = []
    for n in counts:
        a, b, c = (torch.ones(n, device=device) for _ in range(3))
        curve.append((12.0 * n, 12.0 * n / timed(lambda: torch.add(a, b, out=c), device, seconds / len(counts))))
    return curve


class Operators(TorchDispatchMode):
    """Counts the operators that do work (views and other aliases are free)."""
    FREE = {"view", "_unsafe_view", "t", "transpose", "expand", "detach", "alias", "slice", "select", "unsqueeze",
            "squeeze", "permute", "as_strided", "view_as_real", "view_as_complex", "_conj", "unbind", "split",
            "split_with_sizes", "lift_fresh", "_reshape_alias", "reshape", "chunk", "narrow"}

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.__name__.split(".")[0] not in self.FREE
        return func(*args, **(kwargs or {}))


def shrunk(args, n_layers: int, dense: bool = False):
    """The model's structure (heads, norms, biases, experts) at a few elements per dimension."""
    return replace(args, dim=8 * args.n_heads, head_dim=8, rotary_dim=4 if args.rotary_dim else 0, n_layers=n_layers, vocab_size=64, ffn_hidden=32,
                   moe_hidden=16 if args.moe_hidden else 0, dense_layers=tuple(range(n_layers)) if dense else (),
                   nope_layers=(), n_experts=0 if dense else args.n_experts, top_k=0 if dense else args.top_k)


def step_operators(args, tokens: int = 16) -> int:
    """Operators of one forward and backward of `args`'s model (on the CPU, at `args`'s shapes)."""
    from plait.models.transformer import Transformer

    torch.manual_seed(0)
    model = Transformer(args)
    batch = torch.randint(0, args.vocab_size, (1, tokens))
    with Operators() as counter:
        logits = model(batch)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch.flatten()).backward()
    return counter.count


@functools.cache
def operator_counts(args) -> tuple[int, int, int]:
    """Operators per step of (a dense block, a mixture-of-experts block, the rest), counted on
    the model's structure at tiny sizes: a count does not depend on the sizes."""
    dense1, dense2 = (step_operators(shrunk(args, n, dense=True)) for n in (1, 2))
    sparse = step_operators(shrunk(args, 2)) - step_operators(shrunk(args, 1)) if args.n_experts else 0
    return dense2 - dense1, sparse, dense1 - (dense2 - dense1)


def operator_seconds(device: torch.device, seconds: float) -> float:
    """Host time per operator: a training step of a tiny model (work negligible) over its operators."""
    from plait.models.flavors import FLAVORS
    from plait.models.transformer import Transformer

    args = shrunk(replace(FLAVORS["debug"], vocab_size=64), 2, dense=True)
    model = Transformer(args).to(device)
    batch = torch.randint(0, 64, (1, 16), device=device)

    def step():
        logits = model(batch)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch.flatten()).backward()

    return timed(step, device, seconds, at_least=5) / step_operators(args)


def local_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cpu_share(threads: int, ranks_here: int, cores: int = 0) -> float:
    """Cores a CPU rank computes on: its threads (0: the node's `cores` split evenly, as plait
    train sets them), or its part of the cores when ranks x threads exceed them."""
    cores = cores or local_cores()
    return min(float(threads or max(1, cores // ranks_here)), cores / ranks_here)


def measure_compute(device: torch.device, seconds: float) -> dict:
    """Every compute number of a calibration, measured on this rank (for `plait doctor --json`)."""
    dtypes = (torch.float32, torch.bfloat16)
    matmul = {str(d).removeprefix("torch."): matmul_curve(device, d, seconds * 0.3) for d in dtypes}
    if eight := float8_curve(device, seconds * 0.1):
        matmul["float8"] = eight
    return {"matmul": matmul, "memory": memory_curve(device, seconds * 0.2),
            "op_seconds": operator_seconds(device, seconds * 0.1),
            "cpu_share": 0.0 if device.type == "cuda" else float(torch.get_num_threads()),
            "cores": local_cores(), **measure_host(device, seconds * 0.1)}


def here(seconds: float = 4.0) -> Calibration:
    """`--device cpu`: this machine's compute measured now, with all its cores; gloo at stated defaults."""
    device, threads = torch.device("cpu"), torch.get_num_threads()
    torch.set_num_threads(local_cores())
    try:
        numbers = measure_compute(device, seconds)
    finally:
        torch.set_num_threads(threads)
    link = gloo_links()
    return Calibration(device=device_name(device), source=f"measured here now ({numbers['cpu_share']:g} threads); "
                       f"gloo assumed {GLOO_BUSBW / GB:g} GB/s bus bandwidth, {GLOO_LATENCY * 1e6:g} us per message",
                       collectives=link, inter_node=link, latency=GLOO_LATENCY, asynchronous=False,
                       native_bf16=native_bf16(device)[0],
                       peak={d: max(r for _, r in c) for d, c in numbers["matmul"].items()}, **numbers)


def from_doctor(path: str) -> Calibration:
    """A calibration from `plait doctor --json`'s file (its "calibration" entry)."""
    try:
        report = json.loads(Path(path).read_text())
        numbers = report["calibration"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ConfigError(f"calibration: {path} is not a plait doctor --json report ({error!r})") from None
    return Calibration(**numbers)


def doctor_calibration(device_label: str, compute: list[dict], network: dict, latency: float, nodes: int,
                       world: int, bf16: bool) -> dict:
    """The "calibration" entry of doctor's report: the median rank's compute numbers, the
    collectives' bus bandwidth by size (within a node, and across nodes where there are several)."""
    middle = sorted(compute, key=lambda c: max(r for _, r in c["matmul"]["float32"]))[len(compute) // 2]

    def curves(where: str) -> dict[str, Curve]:
        return {kind: [(row["bytes"], row["busbw"]) for row in sizes] for (w, kind), sizes in network.items() if w == where}

    within = curves("within a node") or curves("world")
    gpu = middle["cpu_share"] == 0.0
    return asdict(Calibration(
        device=device_label, source=f"plait doctor at world {world} on {nodes} node(s)", matmul=middle["matmul"],
        memory=middle["memory"], op_seconds=middle["op_seconds"], collectives=within,
        inter_node=curves("world") if nodes > 1 else within, latency=latency, asynchronous=gpu,
        cpu_share=middle["cpu_share"], cores=middle["cores"], native_bf16=bf16,
        peak={d: max(r for _, r in c) for d, c in middle["matmul"].items()}, short=short_curves(middle["matmul"], gpu),
        host_link=middle.get("host_link", 0.0), host_step=middle.get("host_step", 0.0) * world // nodes))


def load(device: str, path: str) -> Calibration:
    """`plait plan --device/--calibration`: a doctor's file wins over a named device."""
    if path:
        return from_doctor(path)
    if device == "cpu":
        return here()
    if device not in DATA_SHEETS:
        raise ConfigError(f"device: {device!r} unknown; allowed: {', '.join([*DATA_SHEETS, 'cpu'])}, or "
                          "--calibration FILE from plait doctor --json")
    return data_sheet(device)

