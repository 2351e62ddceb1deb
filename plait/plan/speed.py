"""Step time of a layout, from the model's shapes, the layout's collectives and a calibration.

A rank's step, per micro-batch, is the sum of its operators' times, each at the calibrated
speed for its size:
- matmuls (every linear layer: forward, input gradient, weight gradient; experts at the tokens
  each receives when routing is balanced; attention's scores and values, half of them under a
  causal mask without a mask tensor) at the matmul speed of their FLOPs;
- element-wise work: the saved activations are written in forward, read in backward and their
  gradients written (3 passes), at the element-wise speed a block of the model reached in the
  doctor (else the memory speed of one block's tensors);
- the host's time per operator (dispatch, autograd), counted on the model's own structure;
  on a GPU the host queues operators ahead, so a micro-batch takes the larger of the two;
plus the recomputed forward of checkpointed blocks, the casts and buffer copies of mixed
precision and fully_shard (`parameter_copy_seconds`), a pipeline's bubble, the optimizer step
(AdamW: 40 bytes moved per parameter, clipping included; Muon: its Newton-Schulz matmuls) and
the collectives: each at its bus bandwidth for its message size. On a GPU data-parallel
collectives overlap compute (FSDP prefetches, gradients reduce in backward) and only the excess
shows; TP's, CP's, EP's and the pipeline's are on the critical path. On a CPU (gloo) nothing
overlaps: the collectives run on the cores that compute.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from dataclasses import dataclass, replace

import torch

from plait import float8
from plait.config import JobConfig
from plait.models.attention import query_block
from plait.models.args import ModelArgs
from plait.models.transformer import Transformer
from plait.parallel.activation_checkpoint import checkpointed_blocks
from plait.plan.calibration import BUS_FACTOR, Calibration, at, cpu_share, operator_counts
from plait.plan.timing import timed
from plait.plan.features import latent_gather, masked, ulysses_degree
from plait.plan.memory import block_activation_bytes
from plait.plan.parameters import (Layout, block_indices, gathered_elements, holds_output, local_rows_cols,
                                   parameter_shapes, plan_name, rank_parameters, shard_elements, stage_blocks, units)

CRITICAL = ("tp", "pp", "cp", "ep")
ELEMENTWISE_PASSES = 3  # saved activations: written in forward, read in backward, their gradients written
ADAMW_BYTES = 40  # per parameter: read p, g, m, v and write p, m, v (28); the norm reads g, clipping scales it (12)


@dataclass
class StepTime:
    compute: float  # forward + backward of every micro-batch, recompute and bubble included
    optimizer: float
    communication: float  # what does not hide behind compute
    seconds: float


def dtype_name(e: int) -> str:
    return "bfloat16" if e == 2 else "float32"


def share(cfg: JobConfig, world: int, node_size: int, cal: Calibration) -> float:
    """Cores a rank of this job computes on (CPU): its threads, or its part of the node's."""
    return cpu_share(cfg.training.threads, min(world, node_size), cal.cores)


@functools.lru_cache(maxsize=4096)  # (plan asks it of every layout it weighs, mostly the same)
def block_matmuls(args: ModelArgs, block: int, tokens: int, seq_len: int, tp: int, causal: bool,
                  latent_cp: int = 1) -> tuple[tuple[float, str], ...]:
    """(FLOPs, weight name) of each matmul of one block's forward on a rank (backward runs two of
    each; attention's have no weight: ""), for `tokens` of sequences of `seq_len` (their keys);
    latent attention's wkv_b on `latent_cp` x `tokens` (the whole sequence's latents under
    cp_gather latent)."""
    calls = []
    layout = Layout(1, 1, 1, tp, 1)
    for name, shape in parameter_shapes(args).items():
        if not name.startswith(f"layers.{block}.") or len(shape) < 2 or ".experts.b" in name:
            continue  # norms and biases (the experts' too) are element-wise
        if len(shape) == 3:  # experts (E, out, in): each token's top_k copies, spread evenly
            calls += [(2.0 * tokens * args.top_k / shape[0] * shape[1] * shape[2], name)] * shape[0]
        else:
            rows, cols = local_rows_cols(name, shape, layout)
            calls.append((2.0 * tokens * rows * cols * (latent_cp if name.endswith("attention.wkv_b.weight") else 1),
                          name))
    return tuple(calls + [(flops, "") for flops in attention_matmuls(args, block, tokens, seq_len, tp, causal)])


