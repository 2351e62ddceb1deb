"""`plait plan`: which layouts fit a job in a device's memory, and which is fastest, before launch.

Every prediction is arithmetic on the model's shapes, and each is checked against a
measurement in the tests (tests/test_plan.py):

- state: parameters + gradients + AdamW moments and step counters of one rank, from each
  parameter's local shard (TP split first, then FSDP's dim-0 chunk): equals `state_gib`.
- activations: what one micro-batch's forward leaves for backward, per activation-checkpoint
  mode, op by op (below), times the micro-batches a pipeline holds: within 5% of the dtype
  probe's `saved_activations`.
- communication: bytes per step of every collective (FSDP gathers and reduce-scatters, DDP
  and HSDP all-reduces, TP's sequence-parallel gathers and scatters, pipeline sends and
  receives, loss and gradient-norm reductions): equals what `plait trace` counts.
- buffers (gathered parameters, logits in flight) and the step time are estimates: a roofline
  of compute at the device's peak plus the communication not hidden behind it.

The first rank of each pipeline rank is predicted (without a pipeline: rank 0, what training
reports): it holds the largest FSDP chunk. The largest of the pipeline ranks is reported.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import sys
from collections import Counter
from dataclasses import asdict, dataclass
import torch
import tyro

from plait.config import ConfigError, JobConfig, dp_degree, parse_args, validate
from plait.hardware import GPU_PEAK_TFLOPS
from plait.model import ModelArgs, Transformer, flops_per_token
from plait.parallel.activation_checkpoint import checkpointed_blocks

AC_MODES = ("none", "selective", "full")
COLWISE = ("wq.weight", "wk.weight", "wv.weight", "w1.weight", "w3.weight", "output.weight", "tok_embeddings.weight")
ROWWISE = ("wo.weight", "w2.weight")
GIB = 2**30


@dataclass(frozen=True)
class Layout:
    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int

    def __str__(self) -> str:  # the spelling `plait compare --run` takes
        return f"dp_replicate={self.dp_replicate},dp_shard={self.dp_shard},tp={self.tp},pp={self.pp}"


def layouts(world: int) -> list[Layout]:
    """Every (pp, dp_replicate, dp_shard, tp) whose product is the world size."""
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    return [Layout(pp, r, world // (pp * r * tp), tp) for pp in divisors for tp in divisors for r in divisors
            if world % (pp * tp * r) == 0]


def job(cfg: JobConfig, layout: Layout, ac: str, world: int) -> JobConfig:
    """`cfg` under `layout` and AC mode, validated as `plait train` would (ConfigError if it cannot run)."""
    cfg = copy.deepcopy(cfg)
    p = cfg.parallelism
    p.pp, p.dp_replicate, p.dp_shard, p.tp = layout.pp, layout.dp_replicate, layout.dp_shard, layout.tp
    if layout.pp > 1:
        cfg.training.micro_batch_size = 0  # the pipeline's micro-batches are the accumulation
    cfg.activation_checkpoint.mode = ac
    return validate(cfg, world)


def local_rows_cols(name: str, shape: tuple[int, ...], layout: Layout) -> tuple[int, int]:
    """Rank 0's (rows, columns) of a parameter: TP's split, then FSDP's dim-0 chunk (the first
    chunk is the largest: ceil)."""
    rows, cols = shape[0], math.prod(shape[1:])
    if layout.tp > 1 and name.endswith(COLWISE):
        rows //= layout.tp
    elif layout.tp > 1 and name.endswith(ROWWISE):
        cols //= layout.tp
    return rows, cols


def rank_stages(cfg: JobConfig, pp_rank: int) -> list[int] | None:
    """The pipeline stages a pp rank runs (None without a pipeline)."""
    from plait.parallel.pipeline import stage_indices, stages_per_rank

    p = cfg.parallelism
    return None if p.pp == 1 else stage_indices(pp_rank, p.pp, stages_per_rank(cfg), p.pp_schedule)


def stage_count(cfg: JobConfig) -> int:
    from plait.parallel.pipeline import stages_per_rank

    return cfg.parallelism.pp * stages_per_rank(cfg)


def stage_blocks(args: ModelArgs, cfg: JobConfig, stage: int) -> range:
    from plait.parallel.pipeline import split_blocks

    return split_blocks(args.n_layers, stage_count(cfg), cfg.parallelism.pp_split_points)[stage]


@functools.cache
def parameter_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        return {name: tuple(p.shape) for name, p in Transformer(args).named_parameters()}


def rank_parameters(args: ModelArgs, cfg: JobConfig, stages: list[int] | None) -> dict[str, tuple[int, ...]]:
    """Name -> shape of the parameters of the pipeline stages a rank runs (all, without a pipeline)."""
    shapes = parameter_shapes(args)
    if stages is None:
        return shapes
    keep = tuple(f"layers.{i}." for stage in stages for i in stage_blocks(args, cfg, stage))
    keep += ("tok_embeddings.",) * (0 in stages) + ("norm.", "output.") * (stage_count(cfg) - 1 in stages)
    return {n: s for n, s in shapes.items() if n.startswith(keep)}


def block_indices(unit_names: list[str]) -> set[int]:
    return {int(name.split(".")[1]) for name in unit_names}


def units(params: dict[str, tuple[int, ...]]) -> dict[str, dict[str, tuple[int, ...]]]:
    """FSDP units: one per block, the rest in the root."""
    grouped: dict[str, dict] = {}
    for name, shape in params.items():
        key = ".".join(name.split(".")[:2]) if name.startswith("layers.") else "root"
        grouped.setdefault(key, {})[name] = shape
    return grouped


def state_bytes(params: dict[str, tuple[int, ...]], layout: Layout) -> int:
    """fp32 parameter + fp32 gradient + AdamW exp_avg and exp_avg_sq, per element; and AdamW's
    step counter (a float32 scalar tensor) per parameter."""
    total = 0
    for name, shape in params.items():
        rows, cols = local_rows_cols(name, shape, layout)
        total += math.ceil(rows / layout.dp_shard) * cols * 16 + 4
    return total


def gathered_elements(unit: dict[str, tuple[int, ...]], layout: Layout) -> int:
    """Elements of a unit's FSDP all-gather: every parameter's TP piece, rows padded to a
    multiple of dp_shard."""
    total = 0
    for name, shape in unit.items():
        rows, cols = local_rows_cols(name, shape, layout)
        total += math.ceil(rows / layout.dp_shard) * layout.dp_shard * cols
    return total


def block_activation_bytes(args: ModelArgs, tokens: int, e: int, mode: str, tp: int) -> int:
    """What one block's forward leaves for backward, per AC mode (e: compute dtype bytes).

    none, per token: each RMSNorm keeps its input in fp32 (the input itself in fp32, a copy in
    bf16), the normalised fp32 values and its output (8d + e*d) plus 1/rms (4); attention keeps
    rotated q, repeated k and v and its output (4 * heads * head_dim * e) and its log-sum-exp
    (4 per head); SwiGLU keeps w1 and w3 outputs, silu's and the product (4 * ffn * e).
    selective keeps every matmul and attention output and the block input; full the input only.
    Under TP heads and FFN are split, the norms run on the sequence shard, and the q/k/v and
    w1/w3 inputs are the gathered (full-sequence) norm outputs.
    """
    d, heads, kv, hd, ffn = args.dim, args.n_heads // tp, args.n_kv_heads // tp, args.head_dim, args.ffn_hidden // tp
    if mode == "full":
        return tokens * e * d // tp
    if mode == "selective":
        # wq, wk, wv, w1, w3; wo and w2 (full-sequence partial sums, and under TP their scattered sums)
        matmuls = heads * hd + 2 * kv * hd + 2 * ffn + 2 * d + (2 * d // tp if tp > 1 else 0)
        return tokens * (e * (matmuls + heads * hd + d // tp) + 4 * heads)
    norms = 2 * (tokens // tp * (8 * d + 4) + tokens * e * d)
    return norms + tokens * (4 * heads * hd * e + 4 * heads + 4 * ffn * e)


def activation_bytes(args: ModelArgs, cfg: JobConfig, stages: list[int] | None, e: int) -> int:
    """Saved activations of a rank at its first backward: for each of its pipeline stages (or
    the whole model) the micro-batches in flight, each with its blocks (per AC mode) and, on
    the last stage, the final norm and the loss's fp32 log-softmax, on the others the output
    kept for backward. In-flight counts are exact for gpipe (every forward first) and 1f1b
    (pp - stage forwards before the first backward); for the interleaved and V schedules
    they are an upper bound (stages - stage)."""
    from plait.parallel.pipeline import microbatches

    t, tp, p = cfg.training, cfg.parallelism.tp, cfg.parallelism
    if stages is None:
        return _stage_activations(args, cfg, range(args.n_layers), True, t.micro_batch_size * t.seq_len, e)
    total, m, count = 0, microbatches(cfg), stage_count(cfg)
    for stage in stages:
        in_flight = {"gpipe": m, "1f1b": min(m, p.pp - stage)}.get(p.pp_schedule, min(m, count - stage))
        tokens = t.micro_batch_size // m * t.seq_len
        total += in_flight * _stage_activations(args, cfg, stage_blocks(args, cfg, stage), stage == count - 1, tokens, e)
    return total


def _stage_activations(args: ModelArgs, cfg: JobConfig, blocks: range, last: bool, tokens: int, e: int) -> int:
    tp, ac = cfg.parallelism.tp, cfg.activation_checkpoint
    chosen = set(checkpointed_blocks(args.n_layers, ac.mode, ac.every))
    total = sum(block_activation_bytes(args, tokens, e, ac.mode if i in chosen else "none", tp) for i in blocks)
    if last:
        vocab = args.vocab_size // tp
        total += tokens // tp * (8 * args.dim + 4) + tokens * (e * args.dim + 4 * vocab) + 8
    else:  # the schedule keeps the stage's output (the sequence shard under TP) for its backward
        total += tokens * args.dim // tp * e
    return total


KINDS = ("all_gather", "reduce_scatter", "all_reduce", "send", "recv")


def comm_bytes(args: ModelArgs, cfg: JobConfig, stages: list[int] | None, e: int) -> dict[str, int]:
    """Bytes per step of a rank's collectives by kind (see `collectives`)."""
    by_kind = dict.fromkeys(KINDS, 0)
    for (kind, _), n in collectives(args, cfg, stages, e).items():
        by_kind[kind] += n
    return by_kind


