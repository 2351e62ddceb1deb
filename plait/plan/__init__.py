"""`plait plan`: which layouts fit a job in a device's memory, and which is fastest, before launch.

Every prediction is arithmetic on the model's shapes (parameters.py: what a rank holds, its
state; memory.py: activations, buffers; comm.py: collectives; speed.py: time), and each is checked
against a measurement in the tests (tests/test_plan.py; the time in tests/test_doctor.py):

- state: parameters + gradients + AdamW moments and step counters of one rank, from each
  parameter's local shard (TP split first, then FSDP's dim-0 chunk): equals `state_gib`.
- activations: what one micro-batch's forward leaves for backward, per activation-checkpoint
  mode, op by op, times the micro-batches a pipeline holds: within 5% of the dtype
  probe's `saved_activations`.
- communication: bytes per step of every collective (FSDP gathers and reduce-scatters, DDP
  and HSDP all-reduces, TP's sequence-parallel gathers and scatters, pipeline sends and
  receives, loss and gradient-norm reductions): equals what `plait trace` counts.
- buffers (gathered parameters, logits in flight) are an estimate;
- the step time (speed.py) prices every operator at a calibrated speed for its size (from
  `plait doctor --json`, a measurement here, or a data sheet: calibration.py), plus the
  pipeline's bubble, the optimizer and the collectives not hidden behind compute; the search
  (search.py) ranks every layout, AC mode and micro-batch size by tokens/s per device.

The first rank of each pipeline rank is predicted (without a pipeline: rank 0, what training
reports): it holds the largest FSDP chunk. A layout's row shows its largest pipeline rank.
"""

from __future__ import annotations

import json
import shlex
import sys
from dataclasses import asdict, dataclass

import torch

from plait.arguments import parse, parse_args
from plait.checks import check_sizes
from plait.config import ConfigError, JobConfig
from plait.models.args import ModelArgs
from plait.models.transformer import Transformer, num_params
from plait.hyperparameters import debug_defaults_warning, left_at_debug_defaults
from plait.job_model import model_shape
from plait.plan.calibration import DATA_SHEETS, Calibration, load
from plait.plan.search import AC_MODES, GIB, Row, predict

__all__ = ["AC_MODES", "predict", "model_shape", "main"]


