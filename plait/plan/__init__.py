"""`plait plan`: which layouts fit a job in a device's memory, and which is fastest, before launch.

Every prediction is arithmetic on the model's shapes (memory.py: state, activations, buffers;
comm.py: collectives and the roofline), and each is checked against a measurement in the tests
(tests/test_plan.py):

- state: parameters + gradients + AdamW moments and step counters of one rank, from each
  parameter's local shard (TP split first, then FSDP's dim-0 chunk): equals `state_gib`.
- activations: what one micro-batch's forward leaves for backward, per activation-checkpoint
  mode, op by op, times the micro-batches a pipeline holds: within 5% of the dtype
  probe's `saved_activations`.
- communication: bytes per step of every collective (FSDP gathers and reduce-scatters, DDP
  and HSDP all-reduces, TP's sequence-parallel gathers and scatters, pipeline sends and
  receives, loss and gradient-norm reductions): equals what `plait trace` counts.
- buffers (gathered parameters, logits in flight) and the step time are estimates: a roofline
  of compute at the device's peak plus the communication not hidden behind it.

The first rank of each pipeline rank is predicted (without a pipeline: rank 0, what training
reports): it holds the largest FSDP chunk. A layout's row shows its largest pipeline rank.
"""

from __future__ import annotations

import copy
import json
import sys

import torch
from collections import Counter
from dataclasses import asdict, dataclass, replace

from plait.arguments import parse, parse_args
from plait.checks import check_options
from plait.config import ConfigError, JobConfig, hf_folder, job_tokenizer
from plait.hardware import GPU_PEAK_TFLOPS
from plait.models.flavors import ModelArgs
from plait.models.transformer import Transformer, num_params
from plait.plan.comm import Hardware, collectives, step_seconds
from plait.plan.memory import Layout, activation_bytes, buffer_bytes, rank_parameters, rank_stages, state_bytes

AC_MODES = ("none", "selective", "full")
GIB = 2**30


