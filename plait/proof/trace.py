"""Profiler traces: capture a few steps per rank, then say which collectives ran where.

`StepProfiler` wraps the profiled steps in `torch.profiler.profile` and writes one Chrome trace
per rank (open it in Perfetto). `summarise` reads them back and lists every collective by phase,
kind, dtype and size, so `plait trace DIR --expect ...` can check a layout's communication
instead of trusting it.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import math
import re
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import torch
import torch.distributed as dist
import tyro

from plait.arguments import parse
from plait.config import ConfigError, Profiling

PHASES = ("forward", "backward", "optimizer", "step")  # "step": outside those three (loss, grad norm)
# Op name (after the namespace, underscores dropped) prefix -> kind. c10d::* ops are what FSDP2,
# DDP and torch.distributed issue; _c10d_functional::* are DTensor's (TP, SimpleFSDP).
KIND_PREFIXES = (("allgather", "all_gather"), ("reducescatter", "reduce_scatter"), ("allreduce", "all_reduce"),
                 ("broadcast", "broadcast"), ("send", "send"), ("recv", "recv"), ("alltoall", "all_to_all"))
KINDS = tuple(dict.fromkeys(kind for _, kind in KIND_PREFIXES))
# Type names as traces spell them (C++ names in "Input type", ScalarType names in NCCL's
# record_param_comms), lower-cased -> torch dtype names.
DTYPE_NAMES = {"float": "float32", "double": "float64", "half": "float16", "bfloat16": "bfloat16", "int": "int32",
               "long int": "int64", "long": "int64", "short int": "int16", "short": "int16", "signed char": "int8",
               "char": "int8", "unsigned char": "uint8", "byte": "uint8", "bool": "bool"}
DTYPE_ALIASES = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16", "fp64": "float64"}
# These return the gathered tensor instead of taking it as an argument: size = input x group size.
FUNCTIONAL_GATHERS = ("_c10d_functional::all_gather_into_tensor", "_c10d_functional::all_gather_into_tensor_coalesced")


class StepProfiler:
    """Profiles `cfg.steps` steps from `cfg.start_step`, by default from the step after the first,
    whose lazy initialisation would swamp the trace."""

    def __init__(self, cfg: Profiling, first_step: int, last_step: int, device_type: str):
        self.enabled, self.folder, self.cuda = cfg.enable, Path(cfg.folder), device_type == "cuda"
        first = cfg.start_step or first_step + 1
        # A resumed run profiles what is left of the asked steps (nothing if it resumed past them).
        self.start, self.stop = max(first, first_step), min(first + cfg.steps - 1, last_step)
        self.profile = None

    @contextlib.contextmanager
    def step(self, step: int):
        if not (self.enabled and self.start <= step <= self.stop):
            yield
            return
        if step == self.start:
            activities = [torch.profiler.ProfilerActivity.CPU] + [torch.profiler.ProfilerActivity.CUDA] * self.cuda
            # record_shapes puts each op's input dtypes and sizes in the trace: what `summarise` reads.
            self.profile = torch.profiler.profile(activities=activities, record_shapes=True)
            self.profile.start()
        with torch.profiler.record_function(f"step {step}"):
            yield
        if step == self.stop:
            if self.cuda:
                torch.cuda.synchronize()  # the last step's kernels belong in the trace
            self.profile.stop()
            self._write()

    def _write(self) -> None:
        rank, world = dist.get_rank(), dist.get_world_size()
        self.folder.mkdir(parents=True, exist_ok=True)
        self.profile.export_chrome_trace(str(self.folder / f"rank{rank}.json"))
        if rank == 0:
            # A reused folder may hold an earlier, larger job's ranks, which `summarise` would mix in.
            for r, path in rank_files(self.folder).items():
                if r >= world:
                    path.unlink()
            print(f"plait: profiled steps {self.start}-{self.stop}, one trace per rank in {self.folder} "
                  f"(open in Perfetto, or: plait trace {self.folder})", flush=True)


@dataclass(frozen=True)
class Collective:
    phase: str
    kind: str
    dtype: str  # "?" where the trace does not say
    group: str  # process group description (mesh dimension), "?" where the trace does not say
    bytes: int | None  # the full buffer: gathered output, scattered input, reduced tensor


def _kind(name: str, namespaces=("c10d", "_c10d_functional")) -> str | None:
    """The kind of a collective op; None for anything else (wait_tensor, barrier)."""
    namespace, _, op = name.partition("::")
    if namespace not in namespaces:
        return None
    return next((kind for prefix, kind in KIND_PREFIXES if op.replace("_", "").startswith(prefix)), None)


def _dtype(type_name: str) -> str | None:
    return DTYPE_NAMES.get(type_name.removeprefix("c10::").lower())


def _shapes(dims) -> list[list[int]]:
    """The tensor shapes in one argument's dims: a tensor's [d0, d1] or a tensor list's [[..], [..]]."""
    if not dims or all(isinstance(d, int) for d in dims):
        return [dims]
    return [shape for d in dims for shape in _shapes(d)]