def collectives(args: ModelArgs, cfg: JobConfig, stages: list[int] | None, e: int) -> Counter:
    """Bytes per step of a rank's collectives (running `stages` of a pipeline) by (kind, mesh
    dimension), as `plait trace` counts them: a gather's output, a scatter's input, a reduced
    tensor, a sent or received tensor."""
    from plait.parallel.pipeline import microbatches

    p, t = cfg.parallelism, cfg.training
    layout = Layout(p.pp, p.dp_replicate, p.dp_shard, p.tp)
    params = rank_parameters(args, cfg, stages)
    grouped = units(params)
    local_batch = t.global_batch_size // dp_degree(cfg)
    if stages is None:
        passes, sequences = local_batch // t.micro_batch_size, t.micro_batch_size
    else:
        passes = microbatches(cfg)
        sequences = local_batch // passes
    tokens = sequences * t.seq_len
    reduce = 2 if cfg.training.mixed_precision_reduce == "bfloat16" else 4
    gather = e if cfg.training.mixed_precision_mode == "param" else 4
    out: Counter = Counter()
    blocks = [u for u in grouped if u != "root"]
    if p.dp_shard > 1:
        sizes = {u: gathered_elements(grouped[u], layout) for u in grouped}
        # Every micro-batch gathers every unit in forward; blocks resharded after forward (all but
        # the last) are gathered again in backward. Gradients are reduce-scattered once, after
        # the last micro-batch.
        # A pipeline stage keeps its units gathered for the whole step: one gather each.
        if stages is None:
            out["all_gather", "dp_shard"] += passes * gather * (sum(sizes.values()) + sum(sizes[u] for u in blocks[:-1]))
        else:
            out["all_gather", "dp_shard"] += gather * sum(sizes.values())
        out["reduce_scatter", "dp_shard"] += reduce * sum(sizes.values())
    if p.dp_replicate > 1:
        out["all_reduce", "dp_replicate"] += reduce * sum(math.ceil(r / p.dp_shard) * c for n, s in params.items()
                                          for r, c in [local_rows_cols(n, s, layout)])
    if p.tp > 1:
        # Sequence parallelism, per micro-batch: each block gathers its input twice (attention,
        # FFN) and reduce-scatters twice (wo, w2) in forward, the reverse in backward; the
        # embedding's output is scattered (its gradient gathered), the output layer's input gathered
        # (its gradient scattered). Loss parallelism
        # all-reduces three per-token fp32 values per micro-batch; the norm weights' gradients,
        # partial sums on each rank's sequence shard, are all-reduced once per step.
        n_blocks = len(blocks)
        first, last = "tok_embeddings.weight" in params, "output.weight" in params
        activation = tokens * args.dim * e
        each = (4 * n_blocks + first + last) * activation  # forward and backward together
        # A checkpointed block's recompute gathers its two inputs again and reduce-scatters the
        # attention output the FFN's input needs (it stops before the FFN's own reduce-scatter).
        ac = cfg.activation_checkpoint
        recomputed = len(set(checkpointed_blocks(args.n_layers, ac.mode, ac.every)) & block_indices(blocks))
        out["all_gather", "tp"] += passes * (each + 2 * recomputed * activation)
        out["reduce_scatter", "tp"] += passes * (each + recomputed * activation)
        norms = 2 * n_blocks + last
        # Over several micro-batches FSDP2 accumulates unsharded gradients in the reduce dtype.
        out["all_reduce", "tp"] += norms * args.dim * (e if passes == 1 else reduce) + passes * last * 3 * tokens * 4
    if p.pp > 1:
        # A stage sends its output forward and receives its gradient back, per micro-batch
        # (the sequence shard under TP with SP); the next stage the reverse. Neighbouring
        # stages on one rank (the bottom of zbv's V) hand over without communicating.
        ranks = {s: r for r in range(p.pp) for s in rank_stages(cfg, r)}
        hops = sum(ranks.get(s + step, ranks[s]) != ranks[s] for s in stages for step in (-1, 1))
        out["send", "pp"] += passes * hops * tokens * args.dim // p.tp * e
        out["recv", "pp"] += passes * hops * tokens * args.dim // p.tp * e
    # The loss is summed over dp (and over pp from the last stage): one float32 each. The
    # gradient norm's per-parameter fp64 squares are summed over each dimension that shards
    # them (dp_shard, tp), and the stage sums over pp.
    out["all_reduce", "scalars"] += 4 * (1 + (p.pp > 1)) + 8 * len(params) * ((p.dp_shard > 1) + (p.tp > 1)) + 8 * (p.pp > 1)
    return out


