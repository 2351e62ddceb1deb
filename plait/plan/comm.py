"""Per-rank communication of a layout, from the model's shapes: the bytes of every collective
per step by kind and mesh dimension (exactly what `plait trace` counts, for every layout the
tests run; expert parallelism's all-to-alls under balanced routing). Their time: speed.py.
"""

from __future__ import annotations

import math
import re
from collections import Counter

from plait import float8
from plait.config import JobConfig, dp_degree
from plait.models.args import ModelArgs
from plait.parallel.activation_checkpoint import checkpointed_blocks
from plait.plan.features import latent_gather, sequence_aux, ulysses_degree, ulysses_kv_heads, window_tail_keys
from plait.plan.parameters import (COLWISE, ROWWISE, Layout, block_indices, gathered_bytes, gathered_elements,
                                   holds_output, local_rows_cols, plan_name, rank_parameters, rank_stages,
                                   shard_elements, units)

LATENT = re.compile(r"attention\.(wq_a|q_a_norm|wkv_a|kv_a_norm)\.")  # whole on every TP rank


def comm_bytes(args: ModelArgs, cfg: JobConfig, stages: list[int] | None, e: int) -> dict[tuple[str, str], int]:
    """Bytes per step of a rank's collectives by (phase, kind), as `plait trace` lists them."""
    by_phase = Counter()
    for (phase, kind, _), n in collectives(args, cfg, stages, e).items():
        by_phase[phase, kind] += n
    return dict(by_phase)