@functools.cache
def float8_weights(args: ModelArgs, recipe: str, tp: int) -> frozenset[str]:
    """The weights whose linear layers multiply in float8 (tensorwise, rowwise); MXFP8's kernels
    (sm100) are timed in the compute dtype: no calibration measures them yet."""
    if recipe == "none" or float8.microscaling(recipe):
        return frozenset()
    return frozenset(plan_name(f"{name}.weight", args)
                     for name, why in float8.layer_plan(args, tp, recipe).items() if not why)


def quantised_elements(args: ModelArgs, weight: str, tokens: int, tp: int) -> int:
    """Elements a float8 linear layer casts per forward and backward: its input, its weight and
    its output's gradient."""
    rows, cols = local_rows_cols(weight, parameter_shapes(args)[weight], Layout(1, 1, 1, tp, 1))
    return tokens * cols + rows * cols + tokens * rows


def attention_matmuls(args: ModelArgs, block: int, tokens: int, seq_len: int, tp: int, causal: bool) -> list[float]:
    """Scores and values per head and sequence: 2 x queries x keys x head_dim FLOPs each, half
    of it under a causal mask the kernel skips (no mask tensor: not for a block with a mask of
    its own); under a sliding window (or an attention chunk) each query block meets its window's
    keys and its own (masked: computed whole)."""
    sequences, reach = max(1, tokens // seq_len), args.reach(block)
    keys = min(seq_len, reach + query_block(reach) - 1) if reach else seq_len
    half = causal and not args.own_mask(block, seq_len)
    one = 2.0 * tokens / sequences * keys * args.head_dim * (0.5 if half else 1.0)
    return [one] * (2 * args.n_heads // tp * sequences)


def block_seconds(args: ModelArgs, block: int, tokens: int, seq_len: int, e: int, cal: Calibration, cores: float,
                  tp: int = 1, cp: int = 1, causal: bool = True, is_masked: bool = False,
                  recompute: bool = False, heads_split: int = 1, latent_gather: bool = False,
                  eight: frozenset[str] = frozenset()) -> float:
    """One block's forward and backward (and a recomputed forward) on a rank: matmuls at their
    size's speed, element-wise work at the calibrated element-wise speed, the host's operators.
    Under a mask attention's forward runs again in backward (its query blocks are checkpointed).
    The linear layers of `eight` multiply at the calibration's float8 speed (else the compute
    dtype's) and cast their operands: each element read twice (its scale's amax, the cast),
    written once in float8, and its transposed copy for backward written and read (2e + 3 bytes)."""
    dtype = dtype_name(e)
    passes = 3 + recompute
    matmuls, quantised, rates = 0.0, 0, {}
    for flops, weight in block_matmuls(args, block, tokens, seq_len, tp, causal, cp if latent_gather else 1):
        converted = weight in eight
        kind = "float8" if converted and "float8" in cal.matmul else dtype
        if (kind, flops) not in rates:  # (an MoE block's experts: hundreds of matmuls of one size)
            rates[kind, flops] = cal.rate(kind, flops, cores)
        matmuls += passes * flops / rates[kind, flops]
        quantised += quantised_elements(args, weight, tokens, tp) if converted else 0
    if is_masked:
        matmuls += sum(flops / cal.rate(dtype, flops, cores)
                       for flops in attention_matmuls(args, block, tokens, seq_len, tp, causal))
    saved = block_activation_bytes(args, tokens, e, "none", tp, is_masked, cp, args.sparse(block), heads_split,
                                   latent_gather=latent_gather, nope=block in args.nope_layers)
    moved = ELEMENTWISE_PASSES * saved + (2 * e + 3) * quantised
    elementwise = (1 + recompute / 3) * moved / cal.elementwise_rate(dtype, tokens * args.dim * e, cores)
    dense, sparse, _ = operator_counts(args)
    host = (sparse if args.sparse(block) else dense) * (1 + recompute / 3) * cal.op_seconds
    return max(matmuls + elementwise, host) if cal.asynchronous else matmuls + elementwise + host


def micro_batch_seconds(args: ModelArgs, cfg: JobConfig, stages: list[int] | None, e: int, cal: Calibration,
                        cores: float) -> float:
    """One micro-batch's forward and backward on a rank (its stages' blocks and ends), recompute included."""
    from plait.parallel.stages import microbatches

    p, t = cfg.parallelism, cfg.training
    sequences = t.micro_batch_size // (1 if stages is None else microbatches(cfg))
    tokens = sequences * t.seq_len // p.cp
    params = rank_parameters(args, cfg, stages)
    blocks = block_indices([u for u in units(params) if u != "root"])
    ac = cfg.activation_checkpoint
    recomputed = set(checkpointed_blocks(args.n_layers, ac.mode, ac.every)) if ac.mode == "full" else set()
    causal = cfg.model.attention_mask == "causal" and not masked(cfg)
    eight = float8_weights(args, cfg.training.float8, p.tp)
    kinds = Counter((args.sparse(b), b in recomputed, args.reach(b)) for b in blocks)  # one kind, one cost
    representative = {(args.sparse(b), b in recomputed, args.reach(b)): b for b in blocks}
    seconds = sum(n * block_seconds(args, representative[kind], tokens, t.seq_len, e, cal, cores, p.tp, p.cp, causal,
                                    masked(cfg, args.own_mask(representative[kind], t.seq_len)), kind[1],
                                    ulysses_degree(cfg), latent_gather(cfg), eight)
                  for kind, n in kinds.items())
    if holds_output(args, params):  # the output layer's matmuls, the logits and the loss's fp32 log-softmax
        flops = 2.0 * tokens * args.dim * args.vocab_size / p.tp
        seconds += 3 * flops / cal.rate(dtype_name(e), flops, cores)
        logits = tokens * args.vocab_size // p.tp * (e + 4)
        seconds += ELEMENTWISE_PASSES * logits / cal.elementwise_rate(dtype_name(e), logits, cores)
    _, _, rest = operator_counts(args)
    return seconds + rest * cal.op_seconds * (not cal.asynchronous)


def parameter_copy_seconds(args: ModelArgs, cfg: JobConfig, world: int, stages: list[int] | None, e: int,
                           passes: int, cal: Calibration, cores: float) -> float:
    """The passes over parameters and gradients that mixed precision and fully_shard make beside
    the model's work, at the calibrated element-wise speed (on a CPU their buffers are fresh
    memory, like activations: a profiled FSDP2 step of small_moe spent 0.47 s of 2.3 in the
    reduce-scatter's copy-in alone):
    - computing in bf16 on one device (`CastUnit`) or under autocast: every parameter cast to
      bf16 per micro-batch (read 4 bytes, write 2), its gradient cast back (read 2, write 4);
    - fully_shard (every other layout, degree 1 included): per gather, each unit's shard copied
      into the gather's buffer in the gather dtype and the gathered unit copied out (read and
      write); once a step, its gradients copied into the reduce-scatter's buffer in the reduce
      dtype. The collectives themselves are priced apart."""
    t = cfg.training
    elements, gathers, shard = gathered_per_step(args, cfg, stages, passes)
    autocast = t.mixed_precision_mode == "autocast"
    one_device = world == 1 and t.mixed_precision_reduce == "float32" and not float8.microscaling(t.float8) and \
        t.offload == "none"
    nbytes = passes * (6 + 6) * elements if e == 2 and (one_device or autocast) else 0.0
    if not one_device:
        gather = 4 if autocast else e
        reduce = 2 if t.mixed_precision_reduce == "bfloat16" else 4
        nbytes += gathers * ((4 + gather) / shard + 2 * gather) + (e + reduce) * elements
    return nbytes / cal.elementwise_rate(dtype_name(e), nbytes, cores)


def gathered_per_step(args: ModelArgs, cfg: JobConfig, stages: list[int] | None, passes: int) -> tuple[int, int, int]:
    """(elements of a rank's units gathered whole, elements its gathers gather in a step, the degree
    they are sharded over): each unit per micro-batch in forward and all blocks but the last again in
    backward; a pipeline's stages once a step (they stay gathered)."""
    p = cfg.parallelism
    layout = Layout(p.pp, p.dp_replicate, p.dp_shard, p.tp, p.cp, p.ep)
    grouped = units(rank_parameters(args, cfg, stages))
    full = {u: gathered_elements(unit, layout) for u, unit in grouped.items()}
    elements = sum(full.values())
    if stages is not None:
        return elements, elements, layout.shard
    again = [u for u in grouped if u != "root"][:-1]  # re-gathered in backward
    return elements, passes * (elements + sum(full[u] for u in again)), layout.shard


def optimizer_seconds(args: ModelArgs, cfg: JobConfig, params: dict, e: int, cal: Calibration, cores: float,
                      ranks_here: int = 1) -> float:
    """AdamW's (or Muon's) step of a rank's shards; offloaded, by its share of the node's host (`ranks_here`)."""
    p = cfg.parallelism
    layout = Layout(p.pp, p.dp_replicate, p.dp_shard, p.tp, p.cp)
    elements = shard_elements(params, layout)
    if cfg.training.offload != "none":  # the host clips and steps its shards (AdamW alone: start-up refuses Muon)
        return elements * ranks_here / cal.host_step
    # (it streams through every state tensor in turn: the speed of the whole state's size, not one tensor's)
    seconds = ADAMW_BYTES * elements / cal.bandwidth(ADAMW_BYTES * elements, cores)
    if cfg.optimizer.name == "muon":  # 5 Newton-Schulz iterations, each 2 n^2 m + 2 n^3 x 2 FLOPs, on each matrix
        for name, shape in params.items():
            if len(shape) == 2 and "embeddings" not in name and not name.startswith("output"):
                n, m = sorted(local_rows_cols(name, shape, Layout(p.pp, p.dp_replicate, 1, p.tp, 1)))
                flops = 5 * 2 * (2 * n * n * m + n**3) / layout.shard
                seconds += flops / cal.rate("float32", flops, cores)
    return seconds + 3 * len(params) * cal.op_seconds * (not cal.asynchronous)


def host_copy_seconds(args: ModelArgs, cfg: JobConfig, stages: list[int] | None, passes: int,
                      cal: Calibration) -> float:
    """Offloaded, each gather first copies its unit's fp32 shard from host memory to the device (as
    often as `parameter_copy_seconds` counts gathers), and each reduce-scatter's fp32 output goes
    back once a step; both at the host link's speed, on the streams that overlap compute."""
    if cfg.training.offload == "none":
        return 0.0
    elements, gathers, shard = gathered_per_step(args, cfg, stages, passes)
    return 4 * (gathers + elements) / shard / cal.host_link


def collective_seconds(comm: Counter, cfg: JobConfig, calls: dict[str, int], node_size: int,
                       cal: Calibration) -> dict[str, float]:
    """Seconds per mesh dimension of a step's collectives: each call at its message's bus bandwidth."""
    p = cfg.parallelism
    sizes = {"pp": p.pp, "dp_replicate": p.dp_replicate, "dp_shard": p.dp_shard * p.cp, "cp": p.cp, "tp": p.tp,
             "ep": p.ep}
    inner = {"pp": ("dp_replicate", "dp_shard", "tp"), "dp_replicate": ("dp_shard", "tp"), "dp_shard": ("tp",),
             "cp": ("tp",), "tp": (), "ep": ("tp",)}
    out: dict[str, float] = Counter()
    for (_, kind, dim), n in comm.items():
        if dim not in sizes or not n:
            continue  # scalars: latency, counted with the host's operators
        group = sizes[dim]
        span = group * math.prod(sizes[d] for d in inner[dim])
        curves = cal.collectives if span <= node_size else cal.inter_node
        count = max(1, calls.get(dim, 1))
        message = n / count  # as doctor sizes it: a gather's output, a scatter's input, the reduced tensor
        curve = curves["all_to_all" if kind in ("send", "recv") else kind]
        factor = 1.0 if kind in ("send", "recv") else BUS_FACTOR[kind](group)
        # below the smallest size measured, a message costs the latency plus its bytes at that size's speed
        latency = cal.latency if message < curve[0][0] else 0.0
        out[dim] += count * (latency + message * factor / at(curve, message))
    return out


def call_counts(args: ModelArgs, cfg: JobConfig, stages: list[int] | None, passes: int) -> dict[str, int]:
    """About how many calls a step's bytes of each dimension are spread over, for their message
    size: FSDP gathers each unit forward and backward and reduce-scatters it; TP gathers and
    scatters each block's two inputs and outputs, forward and backward; CP gathers K and V
    forward and again when recomputing, then reduce-scatters (Ulysses: q, k, v and the output
    all-to-all, forward and backward; hybrid both); a stage sends and receives each micro-batch
    both ways; EP sends out and back, forward and backward."""
    blocks = len(range(args.n_layers)) if stages is None else sum(len(stage_blocks(args, cfg, s)) for s in stages)
    units_ = blocks + 1
    cp_calls = 8 * (ulysses_degree(cfg) > 1) + 3 * (cfg.parallelism.cp_kind != "ulysses")
    return {"dp_shard": 3 * units_ * passes, "dp_replicate": units_, "tp": 8 * blocks * passes + 4,
            "cp": cp_calls * blocks * passes, "pp": 4 * passes * max(1, len(stages or [])), "ep": 4 * blocks * passes}


def step_time(args: ModelArgs, cfg: JobConfig, world: int, stages: list[int] | None, comm: Counter, e: int,
              cal: Calibration, node_size: int) -> StepTime:
    """The predicted step of one rank (running `stages`), with what it is made of."""
    from plait.config import dp_degree
    from plait.parallel.stages import microbatches, stages_per_rank

    p, t = cfg.parallelism, cfg.training
    cores = share(cfg, world, node_size, cal)
    local_batch = t.global_batch_size // dp_degree(cfg)
    passes = local_batch // t.micro_batch_size if stages is None else microbatches(cfg)
    compute = passes * micro_batch_seconds(args, cfg, stages, e, cal, cores)
    if stages is not None:  # the bubble: (pp - 1) micro-batch times of each rank's chunk of the model
        compute *= 1 + (p.pp - 1) / (passes * stages_per_rank(cfg))
    compute += parameter_copy_seconds(args, cfg, world, stages, e, passes, cal, cores)
    params = rank_parameters(args, cfg, stages)
    optimizer = optimizer_seconds(args, cfg, params, e, cal, cores, min(world, node_size))
    by_dim = collective_seconds(comm, cfg, call_counts(args, cfg, stages, passes), node_size, cal)
    critical = sum(s for dim, s in by_dim.items() if dim in CRITICAL)
    overlapping = sum(s for dim, s in by_dim.items() if dim not in CRITICAL)
    overlapping += host_copy_seconds(args, cfg, stages, passes, cal)
    exposed = critical + (max(0.0, overlapping - compute) if cal.asynchronous else overlapping)
    return StepTime(compute, optimizer, exposed, compute + optimizer + exposed)


def measured_elementwise(args: ModelArgs, tokens: int, seq_len: int, device, dtype, cal: Calibration) -> float:
    """Element-wise bytes/s a block of this model reaches on this device: one block's forward and
    backward timed, less what the calibration predicts for its matmuls and host operators, over
    the element-wise bytes plan counts for it."""
    one = replace(args, n_layers=1, vocab_size=8)
    model = Transformer(one).to(device, dtype)
    x = torch.randn(max(1, tokens // seq_len), seq_len, args.dim, device=device, dtype=dtype, requires_grad=True)

    def step():
        model.layers["0"](x, model.rope).sum().backward()

    seconds = timed(step, device, 1.0, at_least=3)
    e = dtype.itemsize
    unrated = replace(cal, elementwise={str(dtype).removeprefix("torch."): float("inf")})
    rest = seconds - block_seconds(one, 0, tokens, seq_len, e, unrated, cal.cpu_share)
    saved = block_activation_bytes(one, tokens, e, "none", 1, False, 1, one.sparse(0))
    return ELEMENTWISE_PASSES * saved / max(rest, 0.1 * seconds)