@dataclass
class Row:
    layout: str
    activation_checkpoint: str
    state_gib: float
    activations_gib: float
    buffers_gib: float
    total_gib: float
    comm_bytes: int
    comm_by_kind: dict
    fits: bool
    step_seconds: float


def buffer_bytes(args: ModelArgs, cfg: JobConfig, params: dict, e: int, tokens: int) -> int:
    """Workspace beside state and activations (an estimate): gathered parameters in the compute
    dtype (the root unit and two blocks, the one computing and the one prefetched, when FSDP
    shards; every parameter when it does not and compute is not fp32), one block's unsharded
    fp32 gradients before their reduce-scatter, and the logits with their fp32 copy."""
    p = cfg.parallelism
    grouped = units(params)
    sizes = {u: gathered_elements(grouped[u], Layout(p.pp, p.dp_replicate, 1, p.tp)) for u in grouped}
    blocks = sorted((s for u, s in sizes.items() if u != "root"), reverse=True)
    if p.dp_shard > 1:
        gathered = e * (sizes.get("root", 0) + sum(blocks[:2])) + 4 * (blocks[0] if blocks else 0)
    else:
        gathered = e * sum(sizes.values()) if e != 4 else 0
    logits = tokens * args.vocab_size // p.tp * (e + 4) if "output.weight" in params else 0
    return gathered + logits