def _bytes(op: dict, dtype: str) -> int | None:
    args = op["args"]
    if dtype == "?" or "Input Dims" not in args:
        return None
    # Elements per tensor argument (a list's summed): the largest is the full buffer.
    numel = max((sum(map(math.prod, _shapes(dims))) for dims, kind in zip(args["Input Dims"], args["Input type"])
                 if kind and kind != "Scalar"), default=0)
    if op["name"] in FUNCTIONAL_GATHERS:
        numel *= int(args["Concrete Inputs"][1])
    return numel * getattr(torch, dtype).itemsize


def _events(path: Path) -> list[dict]:
    """A trace's complete events ("ph": "X")."""
    try:
        return [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]
    except (ValueError, KeyError, TypeError):  # e.g. a rank that died while writing it
        raise ConfigError(f"folder: {path} is not a complete Chrome trace") from None


def _annotations(events: list[dict]) -> tuple[list[dict], list[dict]]:
    """(every record_function range, the `step N` ranges among them)."""
    annotations = [e for e in events if e.get("cat") == "user_annotation"]
    return annotations, [e for e in annotations if re.fullmatch(r"step \d+", e["name"])]


def read_trace(path: Path) -> tuple[int, list[Collective]]:
    """One rank's trace: (profiled steps, its collectives)."""
    events = _events(path)
    annotations, step_ranges = _annotations(events)
    steps = len(step_ranges)
    # Phase by time, not by thread: on CUDA, backward runs on autograd's device thread while the
    # "backward" range is on the main thread that waits for it.
    spans = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in annotations if e["name"] in PHASES)
    starts = [start for start, _, _ in spans]
    # A DTensor collective shows as _c10d_functional::x around c10d::x_: count the outermost only.
    ops, outer_end = [], defaultdict(float)
    for e in sorted((e for e in events if e.get("cat") == "cpu_op"), key=lambda e: (e["tid"], e["ts"], -e["dur"])):
        if _kind(e["name"]) and e["ts"] >= outer_end[e["tid"]]:
            ops.append(e)
            outer_end[e["tid"]] = e["ts"] + e["dur"]
    # NCCL annotates each collective with a nested record_param_comms event (dtype, process group).
    comms = [e for e in events if e["name"] == "record_param_comms"]
    # gloo runs collectives on worker threads ("gloo:all_reduce"), each with its tensor's dtype.
    gloo = sorted((e for e in events if e["name"].startswith("gloo:")), key=lambda e: e["ts"])
    collectives = []
    for op in sorted(ops, key=lambda e: e["ts"]):
        kind, end = _kind(op["name"]), op["ts"] + op["dur"]
        comm = next((c["args"] for c in comms if c["tid"] == op["tid"] and op["ts"] <= c["ts"] <= end), {})
        dtype = (next(filter(None, map(_dtype, op["args"].get("Input type", []))), None)
                 or _dtype(comm.get("dtype", "")) or _gloo_dtype(op, kind, gloo) or "?")
        i = bisect.bisect_right(starts, op["ts"]) - 1
        phase = spans[i][2] if i >= 0 and op["ts"] <= spans[i][1] else _p2p_phase(kind, i, spans)
        group = comm.get("Process Group Description", "?").removeprefix("mesh_")
        collectives.append(Collective(phase, kind, dtype, group, _bytes(op, dtype)))
    return steps or 1, collectives


def _p2p_phase(kind: str, before: int, spans: list[tuple]) -> str:
    """A pipeline's sends and receives run between a stage's forward and backward chunks: a
    send carries what the chunk before it computed (activations after a forward, gradients
    after a backward), a receive what the chunk after it needs. Anything else between phases
    is "step"."""
    neighbour = before if kind == "send" else before + 1
    if kind in ("send", "recv") and 0 <= neighbour < len(spans) and spans[neighbour][2] in ("forward", "backward"):
        return spans[neighbour][2]
    return "step"