def collectives(args: ModelArgs, cfg: JobConfig, stages: list[int] | None, e: int) -> Counter:
    """Bytes per step of a rank's collectives (running `stages` of a pipeline) by (phase, kind,
    mesh dimension), as `plait trace` counts them: a gather's output, a scatter's input, a
    reduced tensor, a sent or received tensor."""
    from plait.parallel.stages import microbatches

    p, t = cfg.parallelism, cfg.training
    layout = Layout(p.pp, p.dp_replicate, p.dp_shard, p.tp, p.cp, p.ep)
    params = rank_parameters(args, cfg, stages)
    grouped = units(params)
    local_batch = t.global_batch_size // dp_degree(cfg)
    passes = local_batch // t.micro_batch_size if stages is None else microbatches(cfg)
    tokens = local_batch // passes * t.seq_len // p.cp  # this rank's share of the micro-batch
    reduce = 2 if cfg.training.mixed_precision_reduce == "bfloat16" else 4
    gather = e if cfg.training.mixed_precision_mode == "param" else 4
    out: Counter = Counter()
    blocks = [u for u in grouped if u != "root"]
    if layout.shard > 1:
        sizes = {u: gathered_elements(grouped[u], layout) for u in grouped}
        # Under float8 all-gather the converted weights travel as one byte per element, with
        # scales computed after each optimizer step: one all-reduce of every weight's amax (an
        # fp32 scalar each) for the step's gathers.
        eight = frozenset(plan_name(f"{name}.weight", args) for name, why in float8.layer_plan(args, p.tp).items()
                          if not why) if float8.fsdp_all_gather(cfg) else frozenset()
        gathered = {u: gathered_bytes(unit, layout, eight, gather) for u, unit in grouped.items()}
        out["optimizer", "all_reduce", "dp_shard"] += 4 * len(eight & set(params))
        # Every micro-batch gathers every unit in forward and, for blocks resharded after forward
        # (all but the last), again in backward; a pipeline stage keeps its units gathered for
        # the whole step: one gather each. Gradients are reduce-scattered once, after the last
        # micro-batch.
        again = blocks[:-1] if stages is None else []
        times = passes if stages is None else 1
        out["forward", "all_gather", "dp_shard"] += times * sum(gathered.values())
        out["backward", "all_gather", "dp_shard"] += times * sum(gathered[u] for u in again)
        out["backward", "reduce_scatter", "dp_shard"] += reduce * sum(sizes.values())
    if p.dp_replicate > 1:  # the shard's gradients, all-reduced over the replicas
        out["backward", "all_reduce", "dp_replicate"] += reduce * shard_elements(params, layout)
    ac = cfg.activation_checkpoint
    checkpointed = set(checkpointed_blocks(args.n_layers, ac.mode, ac.every))
    recomputed = len(checkpointed & block_indices(blocks))
    n = ulysses_degree(cfg)
    if n > 1:
        # Per micro-batch every block sends q, k and v (k and v repeated up to a multiple of n)
        # all-to-all over its n Ulysses ranks, and the output back, in forward; their gradients in
        # backward, where a checkpointed block's recompute sends the four again. The trace counts
        # each buffer whole.
        kv = ulysses_kv_heads(args.n_kv_heads // p.tp, n)
        one = passes * tokens * (args.n_heads // p.tp + kv) * (args.head_dim + args.v_head_dim) * e
        attending = [b for b in block_indices(blocks) if not args.linear(b)]
        out["forward", "all_to_all", "cp"] += len(attending) * one
        out["backward", "all_to_all", "cp"] += (len(attending) + len(checkpointed & set(attending))) * one
    if 1 < p.cp != n:
        # Per micro-batch every block all-gathers its keys and values over cp / n ranks in forward
        # (the gather's output: the whole sequence's, in the compute dtype; under hybrid the
        # heads its Ulysses group gave it) and reduce-scatters their gradients in backward (its
        # input, the same size); a checkpointed block gathers again. Under all-gather, a sliding
        # window (or attention chunk) no longer than a chunk gathers only the window - 1 keys before each chunk.
        # Latent attention under cp_gather latent: each token's key latent and RoPE key, the whole sequence's.
        per_key = passes * ulysses_kv_heads(args.n_kv_heads // p.tp, n) // n * (args.head_dim + args.v_head_dim) * e
        latent = args.kv_lora_rank and latent_gather(cfg)
        if latent:
            per_key = passes * (args.kv_lora_rank + args.qk_rope_head_dim) * e
        for block in block_indices(blocks) - set(args.linear_layers):
            tails = 0 if latent else window_tail_keys(args, cfg, block, tokens)
            keys = p.cp * tails or tokens * p.cp  # every rank's tails, or all
            out["forward", "all_gather", "cp"] += keys * per_key
            out["backward", "all_gather", "cp"] += (block in checkpointed) * keys * per_key
            out["backward", "reduce_scatter", "cp"] += keys * per_key
    if p.cp > 1:
        # A linear block (plait/parallel/linear_context.py) all-gathers, per micro-batch, every
        # chunk's last taps - 1 inputs of q, k and v (compute dtype) and its two states a value head
        # (fp32: key dim x (key dim + value dim)); their gradients reduce-scattered in backward.
        sequences = tokens * p.cp // cfg.training.seq_len
        keys, values = (args.linear_key_heads * args.linear_key_dim // p.tp,
                        args.linear_value_heads * args.linear_value_dim // p.tp)
        windows = sequences * 2 * p.cp * (args.linear_conv - 1) * (2 * keys + values) * e
        states = sequences * 2 * p.cp * args.linear_value_heads // p.tp * args.linear_key_dim * \
            (args.linear_key_dim + args.linear_value_dim) * 4
        for block in block_indices(blocks) & set(args.linear_layers):
            out["forward", "all_gather", "cp"] += passes * (windows + states)
            out["backward", "all_gather", "cp"] += passes * (block in checkpointed) * (windows + states)
            out["backward", "reduce_scatter", "cp"] += passes * (windows + states)
    if p.tp > 1:
        # Sequence parallelism, per micro-batch: each block gathers its input twice (attention,
        # FFN) and reduce-scatters twice (wo, w2) in forward, the reverse in backward; the
        # embedding's output is scattered (its gradient gathered), the output layer's input
        # gathered (its gradient scattered). A checkpointed block's recompute gathers its two
        # inputs again and reduce-scatters the attention output the FFN's input needs (it stops
        # before the FFN's own reduce-scatter).
        # A mixture of experts runs whole on its gathered input and hands back its own part: no
        # reduce-scatter in forward, and in backward its output's gradient gathered, its input's sliced.
        # Multi-token prediction (on the last stage) embeds (scatters) and projects to logits
        # (gathers) once more.
        first, last = stages is None or 0 in stages, holds_output(args, params)
        embeds, outputs = first + args.mtp_layers * last, last * (1 + args.mtp_layers)
        activation = tokens * args.dim * e
        moe = sum(map(args.sparse, block_indices(blocks)))
        gathers, scatters = 2 * len(blocks) + outputs, 2 * len(blocks) + embeds - moe  # in forward
        out["forward", "all_gather", "tp"] += passes * gathers * activation
        out["forward", "reduce_scatter", "tp"] += passes * scatters * activation
        out["backward", "all_gather", "tp"] += passes * (scatters + moe + 2 * recomputed) * activation
        out["backward", "reduce_scatter", "tp"] += passes * (gathers - moe + recomputed) * activation
        # Loss parallelism all-reduces three per-token fp32 values per micro-batch. The norm
        # weights' gradients, partial sums over each rank's sequence shard (a per-head q/k
        # norm's and latent attention's latents': over its heads), are all-reduced once per step, in the reduce dtype when FSDP2
        # accumulated them over several micro-batches.
        out["forward", "all_reduce", "tp"] += passes * outputs * 3 * tokens * 4
        block_norms = 4 if args.sandwich_norm else 2  # (Gemma 3's norms after the sub-layers too)
        linear = sum(map(args.linear, block_indices(blocks)))  # (a linear block: its output norm, no q/k norms)
        norms = (block_norms * len(blocks) + last) * args.dim + linear * args.linear_value_dim + \
            2 * (len(blocks) - linear) * args.head_dim * (args.qk_norm == "head")
        # (latent attention's latent projections and norms, whole on each rank: partial gradients too)
        norms += sum(math.prod(shape) for name, shape in params.items() if LATENT.search(name))
        # (multi-token prediction's norms and projection, on the sequence shard: partial gradients)
        norms += sum(math.prod(shape) for name, shape in params.items() if name.startswith("mtp."))
        out["backward", "all_reduce", "tp"] += norms * (e if passes == 1 else reduce)
        if args.qk_norm == "projection":
            # Each q/k norm all-reduces one fp32 sum of squares per token, and its gradient in
            # backward (a checkpointed block's recompute, the forward's again).
            squares = passes * 2 * tokens * 4
            out["forward", "all_reduce", "tp"] += len(blocks) * squares
            out["backward", "all_reduce", "tp"] += (len(blocks) + recomputed) * squares
    if p.pp > 1:
        # Per micro-batch a stage receives its input from the previous stage and sends its
        # output to the next in forward, and the reverse with gradients in backward (the sequence
        # shard under TP with SP). Neighbouring stages on one rank (zbv's V) need no transfer.
        ranks = {s: r for r in range(p.pp) for s in rank_stages(cfg, r)}
        hop = passes * tokens * args.dim // p.tp * e
        for stage in stages:
            if ranks.get(stage + 1, ranks[stage]) != ranks[stage]:
                out["forward", "send", "pp"] += hop
                out["backward", "recv", "pp"] += hop
            if ranks.get(stage - 1, ranks[stage]) != ranks[stage]:
                out["forward", "recv", "pp"] += hop
                out["backward", "send", "pp"] += hop
    # The loss is summed over dp (and over pp from the last stage), and the preemption signal over
    # every rank: one float32 each. The gradient norm: one fp64 sum of squares per kind of
    # sharding (which dimensions split a parameter: dp_shard x cp, tp for TP's weights) is summed
    # over each of its dimensions, and the stages' sums over pp.
    kinds = {(layout.shard > 1, p.tp > 1 and name.endswith(COLWISE + ROWWISE)) for name in params}
    out["step", "all_reduce", "scalars"] += 4 * (2 + (p.pp > 1)) + 8 * sum(map(sum, kinds)) + 8 * (p.pp > 1)
    if p.ep > 1 and args.n_experts:
        # Each MoE block sends every token's top_k copies to their experts' ranks and back by
        # all-to-all, in forward and again in backward (a checkpointed block's forward too):
        # the whole buffer as the trace counts it, when routing is balanced.
        moe = [b for b in block_indices(blocks) if args.sparse(b)]
        again = len(set(checkpointed_blocks(args.n_layers, ac.mode, ac.every)) & set(moe))
        copies = passes * tokens * args.top_k * args.dim * e
        out["forward", "all_to_all", "ep"] += 2 * len(moe) * copies
        out["backward", "all_to_all", "ep"] += 2 * (len(moe) + again) * copies
    if p.cp > 1 and args.n_experts and (args.router == "softmax" or sequence_aux(args, cfg)):
        # Each MoE layer's auxiliary loss sums its routing over the cp ranks, per micro-batch in
        # forward (and a checkpointed block's recompute): the tokens per expert (int64; softmax) or
        # per sequence and expert (fp32; the sequence-wise loss).
        moe = [b for b in block_indices(blocks) if args.sparse(b)]
        again = len(set(checkpointed_blocks(args.n_layers, ac.mode, ac.every)) & set(moe))
        sums = passes * args.n_experts * (8 if args.router == "softmax" else 4 * tokens * p.cp // t.seq_len)
        out["forward", "all_reduce", "cp"] += len(moe) * sums
        out["backward", "all_reduce", "cp"] += again * sums
    if args.n_experts:  # the step's expert load (int64 per layer and expert) and auxiliary loss; their pp reductions
        moe_blocks = sum(map(args.sparse, block_indices(blocks)))
        out["step", "all_reduce", "scalars"] += 8 * moe_blocks * args.n_experts + 8 + (8 + 16) * (p.pp > 1)
    # the MTP loss and its forwards (fp32; and over pp from the last stage)
    out["step", "all_reduce", "scalars"] += 8 * bool(args.mtp_layers) * (1 + (p.pp > 1))
    if p.pp > 1 and args.mtp_layers and "tok_embeddings.weight" in params:
        # The first stage's embedding and the last stage's copy (MTP's) sum their gradients (fp32 shards)
        rows, cols = local_rows_cols("tok_embeddings.weight", params["tok_embeddings.weight"], layout)
        out["step", "all_reduce", "pp"] += 4 * math.ceil(rows / layout.shard) * cols
    return out
