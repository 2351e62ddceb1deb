"""What each rank is and computes: its hardware and versions, its matmul speed, and whether its
arithmetic is right (silent data corruption: a unit that returns wrong values without an error).

Every rank runs the same code on the same inputs, then the facts are gathered and compared; a
verdict names the ranks that differ. The matmuls go through `torch.matmul`.
"""

from __future__ import annotations

import hashlib
import platform
import socket

import torch
import torch.distributed as dist

from plait.doctor.report import FAIL, PASS, WARN, Check, odd_ones, rank_list, slow_ones
from plait.float8 import native_float8
from plait.hardware import data_sheet_flops, device_name, native_bf16
from plait.plan.calibration import SQUARE_SIZES, measure_compute, short_curves

SLOW_RANK = 0.5  # a rank under half the median speed of its peers: throttled, or faulty
LOW_SHARE = 0.3  # under 30% of the data sheet's peak at the largest shape: a misconfigured device


def gather(value) -> list:
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def facts(device: torch.device) -> dict:
    """What this rank is: the device model and what it computes natively, and the versions a
    job's numerics and collectives depend on."""
    versions = {"torch": torch.__version__, "python": platform.python_version()}
    if device.type == "cuda":
        versions["cuda"] = torch.version.cuda
        versions["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    else:
        versions["backend"] = "gloo"
    kind = device_name(device) + ("" if device.type == "cuda" else f" ({torch.backends.cpu.get_cpu_capability()})")
    return {"host": socket.gethostname(), "device": kind, "bf16": native_bf16(device)[0],
            "float8": native_float8(device)[0], "versions": versions}


def hardware_checks(every: list[dict]) -> list[Check]:
    versions = [tuple(sorted(f["versions"].items())) for f in every]
    odd = odd_ones(versions)
    def spelled(rank: int) -> str:
        return ", ".join(f"{k} {v}" for k, v in every[rank]["versions"].items())

    text = spelled(0) if not odd else "; ".join(f"rank {r}: {spelled(r)}" for r in odd) + \
        f"; the others: {spelled(next(r for r in range(len(every)) if r not in odd))}"
    checks = [Check("hardware: versions", text, "the same on every rank", FAIL if odd else PASS, odd,
                    {"per_rank": [f["versions"] for f in every]})]
    kinds = [(f["device"], f["bf16"], f["float8"]) for f in every]
    odd = odd_ones(kinds)
    counts: dict = {}
    for kind in kinds:
        counts[kind] = counts.get(kind, 0) + 1
    text = "; ".join(f"{n}x {name}: bf16 {'native' if bf16 else 'emulated'}, float8 {'native' if f8 else 'emulated'}"
                     for (name, bf16, f8), n in counts.items())
    # A job runs at its slowest rank's pace, and ranks of other models round differently.
    checks.append(Check("hardware: devices", text, "one device model", FAIL if odd else PASS, odd,
                        {"per_rank": [{k: f[k] for k in ("host", "device", "bf16", "float8")} for f in every]}))
    return checks


def compute_checks(device: torch.device, seconds: float) -> list[Check]:
    """Each rank's matmul speed (the best of its curve) per dtype; every compute number `plait
    plan --calibration` uses (matmul and memory speed by size, time per operator) in the data."""
    numbers = gather(measure_compute(device, seconds))
    checks = []
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        every = [max(rate for _, rate in n["matmul"][name]) for n in numbers]
        slow = slow_ones(every, SLOW_RANK)
        median = sorted(every)[len(every) // 2]
        slowest = every.index(min(every))
        text = f"median {median / 1e12:.3g} TFLOP/s per rank, slowest rank {slowest}: {every[slowest] / 1e12:.3g}"
        threshold = f"every rank >= {SLOW_RANK}x the median"
        peak = (data_sheet_flops(device, dtype) or (None,))[0]
        low = False
        if peak:
            text += f" ({median / peak:.0%} of the data sheet's {peak / 1e12:.4g})"
            threshold += f", median >= {LOW_SHARE:.0%} of peak"
            low = median < LOW_SHARE * peak
        if slow:
            text += "; slow: " + ", ".join(f"rank {r} {every[r] / 1e12:.3g}" for r in slow)
        # which sizes it measured: a short budget stops before the large ones, whose speed is the device's
        short = short_curves({name: numbers[len(numbers) // 2]["matmul"][name]}, device.type == "cuda")
        text += f"; measured {short} (a longer --budget_seconds measures the rest)" if short else \
            f"; measured at n={', '.join(str(n) for n in SQUARE_SIZES[device.type == 'cuda'])}"
        checks.append(Check(f"compute: {name} matmul", text, threshold, WARN if slow or low or short else PASS, slow,
                            {"flops_per_rank": every, "peak": peak, **({"calibration_per_rank": numbers} if
                                                                        dtype == torch.float32 else {})}))
    return checks


def exact_matmul(device: torch.device, dtype: torch.dtype) -> int:
    """Wrong elements of a matmul whose exact answer is known: small integers, whose products and
    sums every device represents exactly in `dtype` whatever its summation order (fp32: entries
    in [-8, 8], sums < 2^24; bf16: entries in {-1, 0, 1} over 256 terms, sums <= 256). The
    reference is the exact answer (float64), so it holds for any device, and a lone rank can be
    judged without peers."""
    m = 2048 if device.type == "cuda" else 512  # the exact answer is computed on the host
    k, bound = (m, 8) if dtype == torch.float32 else (256, 1)
    generator = torch.Generator().manual_seed(1234)
    a = torch.randint(-bound, bound + 1, (m, k), generator=generator).double()
    b = torch.randint(-bound, bound + 1, (k, m), generator=generator).double()
    expected = (a @ b).to(dtype)
    got = torch.matmul(a.to(device, dtype), b.to(device, dtype)).cpu()
    return int((got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)
                != expected.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)).sum())


def digest(tensor: torch.Tensor) -> str:
    bits = tensor.detach().cpu().contiguous()
    return hashlib.sha256(bits.view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def random_matmul(device: torch.device, dtype: torch.dtype) -> tuple[str, str]:
    """Digests of one matmul of fixed random inputs, computed twice: a rank whose two answers
    differ is faulty by itself; one whose answer differs from its peers' (same device model and
    kernels) is faulty against them."""
    m = 4096 if device.type == "cuda" else 512
    generator = torch.Generator().manual_seed(4321)
    a = torch.randn(m, m, generator=generator).to(device, dtype)
    b = torch.randn(m, m, generator=generator).to(device, dtype)
    return digest(torch.matmul(a, b)), digest(torch.matmul(a, b))


def corruption_checks(device: torch.device, every_fact: list[dict]) -> list[Check]:
    exact = gather({str(dtype).removeprefix("torch."): exact_matmul(device, dtype)
                    for dtype in (torch.float32, torch.bfloat16)})
    wrong = [rank for rank, counts in enumerate(exact) if any(counts.values())]
    text = "every rank exact" if not wrong else "; ".join(
        f"rank {r}: " + ", ".join(f"{n} wrong {dtype} elements" for dtype, n in exact[r].items() if n) for r in wrong)
    checks = [Check("corruption: exact matmuls", text, "bitwise equal to the exact answer (fp32, bf16)",
                    FAIL if wrong else PASS, wrong, {"wrong_elements_per_rank": exact})]
    answers = gather({str(dtype).removeprefix("torch."): random_matmul(device, dtype)
                      for dtype in (torch.float32, torch.bfloat16)})
    unstable = [rank for rank, a in enumerate(answers) if any(first != second for first, second in a.values())]
    differ = peers_differ(every_fact, [tuple(first for first, _ in a.values()) for a in answers])
    bad = sorted(set(unstable) | set(differ))
    text = "every rank gave the same bits twice, and its peers' bits" if not bad else "; ".join(
        filter(None, [unstable and f"{rank_list(unstable)} gave two answers to one matmul",
                      differ and f"{rank_list(differ)} disagreed with the same device model"]))
    checks.append(Check("corruption: random matmuls", text, "bitwise equal across ranks of one device model",
                        FAIL if bad else PASS, bad, {"digests_per_rank": answers}))
    return checks


def peers_differ(every_fact: list[dict], values: list) -> list[int]:
    """The ranks whose value differs from their peers' of the same device model (other models
    run other kernels, whose bits may differ rightly)."""
    groups: dict[str, list[int]] = {}
    for rank, fact in enumerate(every_fact):
        groups.setdefault(fact["device"], []).append(rank)
    differ = []
    for ranks in groups.values():
        if len(ranks) > 1:
            differ += [ranks[i] for i in odd_ones([values[r] for r in ranks])]
    return sorted(differ)