@dataclass(frozen=True)
class Hardware:
    peak_tflops: float
    node_size: int
    intra_node_gbps: float
    inter_node_gbps: float


def link_seconds(kind: str, dim: str, n: int, cfg: JobConfig, hw: Hardware) -> float:
    """Seconds to move `n` bytes of one collective over a ring of a mesh dimension: gathers and
    scatters move (g-1)/g of the buffer per rank, all-reduces twice that, point-to-point all of
    it; within a node at NVLink speed, else at the network's. The mesh is (pp, dp_replicate,
    dp_shard, tp), tp innermost: a dimension stays in a node while its ranks do."""
    p = cfg.parallelism
    sizes = {"pp": p.pp, "dp_replicate": p.dp_replicate, "dp_shard": p.dp_shard, "tp": p.tp}
    order = list(sizes)
    if dim not in sizes:  # scalars (loss, gradient norm): latency, not bandwidth
        return 0.0
    group = sizes[dim]
    span = group * math.prod(sizes[d] for d in order[order.index(dim) + 1:])
    factor = {"all_gather": (group - 1) / group, "reduce_scatter": (group - 1) / group,
              "all_reduce": 2 * (group - 1) / group}.get(kind, 1.0)
    gbps = hw.intra_node_gbps if span <= hw.node_size else hw.inter_node_gbps
    return n * factor / (gbps * 1e9)