@dataclass
class PlanArgs:
    """Predicted memory, communication, step time and tokens/s of every layout of a job on `world` devices,
    best first. The job is given by plait train's options (plait train --help lists them), e.g. --model.flavor llama3_8b."""

    world: int
    """ranks the job will run on (nodes x devices per node)"""
    device_memory_gib: float
    """memory of one device, GiB"""
    device: str = "h100"
    """the device's data sheet: h100, h200, b200; or cpu (this machine, measured now)"""
    calibration: str = ""
    """plait doctor --json FILE of the real machine: its measured speeds replace the data sheet's"""
    node_size: int = 8
    """devices per node: collectives of groups within a node run at the node's links"""
    host_memory_gib: float = 2048.0
    """memory of one node's host, GiB: where training.offload optimizer keeps its ranks' state (a DGX H100's 2 TB)"""
    top: int = 8
    """rows to print (the best first); 0 = all"""
    json: bool = False
    """print the header and rows as JSON instead of a table"""


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(plan's own flags, the train options). --help is plan's: it lists plan's options and points to train's."""
    own_names = {f"--{name}" for name in PlanArgs.__dataclass_fields__} | {"-h", "--help"}
    own, rest, i = [], [], 0
    while i < len(argv):
        name = argv[i].split("=", 1)[0]
        if name in own_names:
            takes_value = name not in ("--json", "-h", "--help") and "=" not in argv[i]
            own += argv[i:i + 1 + takes_value]
            i += 1 + takes_value
        else:
            rest.append(argv[i])
            i += 1
    return own, rest


def float8_timing(recipe: str, cal: Calibration) -> str:
    """How plan times a float8 recipe's matmuls with this calibration, for the header."""
    unmeasured = "MXFP8" if recipe.startswith("mxfp8") else "" if "float8" in cal.matmul else "float8"
    if unmeasured:
        return f"memory and collectives counted, its matmuls timed as the compute dtype's (no {unmeasured} speed " \
               "measured)"
    return f"the converted layers' matmuls at up to {cal.peak_of('float8') / 1e12:,.4g} TFLOP/s, their casts counted"


def assumptions(base: JobConfig, args: ModelArgs, opts: PlanArgs, cal: Calibration) -> dict:
    """What every row rests on, stated once above them."""
    t = base.training
    with torch.device("meta"):
        model = Transformer(args)
    total, active = num_params(model), num_params(model, active=True)
    compute = "bfloat16" if cal.compute_bytes(t.mixed_precision_param) == 2 else "float32"
    return {"model": f"{base.model.flavor}: {total / 1e9:.3g}B parameters" +
            (f", {active / 1e9:.3g}B active ({args.top_k} of {args.n_experts} experts)" if args.n_experts else ""),
            "batch": f"global batch {t.global_batch_size} x seq {t.seq_len} = {t.global_batch_size * t.seq_len:,} "
                     f"tokens per step, {base.model.attention_mask} attention" + growth(t),
            "precision": f"parameters in {compute} for compute, fp32 master weights, gradients reduced in "
                         f"{'bfloat16' if t.mixed_precision_reduce == 'bfloat16' else 'float32'}, {base.optimizer.name}"
                         + ("" if t.float8 == "none" else f"; float8 {t.float8}: {float8_timing(t.float8, cal)}"),
            "device": f"{opts.world} x {cal.device}, {opts.device_memory_gib:g} GiB each, {opts.node_size} per node",
            "speeds": cal.source,
            "collectives": f"{bandwidth(cal.collectives)} within a node, {bandwidth(cal.inter_node)} across nodes; "
                           + ("data parallelism overlaps compute, TP/CP/EP/PP traffic does not" if cal.asynchronous
                              else "none overlaps compute (gloo shares the cores)"),
            "experts": "routing balanced: every rank computes and sends its tokens' share" if args.n_experts else ""}


def growth(t) -> str:
    """A growing or phased run's schedule in words: the rows are its full steps (its largest)."""
    parts = [f"batch ramp {t.batch_rampup[0]} -> {t.global_batch_size} sequences over {t.batch_rampup[1]:,} tokens"
             ] if t.batch_rampup[1] else []
    if t.seq_len_warmup[1]:
        start, over = t.seq_len_warmup
        parts.append(f"sequence warm-up {start} -> {t.seq_len} tokens over {over:,} tokens")
    parts += [f"phase {number} from {text.split()[0]}" for number, text in enumerate(t.phases, 1)]
    return f"; {', '.join(parts)} (the rows: a full step, the largest)" if parts else ""


def bandwidth(curves: dict) -> str:
    largest = max(rate for curve in curves.values() for _, rate in curve)
    return f"up to {largest / 1e9:.3g} GB/s bus bandwidth"


def table(rows: list[Row], memory_gib: float) -> str:
    width = max([44, *(len(r.layout) for r in rows)])
    host = any(r.offload != "none" for r in rows)  # (the host's columns where some row offloads)
    header = (f"{'layout':<{width}} {'ac':<9} {'mbs':>3} {'offload':>9} {'host':>7} " * host +
              f"{'layout':<{width}} {'ac':<9} {'mbs':>3} " * (not host) +
              f"{'state':>7} {'activ.':>7} {'buffers':>7} {'total':>7} "
              f"{'comm/step':>10} {'fits':>4} {'step s':>8} {'tok/s/dev':>10} {'MFU':>6}")
    lines = [header]
    for r in rows:
        offload = f"{r.offload:>9} {r.host_gib:7.2f} " if host else ""
        lines.append(f"{r.layout:<{width}} {r.activation_checkpoint:<9} {r.micro_batch_size:>3} {offload}"
                     f"{r.state_gib:7.2f} "
                     f"{r.activations_gib:7.2f} {r.buffers_gib:7.2f} {r.total_gib:7.2f} {r.comm_bytes / GIB:7.2f} Gi "
                     f"{'yes' if r.fits else 'no':>4} {r.step_seconds:8.3g} {r.tokens_per_second_per_device:10,.0f} "
                     f"{r.mfu:6.1%}")
    memory = "; host: host memory per rank (offload optimizer: its state, off the device)" * host
    return "\n".join(lines) + f"\n(GiB per rank; {memory_gib:g} GiB per device; mbs: micro-batch size{memory})"


def verdict(rows: list[Row], memory_gib: float, host_gib: float = float("inf")) -> str:
    """`host_gib`: the host memory of one rank (its node's, shared by the node's ranks)."""
    fitting = [r for r in rows if r.fits]
    if not fitting:
        smallest = min(rows, key=lambda r: max(r.total_gib / memory_gib, r.host_gib / host_gib))
        host = f" and {smallest.host_gib:.2f} GiB of host memory (offload {smallest.offload}; the host has " \
               f"{host_gib:.0f} per rank)" * (smallest.offload != "none")
        return (f"plan: fits nowhere: the smallest layout ({smallest.layout}, activation_checkpoint "
                f"{smallest.activation_checkpoint}, micro-batch {smallest.micro_batch_size}) needs "
                f"{smallest.total_gib:.2f} GiB per rank{host}, the device has {memory_gib:g}; needed: more memory, "
                "more ranks, or a smaller micro_batch_size / seq_len")
    top = fitting[0]
    others = [r for r in fitting[1:] if r.layout != top.layout]
    reason = (f"{top.tokens_per_second_per_device:,.0f} tokens/s per device, MFU {top.mfu:.1%} ({top.step_seconds:.3g} s "
              f"a step), the fastest of the {len(fitting)} that fit")
    if others:
        reason += (f"; next layout: {others[0].layout} ({others[0].activation_checkpoint}) at "
                   f"{others[0].tokens_per_second_per_device:,.0f}")
    plain = [r for r in rows if r.layout == top.layout and r.activation_checkpoint == "none"]
    recompute = "" if top.activation_checkpoint == "none" or not plain or any(r.fits for r in plain) else \
        f"; without activation checkpointing it needs {min(r.total_gib for r in plain):.2f} GiB"
    offload = f", offload {top.offload} ({top.host_gib:.2f} GiB of host memory per rank)" * (top.offload != "none")
    return (f"plan: best: {top.layout}, activation_checkpoint {top.activation_checkpoint}, micro-batch "
            f"{top.micro_batch_size}{offload}: {reason}{recompute}")


def without(argv: list[str], names: set[str]) -> list[str]:
    """argv less the options `names` (given as `--name value` or `--name=value`)."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg.split("=", 1)[0] in names:
            skip = "=" not in arg
        else:
            kept.append(arg)
    return kept


def launch_command(row: Row, train_argv: list[str], world: int, node_size: int) -> str:
    """The command that runs the best row: plait train on one node, torchrun per node beyond.
    The row's own options replace any the plan was given (each option once)."""
    degrees = dict(part.split("=") for part in row.layout.split(","))
    mine = {f"--parallelism.{name}" for name in ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep", "cp_kind",
                                                  "cp_ulysses")} | {"--activation_checkpoint.mode",
                                                                    "--training.offload"}
    if row.micro_batch_size and degrees.get("pp") == "1":
        mine.add("--training.micro_batch_size")
    options = [*without(train_argv, mine), *(f"--parallelism.{name} {degrees.get(name, '1')}"
                              for name in ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep")),
               *(f"--parallelism.{name} {degrees[name]}" for name in ("cp_kind", "cp_ulysses") if name in degrees),
               f"--activation_checkpoint.mode {row.activation_checkpoint}"]
    if row.micro_batch_size and degrees.get("pp") == "1":
        options.append(f"--training.micro_batch_size {row.micro_batch_size}")
    if row.offload != "none":
        options.append(f"--training.offload {row.offload}")
    text = " ".join(o if o.startswith("--") and " " in o else shlex.quote(o) for o in options)
    if world <= node_size:
        return f"plait train --nproc {world} {text}"
    return (f"torchrun --nnodes {world // node_size} --nproc-per-node {node_size} --rdzv-backend c10d "
            f"--rdzv-endpoint HOST:29500 -m plait train {text}")


def main(argv: list[str]) -> int:
    own, rest = split_argv(argv)
    opts = parse(PlanArgs, own, "plait plan")
    if opts.world < 1 or min(opts.device_memory_gib, opts.host_memory_gib) <= 0 or opts.node_size < 1 or opts.top < 0:
        raise ConfigError("world / device_memory_gib, host_memory_gib / node_size / top: must be >= 1 / > 0 / >= 1 / "
                          ">= 0")
    if not opts.calibration and opts.device not in (*DATA_SHEETS, "cpu"):
        raise ConfigError(f"device: {opts.device!r} unknown; allowed: {', '.join([*DATA_SHEETS, 'cpu'])}")
    base = parse_args(rest, prog="plait plan")
    check_sizes(base)  # (before a search over the batch's divisors)
    args = model_shape(base)
    cal = load(opts.device, opts.calibration)
    if cal.short:  # a doctor's file from too short a budget: its speeds understate the device
        print(f"plan: warning: calibration {opts.calibration}: matmuls measured {cal.short}: the speeds below "
              "understate the device; rerun plait doctor with a longer --budget_seconds", file=sys.stderr)
    rows, refused = predict(base, args, opts.world, opts.device_memory_gib, cal, opts.node_size, opts.host_memory_gib)
    if not rows:
        reasons = "; ".join(sorted(set(refused.values())))
        raise ConfigError(f"world: no layout of {opts.world} ranks can run this job: {reasons}")
    header = {k: v for k, v in assumptions(base, args, opts, cal).items() if v}
    best = next((r for r in rows if r.fits), None)
    # The batch the rows assume, in the command too: without it, the run would not be the plan's.
    assumed = left_at_debug_defaults(base, ("seq_len", "global_batch_size"))
    if assumed and not base.model.flavor.startswith("debug"):
        print(debug_defaults_warning(assumed, base.model.flavor, "the plan is for them: set them for this model "
                                     "(--training.seq_len, --training.global_batch_size)"), file=sys.stderr)
    shown_assumed = [word for option in assumed for word in (f"--{option.split()[0]}", option.split()[1])]
    command = launch_command(best, [*rest, *shown_assumed], opts.world, opts.node_size) if best else ""
    shown = rows[:opts.top] if opts.top else rows
    if opts.json:
        print(json.dumps({"assumptions": header, "rows": [asdict(r) for r in shown], "command": command,
                          "rows_total": len(rows)}, indent=1))
    else:
        print("\n".join(f"{key}: {value}" for key, value in header.items()) + "\n")
        print(table(shown, opts.device_memory_gib))
        if len(shown) < len(rows):
            print(f"({len(rows) - len(shown)} more rows: --top 0 prints them all)")
    out = sys.stderr if opts.json else sys.stdout
    print(verdict(rows, opts.device_memory_gib, opts.host_memory_gib / min(opts.world, opts.node_size)), file=out)
    if command:
        print(f"plan: run it: {command}", file=out)
    return 0 if best else 1
