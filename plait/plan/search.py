"""Every layout a job can run on `world` ranks (pp x dp_replicate x dp_shard x cp x tp, and ep
for a mixture of experts) x activation-checkpoint mode x micro-batch size, each validated as
`plait train` validates it, with its memory, collectives and step time; best first.
"""

from __future__ import annotations

import copy
import functools
import math
from collections import Counter
from dataclasses import dataclass, replace

from plait.arguments import given_options
from plait.checks import check_options
from plait.config import ConfigError, JobConfig
from plait.models.args import ModelArgs
from plait.models.transformer import flops_per_token
from plait.plan.calibration import Calibration
from plait.plan.comm import collectives
from plait.plan.memory import activation_bytes, buffer_bytes
from plait.plan.parameters import Layout, rank_parameters, rank_stages, state_bytes
from plait.plan.speed import share, step_time

AC_MODES = ("none", "selective", "full")
CP_KINDS = ("allgather", "ulysses", "hybrid")
GIB = 2**30


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


DEGREES = ("pp", "tp", "cp", "dp_replicate", "dp_shard", "ep")


def fixed_degrees(cfg: JobConfig, world: int) -> dict[str, int]:
    """The degrees the job gives (on the command line or in its config; dp_shard -1 is "the rest",
    not a degree), which the search holds fixed; ConfigError where they cannot make `world`."""
    given = given_options(cfg)
    p = cfg.parallelism
    fixed = {name: getattr(p, name) for name in DEGREES
             if f"parallelism.{name}" in given and not (name == "dp_shard" and p.dp_shard == -1)}
    for name, degree in fixed.items():
        if degree < 1 or world % degree:
            raise ConfigError(f"parallelism.{name}: {degree} does not divide the world of {world} ranks; allowed: "
                              f"{', '.join(map(str, divisors(world)))} (or leave it out: plan searches it)")
    product = math.prod(degree for name, degree in fixed.items() if name != "ep")  # (ep borrows dp_shard x cp)
    if world % product:
        shown = " x ".join(f"{name} {degree}" for name, degree in fixed.items() if name != "ep")
        raise ConfigError(f"parallelism: {shown} = {product} ranks do not divide the world of {world}")
    return fixed


