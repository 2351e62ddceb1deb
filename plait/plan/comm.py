"""Per-rank communication of a layout, from the model's shapes: the bytes of every collective
per step by kind and mesh dimension (exactly what `plait trace` counts, for every layout the
tests run), and a roofline step time from them and the device's peak.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from plait.config import JobConfig, dp_degree
from plait.model import ModelArgs, flops_per_token
from plait.parallel.activation_checkpoint import checkpointed_blocks
from plait.plan.memory import Layout, block_indices, gathered_elements, local_rows_cols, rank_parameters, rank_stages, units


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