def step_seconds(args: ModelArgs, cfg: JobConfig, world: int, comm: Counter, hw: Hardware) -> float:
    """Roofline: the step's FLOPs split over the world at the peak (plus the forward a
    checkpointed block recomputes, and a pipeline's bubble), then the communication that cannot
    hide behind compute: TP's and the pipeline's sit on the critical path, data-parallel
    gathers and reductions overlap with compute (FSDP prefetches, reductions run in backward)."""
    from plait.parallel.pipeline import microbatches, stages_per_rank

    t, p, ac = cfg.training, cfg.parallelism, cfg.activation_checkpoint
    flops = flops_per_token(args, t.seq_len) * t.global_batch_size * t.seq_len / world
    checkpointed = len(checkpointed_blocks(args.n_layers, ac.mode, ac.every)) / args.n_layers
    # A block's forward is a third of its training FLOPs; selective recomputes element-wise ops only.
    recompute = {"none": 0.0, "selective": 0.0, "full": 1 / 3}[ac.mode] * checkpointed
    compute = flops * (1 + recompute) / (hw.peak_tflops * 1e12)
    if p.pp > 1:
        compute *= 1 + (p.pp - 1) / (microbatches(cfg) * stages_per_rank(cfg))
    times = {(kind, dim): link_seconds(kind, dim, n, cfg, hw) for (kind, dim), n in comm.items()}
    critical = sum(s for (_, dim), s in times.items() if dim in ("tp", "pp"))
    overlapped = sum(s for (_, dim), s in times.items() if dim not in ("tp", "pp"))
    return compute + critical + max(0.0, overlapped - compute)


def predict(base: JobConfig, args: ModelArgs, world: int, memory_gib: float,
            hw: Hardware) -> tuple[list[Row], dict[str, str]]:
    """Rows for every runnable layout x AC mode, sorted best first; and why each other layout cannot run."""
    e = 2 if base.training.mixed_precision_param in ("auto", "bfloat16") else 4
    rows, refused = [], {}
    for layout in layouts(world):
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
                pipeline_split = 1 if stages is None else _microbatches(cfg)
                tokens = cfg.training.seq_len * cfg.training.micro_batch_size // pipeline_split
                state = state_bytes(params, layout) / GIB
                activations = activation_bytes(args, cfg, stages, e) / GIB
                buffers = buffer_bytes(args, cfg, params, e, tokens) / GIB
                total = state + activations + buffers
                if best is None or total > best.total_gib:
                    by_kind = {kind: n for kind in KINDS if (n := sum(v for (k, _), v in comm.items() if k == kind))}
                    best = Row(str(layout), ac, state, activations, buffers, total, sum(comm.values()), by_kind,
                               total <= memory_gib, step_seconds(args, cfg, world, comm, hw))
            rows.append(best)
    # Ties (a communication-bound step hides recompute) go to the layout that recomputes least.
    rows.sort(key=lambda r: (not r.fits, r.step_seconds, AC_MODES.index(r.activation_checkpoint), r.total_gib))
    return rows, refused