def layouts(world: int, cp: int = 1) -> list[Layout]:
    """Every (pp, dp_replicate, dp_shard, tp) whose product with `cp` is the world size."""
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    return [Layout(pp, r, world // (pp * r * tp * cp), tp, cp) for pp in divisors for tp in divisors for r in divisors
            if world % (pp * tp * r * cp) == 0]


def job(cfg: JobConfig, layout: Layout, ac: str, world: int) -> JobConfig:
    """`cfg` under `layout` and AC mode, validated as `plait train` would (ConfigError if it cannot run)."""
    cfg = copy.deepcopy(cfg)
    p = cfg.parallelism
    p.pp, p.dp_replicate, p.dp_shard, p.tp, p.cp = layout.pp, layout.dp_replicate, layout.dp_shard, layout.tp, layout.cp
    if layout.pp > 1:
        cfg.training.micro_batch_size = 0  # the pipeline's micro-batches are the accumulation
    cfg.activation_checkpoint.mode = ac
    return check_options(cfg, world)


@dataclass
class Row:
    layout: str
    activation_checkpoint: str
    state_gib: float
    activations_gib: float
    buffers_gib: float
    total_gib: float
    comm_bytes: int
    comm_by_collective: dict  # "phase kind" -> bytes per step
    fits: bool
    step_seconds: float


def predict(base: JobConfig, args: ModelArgs, world: int, memory_gib: float,
            hw: Hardware) -> tuple[list[Row], dict[str, str]]:
    """Rows for every runnable layout x AC mode, sorted best first; and why each other layout cannot run."""
    from plait.parallel.pipeline import microbatches

    e = 2 if base.training.mixed_precision_param in ("auto", "bfloat16") else 4
    rows, refused = [], {}
    for layout in layouts(world, base.parallelism.cp):
        for ac in AC_MODES:
            try:
                cfg = job(base, layout, ac, world)
                check_layout(args, cfg)
            except ConfigError as error:
                refused[str(layout)] = str(error)
                break
            best = None
            for pp_rank in range(layout.pp):  # every pp rank: its stages differ in what they hold
                stages = rank_stages(cfg, pp_rank)
                params = rank_parameters(args, cfg, stages)
                comm = collectives(args, cfg, stages, e)
                pipeline_split = 1 if stages is None else microbatches(cfg)
                tokens = cfg.training.seq_len * cfg.training.micro_batch_size // pipeline_split
                state = state_bytes(params, layout, cfg.optimizer.name) / GIB
                activations = activation_bytes(args, cfg, stages, e) / GIB
                buffers = buffer_bytes(args, cfg, params, e, tokens) / GIB
                total = state + activations + buffers
                if best is None or total > best.total_gib:
                    by_collective = Counter()
                    for (phase, kind, _), n in comm.items():
                        by_collective[f"{phase} {kind}"] += n
                    best = Row(str(layout), ac, state, activations, buffers, total, sum(comm.values()), dict(by_collective),
                               total <= memory_gib, step_seconds(args, cfg, world, comm, hw))
            rows.append(best)
    # Ties (a communication-bound step hides recompute) go to the layout that recomputes least.
    rows.sort(key=lambda r: (not r.fits, r.step_seconds, AC_MODES.index(r.activation_checkpoint), r.total_gib))
    return rows, refused


def check_layout(args: ModelArgs, cfg: JobConfig) -> None:
    """The start-up checks that need the model: TP divisibility, pipeline options."""
    from plait.parallel.pipeline import check_pipeline
    from plait.parallel.tensor_parallel import check_divisibility

    check_divisibility(args, cfg)
    if cfg.parallelism.pp > 1:
        check_pipeline(cfg)
    if cfg.parallelism.tp > 1 and not (cfg.parallelism.sequence_parallel and cfg.parallelism.loss_parallel):
        raise ConfigError("parallelism.sequence_parallel/loss_parallel: plan predicts TP with both on (the defaults)")


@dataclass
class PlanArgs:
    """Predicted memory, communication and step time of every layout of a job on `world` devices, best first.
    The job is given by plait train's options (plait train --help lists them), e.g. --model.flavor llama3_8b."""

    world: int
    """ranks the job will run on (nodes x devices per node)"""
    device_memory_gib: float
    """memory of one device, GiB"""
    peak_tflops: float = GPU_PEAK_TFLOPS[[name for name, *_ in GPU_PEAK_TFLOPS].index("H100")][1]
    """one device's dense peak, TFLOP/s (default: H100 SXM bf16, from its data sheet)"""
    node_size: int = 8
    """devices per node: collectives of groups within a node run at intra_node_gbps"""
    intra_node_gbps: float = 450.0
    """GB/s a rank moves to others in its node (default: H100 NVLink, 450 GB/s each way)"""
    inter_node_gbps: float = 50.0
    """GB/s a rank moves across nodes (default: one 400 Gb/s InfiniBand port per GPU)"""
    json: bool = False
    """print the rows as JSON instead of a table"""


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


def model_shape(cfg: JobConfig) -> ModelArgs:
    """The job's model from options and files alone: a Hugging Face folder's config.json, or the
    flavor with the tokenizer's vocabulary (nothing is tokenized: plan needs shapes only)."""
    from plait import hf
    from plait.data import vocab_size
    from plait.models.flavors import FLAVORS

    vocab = 0  # the tokenizer's, as training settles it (a Hugging Face folder's must fit its embeddings)
    if hf_folder(cfg) is not None or cfg.model.flavor == "auto" or FLAVORS[cfg.model.flavor].vocab_size == 0:
        vocab = vocab_size(replace(cfg.data, tokenizer=job_tokenizer(cfg)))
    return hf.job_model(cfg, vocab)


def table(rows: list[Row], memory_gib: float) -> str:
    header = f"{'layout':<44} {'ac':<9} {'state':>8} {'activ.':>8} {'buffers':>8} {'total':>8} {'comm/step':>10} {'fits':>4} {'step s':>8}"
    lines = [header]
    for r in rows:
        lines.append(f"{r.layout:<44} {r.activation_checkpoint:<9} {r.state_gib:8.2f} {r.activations_gib:8.2f} "
                     f"{r.buffers_gib:8.2f} {r.total_gib:8.2f} {r.comm_bytes / GIB:8.2f} Gi {'yes' if r.fits else 'no':>4} "
                     f"{r.step_seconds:8.3g}")
    return "\n".join(lines) + f"\n(GiB per rank; {memory_gib:g} GiB per device)"


def verdict(rows: list[Row], memory_gib: float) -> str:
    fitting = [r for r in rows if r.fits]
    if not fitting:
        smallest = min(rows, key=lambda r: r.total_gib)
        return (f"plan: fits nowhere: the smallest layout ({smallest.layout}, activation_checkpoint "
                f"{smallest.activation_checkpoint}) needs {smallest.total_gib:.2f} GiB per rank, the device has "
                f"{memory_gib:g}; needed: more memory, more ranks, or a smaller micro_batch_size / seq_len")
    top = fitting[0]
    others = [r for r in fitting[1:] if r.layout != top.layout]
    reason = f"the fastest predicted step ({top.step_seconds:.3g} s) of the {len(fitting)} that fit"
    if others:
        reason += f"; next: {others[0].layout} ({others[0].activation_checkpoint}) at {others[0].step_seconds:.3g} s"
    plain = next(r for r in rows if r.layout == top.layout and r.activation_checkpoint == "none")
    recompute = "" if plain.fits else f"; without activation checkpointing it needs {plain.total_gib:.2f} GiB"
    return f"plan: best: {top.layout}, activation_checkpoint {top.activation_checkpoint}: {reason}{recompute}"


def experts_line(args: ModelArgs, cfg: JobConfig) -> str:
    """A mixture of experts' parameters (total, active per token) and what ep moves: every layout
    below holds E / (dp_shard x cp) experts' worth of state per rank, with ep or without (ep
    splits the experts, FSDP2 the rest); under ep each rank's tokens go out to their experts and
    come back, forward and backward, (ep - 1) / ep of them off-rank when routing is balanced."""
    with torch.device("meta"):
        model = Transformer(args)
    total, active = num_params(model), num_params(model, active=True)
    moe_layers = args.sparse_blocks
    # each token's k copies, bf16, out and back, in forward and in backward
    per_sequence = 2 * 2 * moe_layers * cfg.training.seq_len * args.top_k * args.dim * 2
    return (f"plan: {total / 1e9:.2f}B parameters, {active / 1e9:.2f}B active per token ({args.top_k} of "
            f"{args.n_experts} experts in {moe_layers} MoE layers) | expert parallelism (parallelism.ep) moves "
            f"{per_sequence / 2**20:.1f} MiB x (ep - 1) / ep by all-to-all per sequence a rank trains (bf16, balanced)")


def main(argv: list[str]) -> int:
    own, rest = split_argv(argv)
    opts = parse(PlanArgs, own, "plait plan")
    if opts.world < 1 or opts.device_memory_gib <= 0:
        raise ConfigError("world / device_memory_gib: must be >= 1 / > 0")
    base = parse_args(rest, prog="plait plan")
    args = model_shape(base)
    hw = Hardware(opts.peak_tflops, opts.node_size, opts.intra_node_gbps, opts.inter_node_gbps)
    rows, refused = predict(base, args, opts.world, opts.device_memory_gib, hw)
    if not rows:
        reasons = "; ".join(sorted(set(refused.values())))
        raise ConfigError(f"world: no layout of {opts.world} ranks can run this job: {reasons}")
    if args.n_experts:
        print(experts_line(args, base), file=sys.stderr if opts.json else sys.stdout)
    if opts.json:
        print(json.dumps([asdict(r) for r in rows], indent=1))
    else:
        print(table(rows, opts.device_memory_gib))
    print(verdict(rows, opts.device_memory_gib), file=sys.stderr if opts.json else sys.stdout)
    return 0 if any(r.fits for r in rows) else 1