def layouts(world: int, args: ModelArgs, fixed: dict[str, int] | None = None,
            cp_kinds: tuple[str, ...] = CP_KINDS) -> list[Layout]:
    """Every (pp, dp_replicate, dp_shard, tp, cp) whose product is the world size, the degrees in
    `fixed` held at their value, and every cp > 1 in each of `cp_kinds` (hybrid with every
    Ulysses degree strictly between 1 and cp). A mixture of experts also tries every ep that
    divides dp_shard x cp and its experts."""
    fixed = fixed or {}

    def choices(name: str, n: int) -> list[int]:
        return ([fixed[name]] if n % fixed[name] == 0 else []) if name in fixed else divisors(n)

    found = []
    for pp in choices("pp", world):
        for tp in choices("tp", world // pp):
            for c in choices("cp", world // (pp * tp)):
                for r in choices("dp_replicate", world // (pp * tp * c)):
                    shard = world // (pp * tp * c * r)
                    if shard != fixed.get("dp_shard", shard):
                        continue
                    experts = [fixed["ep"]] if "ep" in fixed else \
                        [e for e in divisors(shard * c) if args.n_experts % e == 0] if args.n_experts else [1]
                    kinds = [(kind, 0) for kind in cp_kinds if kind != "hybrid"] if c > 1 else [(CP_KINDS[0], 0)]
                    if c > 1 and "hybrid" in cp_kinds:
                        kinds += [("hybrid", d) for d in divisors(c)[1:-1]]
                    found += [Layout(pp, r, shard, tp, c, e, *kind) for e in experts for kind in kinds]
    return found


def job(cfg: JobConfig, layout: Layout, ac: str, micro_batch: int, world: int, offload: str = "none") -> JobConfig:
    """`cfg` under `layout`, AC mode, micro-batch size (0: the whole local batch, a pipeline's
    accumulation) and offload, validated as `plait train` would (ConfigError if it cannot run)."""
    cfg = copy.deepcopy(cfg)
    cfg.training.offload = offload
    p = cfg.parallelism
    p.pp, p.dp_replicate, p.dp_shard, p.tp, p.cp, p.ep = (layout.pp, layout.dp_replicate, layout.dp_shard, layout.tp,
                                                          layout.cp, layout.ep)
    p.cp_kind, p.cp_ulysses = layout.cp_kind, layout.cp_ulysses
    cfg.training.micro_batch_size = micro_batch if layout.pp == 1 else 0
    cfg.activation_checkpoint.mode = ac
    return check_options(cfg, world)


@dataclass
class Row:
    layout: str
    activation_checkpoint: str
    micro_batch_size: int
    state_gib: float
    activations_gib: float
    buffers_gib: float
    total_gib: float
    comm_bytes: int
    comm_by_collective: dict  # "phase kind" -> bytes per step
    fits: bool
    step_seconds: float
    compute_seconds: float
    optimizer_seconds: float
    communication_seconds: float  # what does not hide behind compute
    tokens_per_second_per_device: float
    mfu: float
    offload: str = "none"  # training.offload
    host_gib: float = 0.0  # what offloading keeps in host memory instead, per rank


def check_layout(args: ModelArgs, cfg: JobConfig) -> None:
    """The start-up checks that need the model: TP divisibility, pipeline and expert options."""
    from plait.parallel.stages import check_pipeline
    from plait.parallel.context_parallel import check_heads
    from plait.parallel.tensor_parallel import check_divisibility

    check_divisibility(args, cfg)
    check_heads(args, cfg)
    p = cfg.parallelism
    if p.pp > 1:
        check_pipeline(cfg)
    if p.tp > 1 and not (p.sequence_parallel and p.loss_parallel):
        raise ConfigError("parallelism.sequence_parallel/loss_parallel: plan predicts TP with both on (the defaults)")
    if p.ep > 1 and (not args.n_experts or args.n_experts % p.ep):
        raise ConfigError(f"parallelism.ep: {p.ep} must divide the model's {args.n_experts} experts")


def predict_job(args: ModelArgs, cfg: JobConfig, world: int, memory_gib: float, cal: Calibration,
                node_size: int, host_memory_gib: float = float("inf")) -> Row:
    """One validated job's row: its largest pipeline rank's memory, its slowest rank's step. It fits
    when that rank's device memory does, and offloaded, when a node's ranks fit `host_memory_gib`."""
    from plait.parallel.stages import microbatches

    p, t = cfg.parallelism, cfg.training
    e = cal.compute_bytes(t.mixed_precision_param)
    layout = Layout(p.pp, p.dp_replicate, p.dp_shard, p.tp, p.cp, p.ep, p.cp_kind, p.cp_ulysses)
    largest, slowest = None, None
    for pp_rank in range(p.pp):  # every pp rank: its stages differ in what they hold and compute
        stages = rank_stages(cfg, pp_rank)
        params = rank_parameters(args, cfg, stages)
        comm = collectives(args, cfg, stages, e)
        pipeline_split = 1 if stages is None else microbatches(cfg)
        tokens = t.seq_len * t.micro_batch_size // pipeline_split
        state = state_bytes(params, layout, cfg.optimizer.name, cfg.training.ema > 0) / GIB
        host = state if t.offload != "none" else 0.0  # (all of it: shards, gradients, moments, the average)
        activations = activation_bytes(args, cfg, stages, e) / GIB
        buffers = buffer_bytes(args, cfg, params, e, tokens) / GIB
        if largest is None or state - host + activations + buffers > sum(largest[:3]):
            largest = (state - host, activations, buffers, comm, host)
        timing = step_time(args, cfg, world, stages, comm, e, cal, node_size)
        if slowest is None or timing.seconds > slowest.seconds:
            slowest = timing
    state, activations, buffers, comm, host = largest
    by_collective = Counter()
    for (phase, kind, _), n in comm.items():
        by_collective[f"{phase} {kind}"] += n
    per_device = t.global_batch_size * t.seq_len / slowest.seconds / world
    peak = cal.peak.get("bfloat16" if e == 2 else "float32", 0.0) * cal.scale(share(cfg, world, node_size, cal))
    mfu = model_flops(args, t.seq_len) * per_device / peak if peak else 0.0
    total = state + activations + buffers
    fits = total <= memory_gib and host * min(world, node_size) <= host_memory_gib
    return Row(str(layout), cfg.activation_checkpoint.mode, t.micro_batch_size, state, activations, buffers, total,
               sum(comm.values()), dict(by_collective), fits, slowest.seconds, slowest.compute,
               slowest.optimizer, slowest.communication, per_device, mfu, t.offload, host)


@functools.cache
def model_flops(args: ModelArgs, seq_len: int) -> float:
    return flops_per_token(args, seq_len)


def micro_batches(cfg: JobConfig, layout: Layout) -> list[int]:
    """Micro-batch sizes to try: every divisor of the local batch (a pipeline: its own split)."""
    if layout.pp > 1:
        return [0]
    dp = layout.dp_replicate * layout.dp_shard
    local = cfg.training.global_batch_size // dp if cfg.training.global_batch_size % dp == 0 else 0
    given = cfg.training.micro_batch_size
    return [given] if given else divisors(local) if local else [0]


def predict(base: JobConfig, args: ModelArgs, world: int, memory_gib: float, cal: Calibration,
            node_size: int, host_memory_gib: float = float("inf")) -> tuple[list[Row], dict[str, str]]:
    """Rows for every runnable layout x AC mode x micro-batch, best first; and why each other layout cannot run."""
    rows, refused = [], {}
    p = base.parallelism
    offloads = offload_choices(base, cal)
    # (a cp_kind asked for is kept; the default, allgather, is searched beside ulysses and hybrid)
    kinds = (p.cp_kind,) if p.cp_kind != CP_KINDS[0] else CP_KINDS
    for layout in layouts(world, args, fixed_degrees(base, world), kinds):
        for micro_batch in micro_batches(base, layout):
            for ac in AC_MODES:
                try:
                    jobs = [job(base, layout, ac, micro_batch, world, offload) for offload in offloads]
                    check_layout(args, jobs[0])
                except ConfigError as error:
                    refused[str(layout)] = str(error)
                    break
                rows += [predict_job(args, cfg, world, memory_gib, cal, node_size, host_memory_gib) for cfg in jobs]
    # Ties go to the layout that recomputes least, then to the smaller footprint.
    rows.sort(key=lambda r: (not r.fits, r.step_seconds, AC_MODES.index(r.activation_checkpoint), r.total_gib))
    return rows, refused


def offload_choices(base: JobConfig, cal: Calibration) -> tuple[str, ...]:
    """training.offload as the job gives it; else both, where the calibration knows the host's link
    to a GPU and the job's options allow offloading (`check_offload`)."""
    from plait.parallel.data_parallel import check_offload

    if "training.offload" in given_options(base) or not cal.host_link:
        return (base.training.offload,)
    try:
        check_offload(replace(base, training=replace(base.training, offload="optimizer")))
    except ConfigError:
        return ("none",)
    return ("none", "optimizer")