def _microbatches(cfg: JobConfig) -> int:
    from plait.parallel.pipeline import microbatches

    return microbatches(cfg)


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
    """(plan's own flags, the train options)."""
    own_names = {f"--{name}" for name in PlanArgs.__dataclass_fields__}
    own, rest, i = [], [], 0
    while i < len(argv):
        name = argv[i].split("=", 1)[0]
        if name in own_names:
            takes_value = name != "--json" and "=" not in argv[i]
            own += argv[i:i + 1 + takes_value]
            i += 1 + takes_value
        else:
            rest.append(argv[i])
            i += 1
    return own, rest


def model_shape(cfg: JobConfig) -> ModelArgs:
    from plait.model import FLAVORS, model_args

    vocab = 0
    if FLAVORS[cfg.model.flavor].vocab_size == 0:  # the tokenizer's vocabulary, as training settles it
        from plait.data import build_tokenizer

        vocab = build_tokenizer(cfg.data).get_vocab_size()
    return model_args(cfg.model.flavor, vocab, cfg.model.n_layers)


def table(rows: list[Row], memory_gib: float) -> str:
    header = f"{'layout':<44} {'ac':<9} {'state':>8} {'activ.':>8} {'buffers':>8} {'total':>8} {'comm/step':>10} {'fits':>4} {'step s':>8}"
    lines = [header]
    for r in rows:
        lines.append(f"{r.layout:<44} {r.activation_checkpoint:<9} {r.state_gib:8.2f} {r.activations_gib:8.2f} "
                     f"{r.buffers_gib:8.2f} {r.total_gib:8.2f} {r.comm_bytes / GIB:8.2f} Gi {'yes' if r.fits else 'no':>4} "
                     f"{r.step_seconds:8.3f}")
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
    reason = f"the fastest predicted step ({top.step_seconds:.3f} s) of the {len(fitting)} that fit"
    if others:
        reason += f"; next: {others[0].layout} ({others[0].activation_checkpoint}) at {others[0].step_seconds:.3f} s"
    plain = next(r for r in rows if r.layout == top.layout and r.activation_checkpoint == "none")
    recompute = "" if plain.fits else f"; without activation checkpointing it needs {plain.total_gib:.2f} GiB"
    return f"plan: best: {top.layout}, activation_checkpoint {top.activation_checkpoint}: {reason}{recompute}"


def main(argv: list[str]) -> int:
    own, rest = split_argv(argv)
    opts = tyro.cli(PlanArgs, args=own, prog="plait plan", use_underscores=True)
    if opts.world < 1 or opts.device_memory_gib <= 0:
        raise ConfigError("world / device_memory_gib: must be >= 1 / > 0")
    base = parse_args(rest, prog="plait plan")
    args = model_shape(base)
    hw = Hardware(opts.peak_tflops, opts.node_size, opts.intra_node_gbps, opts.inter_node_gbps)
    rows, refused = predict(base, args, opts.world, opts.device_memory_gib, hw)
    if not rows:
        reasons = "; ".join(sorted(set(refused.values())))
        raise ConfigError(f"world: no layout of {opts.world} ranks can run this job: {reasons}")
    if opts.json:
        print(json.dumps([asdict(r) for r in rows], indent=1))
    else:
        print(table(rows, opts.device_memory_gib))
    print(verdict(rows, opts.device_memory_gib), file=sys.stderr if opts.json else sys.stdout)
    return 0 if any(r.fits for r in rows) else 1