def _gloo_dtype(op: dict, kind: str, gloo: list[dict]) -> str | None:
    """The dtype of a tensor-list op (allreduce_, broadcast_), which the trace calls "TensorList":
    that of the first unclaimed gloo worker event of its kind and shape after it started."""
    shapes = _shapes(op["args"].get("Input Dims", [[]])[0])
    for event in gloo:
        if (event["ts"] >= op["ts"] and not event.get("claimed") and event["args"]["Input Dims"][0] in shapes
                and _kind(event["name"].replace(":", "::"), ("gloo",)) == kind):
            event["claimed"] = True
            return _dtype(event["args"]["Input type"][0])
    return None


def covered(events: list[dict]) -> float:
    """Microseconds the events' ranges cover together (their union: no time counts twice)."""
    busy, end = 0.0, -math.inf
    for start, stop in sorted((e["ts"], e["ts"] + e["dur"]) for e in events):
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    return busy


def idle_fractions(folder: str | Path) -> dict[int, float]:
    """Per rank, the share of the profiled steps spent outside forward and backward: for a
    pipeline its bubble (waiting for a neighbour stage), plus the optimizer and bookkeeping."""
    idle = {}
    for rank, path in rank_files(Path(folder)).items():
        annotations, steps = _annotations(_events(path))
        total = sum(e["dur"] for e in steps)
        busy = covered([e for e in annotations if e["name"] in ("forward", "backward")])
        idle[rank] = 1 - busy / total if total else math.nan
    return idle


def eager_fraction(folder: str | Path, rank: int = 0) -> float:
    """A compiled run's share of its profiled steps spent outside compiled graphs (rank `rank`'s):
    what runs eagerly around them (sharding's hooks and collectives, the optimizer, the step's own
    work). Inside: dynamo's regions in forward (`Torch-Compiled Region`) and the compiled backward."""
    events = _events(rank_files(Path(folder))[rank])
    _, steps = _annotations(events)
    total = sum(e["dur"] for e in steps)
    inside = covered([e for e in events if e["name"].startswith("Torch-Compiled Region")
                      or e["name"] == "CompiledFunctionBackward"])
    return 1 - inside / total if total else math.nan


def phase_seconds(folder: str | Path, phase: str, rank: int = 0) -> float:
    """A rank's seconds per profiled step in one phase (forward, backward, optimizer)."""
    annotations, steps = _annotations(_events(rank_files(Path(folder))[rank]))
    return sum(e["dur"] for e in annotations if e["name"] == phase) / 1e6 / max(1, len(steps))


def rank_files(folder: Path) -> dict[int, Path]:
    return {int(m[1]): p for p in folder.glob("rank*.json") if (m := re.fullmatch(r"rank(\d+)\.json", p.name))}


