"""Per-rank memory of a layout, from the model's shapes (the state: parameters.py): saved
activations per activation-checkpoint mode (exact for every layout the tests run, an upper bound
for the interleaved and V pipeline schedules), and buffers (an estimate).

A rank's pipeline stages (`stages`, None without a pipeline) say which parameters it holds; the
first rank of each pipeline rank is predicted, holding the largest FSDP chunk (ceil).
"""

from __future__ import annotations

from plait import float8
from plait.config import JobConfig
from plait.models.attention import QUERY_BLOCK, query_block
from plait.models.args import ModelArgs
from plait.parallel.activation_checkpoint import checkpointed_blocks
from plait.plan.linear_blocks import linear_mixer_bytes
from plait.plan.parameters import Layout, gathered_elements, holds_output, stage_blocks, stage_count, units
from plait.plan.features import (latent_gather, masked, mx_experts, sequence_aux, ulysses_degree, ulysses_kv_heads,
                                 window_tail_keys)


def block_activation_bytes(args: ModelArgs, tokens: int, e: int, mode: str, tp: int, masked: bool = False,
                           cp: int = 1, moe: bool = False, heads_split: int = 1, tail_keys: int = 0,
                           latent_gather: bool = False, sequence_aux: bool = False, mx_experts: bool = False,
                           nope: bool = False, linear: bool = False) -> int:
    """What one block's forward leaves for backward, per AC mode (e: compute dtype bytes).

    none, per token: each RMSNorm keeps its input in fp32 (the input itself in fp32, a copy in
    bf16), the normalised fp32 values and its output (8d + e*d) plus 1/rms (4); attention keeps
    rotated q, k and v unrepeated (SDPA's grouped-query path) and its output ((2 * heads + 2 *
    kv heads) * head_dim * e) and its log-sum-exp (4 per head); SwiGLU keeps w1 and w3 outputs,
    silu's and the product (4 * ffn * e).
    selective keeps every matmul and attention output and the block input; full the input only.
    Under TP heads and FFN are split, the norms run on the sequence shard, and the q/k/v and
    w1/w3 inputs are the gathered (full-sequence) norm outputs. Under all-gather cp k and v are
    the whole sequence's: `tokens` x cp keys. Under a mask (the document mask, or all-gather cp)
    the query blocks are checkpointed: attention keeps no log-sum-exp, and only the (joined)
    output the output projection reads. With heads split over `heads_split` ranks (Ulysses CP:
    cp) attention keeps q, k and v of the whole sequence for heads / cp heads (k and v repeated
    up to a multiple of cp), and the output projection keeps its own copy of the output the
    second all-to-all returns; hybrid (1 < heads_split < cp) keeps, under a mask, heads /
    heads_split heads of q over its Ulysses group's chunks and of k and v over the whole
    sequence. Under all-gather cp a sliding window no longer than a chunk keeps this rank's keys
    and the `tail_keys` gathered before its chunks instead (window - 1 before each chunk but the
    first: the ranks but rank 0, which plan predicts, all hold two). A q/k norm keeps
    its fp32 input and normalised values and 1/rms (8 * head_dim + 4 per head it normalises;
    over the projection, one 1/rms for all of them). Norms after the sub-layers (post_norm)
    keep what norms before them do: their fp32 input and values, and the linear layers keep the
    block input in their stead; norms on both sides (sandwich_norm) keep both. (A zero-centred
    norm's 1 + w, one copy of its weight per call, is left out: under 0.2% in the smallest rows.)
    Latent attention: `latent_attention_bytes`; linear attention (`linear`, the gated delta rule):
    `linear_mixer_bytes`. A mixture of experts (`moe`) keeps what `moe_bytes` says in the SwiGLU's
    stead (predicted at tp 1).
    """
    d, heads, kv, hd, ffn = args.dim, args.n_heads // tp, args.n_kv_heads // tp, args.head_dim, args.ffn_hidden // tp
    experts = moe_bytes(args, tokens, e, mode, sequence_aux, mx_experts) if moe else 0
    if moe:
        ffn = 0
    mixer = tokens * linear_mixer_bytes(args, e, mode, tp, cp) if linear else 0
    if mode == "full":
        return tokens * e * d // tp + experts
    if linear and mode == "selective":  # (the norms' and feed-forward's as below, its own mixer's)
        kept = 2 * ffn + (1 + (not moe)) * d + (2 * d // tp if tp > 1 else 0) + d // tp
        return tokens * e * kept + mixer + experts
    if mode == "selective":
        # wq, wk, wv, w1, w3; wo and w2 (full-sequence partial sums, and under TP their scattered sums)
        projections = heads * hd + 2 * kv * hd
        if args.kv_lora_rank:  # wq_a, wq_b (or wq), wkv_a (latent and RoPE key), wkv_b (keys' nope entries and values)
            projections = args.q_lora_rank + heads * hd + args.kv_lora_rank + args.qk_rope_head_dim + \
                heads * (args.qk_nope_head_dim + args.v_head_dim)
        matmuls = projections + 2 * ffn + (1 + (not moe)) * d + (2 * d // tp if tp > 1 else 0)
        return tokens * (e * (matmuls + heads * hd + d // tp) + 4 * heads) + experts
    norms = 2 * (tokens // tp * (8 * d + 4) + tokens * e * d)
    if args.sandwich_norm:  # (Gemma 3's norms after the sub-layers keep what OLMo's do)
        norms += 2 * tokens // tp * (8 * d + 4)
    key_tokens = tokens + tail_keys if tail_keys else tokens * cp  # the keys a rank keeps ...
    kv_kept = ulysses_kv_heads(kv, heads_split) // heads_split  # ... of this many key/value heads
    attention = (tokens * (2 * heads + (heads_split > 1 and not masked) * heads) + 2 * key_tokens * kv_kept) * hd * e
    log_sum_exp = 0 if masked else 4 * heads
    # (Llama 4's L2 norm, weightless, keeps its fp32 input and 1/rms, in the blocks with RoPE alone)
    qk_norms = {"none": 0, "head": (heads + kv) * (8 * hd + 4), "projection": 8 * (heads + kv) * hd + 8,
                "l2": (heads + kv) * (4 * hd + 4) * (not nope)}[args.qk_norm]
    if args.kv_lora_rank:
        attention, qk_norms = tokens * latent_attention_bytes(args, e, tp, masked, cp, latent_gather), 0
    if linear:
        attention, qk_norms, log_sum_exp = mixer, 0, 0
    return norms + attention + tokens * (log_sum_exp + 4 * ffn * e + qk_norms) + experts


def latent_attention_bytes(args: ModelArgs, e: int, tp: int, masked: bool, cp: int, latent_gather: bool) -> int:
    """What latent attention keeps per token (no AC): each latent's norm what a block's norm
    keeps (its input, in the compute dtype, the fp32 input and normalised values, 1/rms; the key
    latent's output whole-sequence under `latent_gather`: the gathered copy wkv_b reads) and
    in fp32 the key latent's whole projection output (the RoPE key is a view of it); the queries and
    keys SDPA reads (heads x head_dim each; keys x cp under all-gather cp) and the values:
    padded to head_dim where narrower (a fresh tensor; its output, padded too, SDPA's causal
    path keeps, and the output projection its own unpadded copy), else a view of wkv_b's whole
    output (all-gathered values under cp: a fresh tensor; under `latent_gather` wkv_b's whole
    sequence output); the output projection's input."""
    heads, hd, v = args.n_heads // tp, args.head_dim, args.v_head_dim
    expanded = cp if latent_gather else 1  # the tokens wkv_b runs on
    norms = sum(8 * rank + 4 + e * rank * times
                for rank, times in ((args.q_lora_rank, 1), (args.kv_lora_rank, expanded)) if rank)
    padded = v != hd
    values = heads * hd * cp if padded else \
        heads * (args.qk_nope_head_dim + v) * cp if expanded == cp else heads * v * cp
    outputs = heads * v + (padded and not masked) * heads * hd
    rope_key = args.qk_rope_head_dim * (e == 4)  # (in bf16 the norm and RoPE read fp32 copies: no view keeps it)
    return norms + e * (rope_key + heads * hd * (1 + cp) + values + outputs)


def moe_bytes(args: ModelArgs, tokens: int, e: int, mode: str, sequence_aux: bool = False,
              mx_experts: bool = False) -> int:
    """What a mixture-of-experts layer keeps for backward, routing whatever it routes (every
    token reaches k experts: the sizes do not depend on which). Every mode: the step's record
    (tokens per expert, int64, and the auxiliary loss). full: nothing more. selective: the matmul
    outputs (the router's fp32 logits; w1, w3 and w2's grouped outputs; the shared experts').
    none, over the R = k x tokens rows: each row's input, the grouped w2 output and its weighted
    copy (3 x dim), the SwiGLU's four hidden tensors (seven clamped: gpt-oss), their row and token indices (int64;
    with experts' biases also each row's expert) and weights; the router's fp32 scores and its
    sort's int64 indices, the top-k weights and their sum; in bf16 the router's fp32 copies of
    its input and weight, where the input itself (the norm's output, which the norms' count
    holds) is then kept by nobody unless shared experts read it. A sigmoid router's sequence-wise
    loss (`sequence_aux`) records its value too and keeps each token's sum of scores (fp32; and
    per sequence two rows of E, not counted). MXFP8 experts (`mx_experts`) keep each grouped matmul's input
    padded (each expert's rows to blocks of 32, for the worst case) and its padded offsets, instead of the
    rows' input and the SwiGLU's product."""
    n, k, d, h = args.n_experts, args.top_k, args.dim, args.moe_hidden
    rows, softmax = tokens * k, args.router == "softmax"
    record = n * 8 + 4 * (softmax or sequence_aux)
    if mode == "full":
        return record
    shared = args.moe_hidden * args.n_shared_experts
    gate = args.shared_expert_gate  # (Qwen3-Next: the shared experts' output times a sigmoid of one projection)
    if mode == "selective":  # (and the shared experts' three matmuls, and its gate's)
        return record + tokens * n * 4 + rows * (2 * h + d) * e + tokens * (2 * shared + d * bool(shared) + gate) * e
    router = tokens * n * 12 + args.normalize_top_k * tokens * (k + 1) * 4 + n * 4 * softmax + 4 * tokens * sequence_aux
    casts = tokens * d * 4 + n * d * 4 - tokens * d * e * (not shared) if e != 4 else 0
    hidden = 7 if args.swiglu_limit else 4  # the clamped SwiGLU: both clamps' inputs, and gate, sigmoid, glu, up + 1
    row_experts = 8 * rows if args.expert_bias else 0  # which expert's bias each row adds (int64)
    padded = -(-(rows + 32 * n) // 32) * 32
    mx = padded * (2 * d + h) * e + 3 * 2 * n * 4 - rows * (d + h) * e if mx_experts else 0
    kept = rows * ((3 * d + hidden * h) * e + 16 + e) + row_experts + router + n * 4 + casts + 4 * tokens * shared * e
    return record + kept + mx + tokens * (d + 1) * e * gate  # (the gated product's factors: shared output, sigmoid)


def rope_rows_bytes(args: ModelArgs, cfg: JobConfig, sequences: int) -> int:
    """What a forward given positions (the document mask, or cp) keeps besides the blocks,
    shared by every layer: each token's RoPE rows (fp32), of each table (the sliding blocks' own
    too, where they rotate apart). (No mask: each query block builds its
    own from the document ids, which come with the batch, as its tokens and positions do:
    inputs, not activations.)"""
    if cfg.model.attention_mask == "causal" and cfg.parallelism.cp == 1:
        return 0
    tables = 2 if args.local_rope_theta else 1
    return tables * sequences * cfg.training.seq_len // cfg.parallelism.cp * args.rope_dim * 4


def activation_bytes(args: ModelArgs, cfg: JobConfig, stages: list[int] | None, e: int) -> int:
    """Saved activations of a rank at its first backward: for each of its pipeline stages (or
    the whole model) the micro-batches in flight, each with its blocks (per AC mode) and, on
    the last stage, the final norm and the loss's fp32 log-softmax, on the others the output
    kept for backward. In-flight counts are exact for gpipe (every forward first) and 1f1b
    (pp - stage forwards before the first backward); for the interleaved and V schedules
    they are an upper bound (stages - stage)."""
    from plait.parallel.stages import microbatches

    t, p = cfg.training, cfg.parallelism
    if stages is None:
        return _stage_activations(args, cfg, range(args.n_layers), True, t.micro_batch_size * t.seq_len // p.cp, e) + \
            rope_rows_bytes(args, cfg, t.micro_batch_size)
    total, m, count = 0, microbatches(cfg), stage_count(cfg)
    for stage in stages:
        in_flight = {"gpipe": m, "1f1b": min(m, p.pp - stage)}.get(p.pp_schedule, min(m, count - stage))
        tokens = t.micro_batch_size // m * t.seq_len // p.cp
        total += in_flight * _stage_activations(args, cfg, stage_blocks(args, cfg, stage), stage == count - 1, tokens, e)
    return total + rope_rows_bytes(args, cfg, t.micro_batch_size)


def _stage_activations(args: ModelArgs, cfg: JobConfig, blocks: range, last: bool, tokens: int, e: int) -> int:
    tp, ac = cfg.parallelism.tp, cfg.activation_checkpoint
    chosen = set(checkpointed_blocks(args.n_layers, ac.mode, ac.every))
    total = sum(block_activation_bytes(args, tokens, e, ac.mode if i in chosen else "none", tp,
                                       masked(cfg, args.own_mask(i, cfg.training.seq_len)), cfg.parallelism.cp,
                                       args.sparse(i), ulysses_degree(cfg), window_tail_keys(args, cfg, i, tokens),
                                       latent_gather(cfg), sequence_aux(args, cfg), mx_experts(args, cfg, e),
                                       i in args.nope_layers, args.linear(i))
                for i in blocks)
    if last:
        total += tokens // tp * (8 * args.dim + 4) + loss_bytes(args, cfg, tokens, e)
        total += args.mtp_layers * mtp_bytes(args, cfg, tokens, e)
    else:  # the schedule keeps the stage's output (the sequence shard under TP) for its backward
        total += tokens * args.dim // tp * e
    return total


def mtp_bytes(args: ModelArgs, cfg: JobConfig, tokens: int, e: int) -> int:
    """What a multi-token prediction module keeps (never checkpointed): its embedding's norm (the
    fp32 embedding and normalised values, 1/rms), the model's final norm run for it (its normalised
    values and 1/rms, and in bf16 its fp32 copy: the fp32 input is the final norm's too), its
    hidden norm over that (the fp32 input, normalised values, 1/rms), eh_proj's input (both norms'
    outputs joined), its block, and its output norm and loss as the model's own. Under TP (with SP,
    as plan assumes) the norms and eh_proj run on the sequence shard."""
    d, block, tp = args.dim, args.n_layers, cfg.parallelism.tp
    own = (8 * d + 4) + (4 * d + 4 + 4 * d * (e != 4)) + (8 * d + 4) + 2 * e * d + (8 * d + 4)
    return tokens // tp * own + loss_bytes(args, cfg, tokens, e) + \
        block_activation_bytes(args, tokens, e, "none", tp, masked(cfg, args.own_mask(block, cfg.training.seq_len)),
                               cfg.parallelism.cp, args.sparse(block), ulysses_degree(cfg),
                               window_tail_keys(args, cfg, block, tokens),
                               latent_gather(cfg), sequence_aux(args, cfg), mx_experts(args, cfg, e),
                               block in args.nope_layers)


def loss_bytes(args: ModelArgs, cfg: JobConfig, tokens: int, e: int) -> int:
    """What a loss keeps for backward: chunked (plait/models/loss.py), the gradients it computed in
    forward, of the hidden states (gathered whole under TP) and of the rank's output rows; whole,
    the output layer's input, the fp32 log-softmax of the logits and cross-entropy's two scalars."""
    vocab = args.vocab_size // cfg.parallelism.tp
    if cfg.training.loss_chunk:
        return e * args.dim * (tokens + vocab)
    return tokens * (e * args.dim + 4 * vocab) + 8


def loss_workspace_bytes(args: ModelArgs, cfg: JobConfig, tokens: int, e: int) -> int:
    """The loss's workspace: chunked, one chunk's logits in fp32 with the softmax's two temporaries
    and, where the matrix is not fp32, the fp32 sum of its gradient and one chunk's term of it;
    whole, the logits with their fp32 copy."""
    t, p = cfg.training, cfg.parallelism
    vocab = args.vocab_size // p.tp
    if t.loss_chunk:
        return min(t.loss_chunk, tokens) * vocab * 12 + (4 + e) * vocab * args.dim * (e != 4)
    return tokens * args.vocab_size // p.tp * (e + 4)


def buffer_bytes(args: ModelArgs, cfg: JobConfig, params: dict, e: int, tokens: int) -> int:
    """Workspace beside state and activations (an estimate): gathered parameters in the compute
    dtype (the root unit and two blocks, the one computing and the one prefetched, when FSDP
    shards; every parameter when it does not and compute is not fp32), one block's unsharded
    fp32 gradients before their reduce-scatter, the loss's workspace (`loss_workspace_bytes`), and
    under a mask one query block's mask (boolean and in the compute dtype) over the whole sequence (over
    the widest window's keys, where only sliding or chunked blocks are masked), and MXFP8's copies of one matmul."""
    p, t = cfg.parallelism, cfg.training
    grouped = units(params)
    sizes = {u: gathered_elements(grouped[u], Layout(p.pp, p.dp_replicate, 1, p.tp, 1, p.ep)) for u in grouped}
    blocks = sorted((s for u, s in sizes.items() if u != "root"), reverse=True)
    if p.dp_shard * p.cp > 1 or t.offload != "none":  # (offloaded, units reshard on one rank too)
        gathered = e * (sizes.get("root", 0) + sum(blocks[:2])) + 4 * (blocks[0] if blocks else 0)
    else:
        gathered = e * sum(sizes.values()) if e != 4 else 0
    logits = loss_workspace_bytes(args, cfg, tokens // p.cp, e) if holds_output(args, params) else 0
    queries = t.seq_len // p.cp * ulysses_degree(cfg)
    widest = max((args.reach(b) for b in range(args.n_layers) if args.own_mask(b, t.seq_len)), default=0)
    full = masked(cfg, args.attention_sinks)  # some block masked over the whole sequence
    keys = t.seq_len if full else min(t.seq_len, widest + query_block(widest) - 1) if widest else 0
    mask = tokens // t.seq_len * min(QUERY_BLOCK if full else query_block(widest), queries) * keys * (e + 1)
    return gathered + logits + mask + float8.quantised_bytes(args, cfg, tokens // p.cp)