def load(folder: str | Path, rank: int | None = None) -> dict[int, tuple[int, list[Collective]]]:
    """rank -> (profiled steps, collectives) for the traces in `folder` (or only `rank`'s)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ConfigError(f"folder: {str(folder)!r} does not exist (write traces with --profiling.enable "
                          f"--profiling.folder {folder})")
    paths = {r: p for r, p in rank_files(folder).items() if rank in (None, r)}
    if not paths:
        raise ConfigError(f"folder: no trace {'rank*' if rank is None else f'rank{rank}'}.json in {folder}")
    return {r: read_trace(path) for r, path in sorted(paths.items())}


def summarise(folder: str | Path, rank: int | None = None) -> list[dict]:
    """One row per (phase, kind, dtype, group): on how many ranks it ran, calls and bytes per rank and step."""
    return _rows(load(folder, rank))


def _rows(traces: dict[int, tuple[int, list[Collective]]]) -> list[dict]:
    by_key: dict = defaultdict(lambda: defaultdict(list))  # (phase, kind, dtype, group) -> rank -> calls
    for r, (_, collectives) in traces.items():
        for c in collectives:
            by_key[(c.phase, c.kind, c.dtype, c.group)][r].append(c)
    rows = []
    for key in sorted(by_key, key=lambda k: (PHASES.index(k[0]), k[1:])):
        rank_steps = sum(traces[r][0] for r in by_key[key])
        calls = [c for cs in by_key[key].values() for c in cs]
        total = None if any(c.bytes is None for c in calls) else sum(c.bytes for c in calls)
        rows.append({**dict(zip(("phase", "kind", "dtype", "group"), key)), "ranks": len(by_key[key]),
                     "calls_per_step": len(calls) / rank_steps,
                     "bytes_per_step": None if total is None else total / rank_steps})
    return rows


@dataclass(frozen=True)
class Expectation:
    """`phase:kind:dtype` ran in that dtype, `phase:kind` ran, `phase:!kind` did not run; a
    suffix `=N` on the first two: exactly N calls per step (in that dtype)."""

    spec: str
    phase: str
    kind: str
    dtype: str | None
    present: bool
    calls: int | None = None

    @classmethod
    def parse(cls, spec: str) -> Expectation:
        body, _, count = spec.partition("=")
        phase, _, rest = body.partition(":")
        kind, _, dtype = rest.partition(":")
        present, kind, dtype = not kind.startswith("!"), kind.removeprefix("!"), DTYPE_ALIASES.get(dtype, dtype)
        if phase not in PHASES or kind not in KINDS or (dtype and (not present or dtype not in DTYPE_NAMES.values())) \
                or (count and (not present or not count.isdigit())):
            raise ConfigError(f"expect: {spec!r} is not phase:kind:dtype, phase:kind or phase:!kind (the first two "
                              f"optionally =N calls per step); phases: {', '.join(PHASES)}; kinds: {', '.join(KINDS)}; "
                              f"dtypes: {', '.join(sorted(set(DTYPE_NAMES.values())))} (or bf16, fp32, fp16)")
        return cls(spec, phase, kind, dtype or None, present, int(count) if count else None)

    def failure(self, collectives: list[Collective], steps: int) -> str | None:
        """Why this expectation fails for one rank's collectives over `steps` steps, or None when it holds."""
        found = [c.dtype for c in collectives if (c.phase, c.kind) == (self.phase, self.kind)]
        if not self.present:
            return f"ran {len(found)} times" if found else None
        if not found:
            return "did not run"
        if self.dtype and self.dtype not in found:
            return "ran only in " + ", ".join(f"{d} x{found.count(d)}" for d in sorted(set(found)))
        counted = [d for d in found if self.dtype in (None, d)]
        if self.calls is not None and len(counted) != self.calls * steps:
            return f"ran {len(counted) / steps:g} times per step"
        return None


@dataclass
class TraceArgs:
    folder: Annotated[str, tyro.conf.Positional, tyro.conf.arg(metavar="DIR")]
    """a profiling.folder: one rank{R}.json per rank"""
    # Appended, one SPEC per --expect: a repeated --expect must not silently replace the earlier one.
    expect: Annotated[tuple[str, ...], tyro.conf.UseAppendAction, tyro.conf.arg(metavar="SPEC")] = ()
    """phase:kind:dtype (ran in that dtype), phase:kind (ran) or phase:!kind (did not run), on every rank;
    =N after the first two: N calls per step"""
    rank: Annotated[int | None, tyro.conf.arg(metavar="R")] = None
    """summarise and check this rank only; default: every rank"""


def main(argv: list[str]) -> int:
    opts = parse(TraceArgs, argv, "plait trace")
    expectations = [Expectation.parse(spec) for spec in opts.expect]
    traces = load(opts.folder, opts.rank)
    steps = "/".join(sorted({str(steps) for steps, _ in traces.values()}))
    print(f"plait trace {opts.folder}: {len(traces)} rank(s) x {steps} step(s); calls and bytes per rank and step")
    table = [("phase", "kind", "dtype", "group", "ranks", "calls", "bytes")]
    table += [(r["phase"], r["kind"], r["dtype"], r["group"], str(r["ranks"]), f"{r['calls_per_step']:g}",
               _human(r["bytes_per_step"])) for r in _rows(traces)]
    widths = [max(map(len, column)) for column in zip(*table)]
    for row in table:  # text left, numbers right
        print("  ".join(c.ljust(w) if i < 4 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip())
    failures = [f"{e.spec}: rank {r}: {why}" for e in expectations for r, (steps, collectives) in traces.items()
                if (why := e.failure(collectives, steps))]
    for failure in failures:
        print(f"plait trace: expectation failed: {failure}", file=sys.stderr)
    if expectations and not failures:
        print(f"plait trace: {len(expectations)} expectation(s) hold on {len(traces)} rank(s)")
    return 1 if failures else 0


def _human(size: float | None) -> str:
    if size is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.3g} {unit}"
        size /= 1024
