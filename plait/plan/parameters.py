"""What each rank holds of a model's parameters under a layout: names and shapes by pipeline
stage, TP's split and FSDP's chunk (rank 0's, the largest), FSDP's units and what their
all-gathers gather. `plait plan` asks these of the same parameters for every layout it weighs:
the unit sums are cached by content, and what they return is shared (read it, never change it).
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass

import torch

from plait.config import JobConfig
from plait.models.args import ModelArgs
from plait.models.transformer import Transformer
from plait.optim.optimizers import uses_muon

# (A per-head q/k norm's weight is replicated; a bias of wo or w2 too: added once after the sum;
# a linear block's output norm too. Its gates, convolutions, A_log and dt_bias split by heads.)
COLWISE = ("wq.weight", "wk.weight", "wv.weight", "w1.weight", "w3.weight", "output.weight", "tok_embeddings.weight",
           "wq.bias", "wk.bias", "wv.bias", "w1.bias", "w3.bias", "q_proj_norm.weight", "k_proj_norm.weight",
           "core.sinks", "wq_b.weight", "wkv_b.weight", "wg.weight", "wz.weight", "wb.weight", "wa.weight",
           "conv_q", "conv_k", "conv_v", "A_log", "dt_bias")
ROWWISE = ("wo.weight", "w2.weight")
WHOLE = ".feed_forward.shared."  # a mixture of experts' shared experts: whole on every TP rank, as its experts


@dataclass(frozen=True)
class Layout:
    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int
    cp: int = 1
    ep: int = 1  # borrows its ranks from dp_shard x cp: no factor of the world
    cp_kind: str = "allgather"
    cp_ulysses: int = 0  # hybrid's Ulysses degree

    @property
    def shard(self) -> int:
        """The degree parameters are sharded over: dp_shard x cp (cp ranks hold the same parameters)."""
        return self.dp_shard * self.cp

    def __str__(self) -> str:  # the spelling `plait compare --run` takes
        kind = f",cp_kind={self.cp_kind}" if self.cp_kind != "allgather" else ""
        kind += f",cp_ulysses={self.cp_ulysses}" if self.cp_kind == "hybrid" else ""
        cp = f",cp={self.cp}{kind}" if self.cp > 1 else ""
        ep = f",ep={self.ep}" if self.ep > 1 else ""
        return f"dp_replicate={self.dp_replicate},dp_shard={self.dp_shard}{cp},tp={self.tp},pp={self.pp}{ep}"


def local_rows_cols(name: str, shape: tuple[int, ...], layout: Layout) -> tuple[int, int]:
    """Rank 0's (rows, columns) of a parameter: TP's split, then FSDP's dim-0 chunk (the first
    chunk is the largest: ceil)."""
    rows, cols = shape[0], math.prod(shape[1:])
    if WHOLE in name:
        return rows, cols
    if layout.tp > 1 and name.endswith(COLWISE):
        rows //= layout.tp
    elif layout.tp > 1 and name.endswith(ROWWISE):
        cols //= layout.tp
    return rows, cols


def rank_stages(cfg: JobConfig, pp_rank: int) -> list[int] | None:
    """The pipeline stages a pp rank runs (None without a pipeline)."""
    from plait.parallel.stages import stage_indices, stages_per_rank

    p = cfg.parallelism
    return None if p.pp == 1 else stage_indices(pp_rank, p.pp, stages_per_rank(cfg), p.pp_schedule)


def stage_count(cfg: JobConfig) -> int:
    from plait.parallel.stages import stages_per_rank

    return cfg.parallelism.pp * stages_per_rank(cfg)


def stage_blocks(args: ModelArgs, cfg: JobConfig, stage: int) -> range:
    from plait.parallel.stages import split_blocks

    return split_blocks(args.n_layers, stage_count(cfg), cfg.parallelism.pp_split_points)[stage]


@functools.cache
def parameter_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every parameter; a multi-token prediction module's block named as the
    block after the model's (`layers.<n_layers + k>`: a unit of its own, as FSDP2 wraps it)."""
    with torch.device("meta"):
        params = Transformer(args).named_parameters()
    return {plan_name(name, args): tuple(p.shape) for name, p in params}


def plan_name(name: str, args: ModelArgs) -> str:
    """A model's parameter or module name as plan names it (`mtp.<k>.block.` -> `layers.<n_layers + k>.`)."""
    return re.sub(r"^mtp\.(\d+)\.block\.", lambda m: f"layers.{args.n_layers + int(m[1])}.", name)


def rank_parameters(args: ModelArgs, cfg: JobConfig, stages: list[int] | None) -> dict[str, tuple[int, ...]]:
    """Name -> shape of the parameters of the pipeline stages a rank runs (all, without a pipeline).
    (Shared between calls: read, never change, what it returns.)"""
    shapes = parameter_shapes(args)
    if stages is None:
        return shapes
    last = stage_count(cfg) - 1 in stages  # (with multi-token prediction: its module and a copy of the embedding)
    keep = tuple(f"layers.{i}." for stage in stages for i in stage_blocks(args, cfg, stage))
    keep += ("tok_embeddings.",) * (0 in stages or last and args.mtp_layers > 0) + ("norm.", "output.") * last
    keep += tuple(f"layers.{args.n_layers + k}." for k in range(args.mtp_layers)) + ("mtp.",) if last else ()
    return kept_parameters(args, keep)


@functools.cache
def kept_parameters(args: ModelArgs, keep: tuple[str, ...]) -> dict[str, tuple[int, ...]]:
    return {n: s for n, s in parameter_shapes(args).items() if n.startswith(keep)}


def holds_output(args: ModelArgs, params: dict) -> bool:
    """Whether these parameters' stage computes the logits (tied, the embedding's matrix does)."""
    return "output.weight" in params or (args.tie_embeddings and "tok_embeddings.weight" in params)


def block_indices(unit_names: list[str]) -> set[int]:
    return {int(name.split(".")[1]) for name in unit_names}


def units(params: dict[str, tuple[int, ...]]) -> dict[str, dict[str, tuple[int, ...]]]:
    """FSDP units: one per block, the rest in the root. (`plait plan` asks this of the same
    parameters for every layout it weighs: cached by content, shared between calls.)"""
    return grouped_units(tuple(params.items()))


@functools.lru_cache(maxsize=1024)
def grouped_units(params: tuple[tuple[str, tuple[int, ...]], ...]) -> dict[str, dict[str, tuple[int, ...]]]:
    grouped: dict[str, dict] = {}
    for name, shape in params:
        key = ".".join(name.split(".")[:2]) if name.startswith("layers.") else "root"
        grouped.setdefault(key, {})[name] = shape
    return grouped


def state_bytes(params: dict[str, tuple[int, ...]], layout: Layout, optimizer: str = "adamw", ema: bool = False) -> int:
    """fp32 parameter + fp32 gradient + AdamW exp_avg and exp_avg_sq, per element; and AdamW's
    step counter (a float32 scalar tensor) per parameter. Under Muon its matrices hold one
    momentum instead of the two moments (plait/optim/optimizers.py); training.ema adds one fp32
    copy in the parameters' sharding (plait/ema.py). (Cached as `units` is.)"""
    return parameters_state_bytes(tuple(params.items()), layout, optimizer, ema)


@functools.lru_cache(maxsize=1 << 12)
def parameters_state_bytes(params: tuple[tuple[str, tuple[int, ...]], ...], layout: Layout, optimizer: str,
                           ema: bool) -> int:
    total = 0
    for name, shape in params:
        rows, cols = local_rows_cols(name, shape, layout)
        muon = optimizer == "muon" and uses_muon(name, torch.empty(shape, device="meta"))
        total += math.ceil(rows / layout.shard) * cols * ((12 if muon else 16) + 4 * ema) + 4
    return total


def shard_elements(params: dict[str, tuple[int, ...]], layout: Layout) -> int:
    """Elements of rank 0's shards of these parameters: TP's split, then FSDP's dim-0 chunk.
    (Cached as `units` is.)"""
    return parameters_shard_elements(tuple(params.items()), layout)


@functools.lru_cache(maxsize=1 << 12)
def parameters_shard_elements(params: tuple[tuple[str, tuple[int, ...]], ...], layout: Layout) -> int:
    return sum(math.ceil(rows / layout.shard) * cols
               for rows, cols in (local_rows_cols(name, shape, layout) for name, shape in params))


def gathered_elements(unit: dict[str, tuple[int, ...]], layout: Layout) -> int:
    """Elements of a unit's FSDP all-gather: every parameter's TP piece (an expert tensor's ep
    piece), rows padded to a multiple of the shard degree. (Cached as `units` is.)"""
    return gathered_bytes(unit, layout, frozenset(), 1)


def gathered_bytes(unit: dict[str, tuple[int, ...]], layout: Layout, one_byte: frozenset[str], others: int) -> int:
    """Bytes of a unit's FSDP all-gather: the `one_byte` parameters' elements (float8's) one byte
    each, the others' `others` bytes. (Cached as `units` is.)"""
    return gathered_unit_bytes(tuple(unit.items()), layout, one_byte, others)


@functools.lru_cache(maxsize=1 << 16)
def gathered_unit_bytes(unit: tuple[tuple[str, tuple[int, ...]], ...], layout: Layout, one_byte: frozenset[str],
                        others: int) -> int:
    return sum(gathered_parameter_elements(name, shape, layout) * (1 if name in one_byte else others)
               for name, shape in unit)


@functools.lru_cache(maxsize=1 << 16)
def gathered_parameter_elements(name: str, shape: tuple[int, ...], layout: Layout) -> int:
    """One parameter's share of its unit's all-gather (`gathered_elements`)."""
    rows, cols = local_rows_cols(name, shape, layout)
    degree = layout.shard
    if layout.ep > 1 and ".experts." in name:  # experts (E, ...): E / ep here, sharded over dp_shard x cp / ep
        rows, degree = rows // layout.ep, max(1, layout.shard // layout.ep)
    return math.ceil(rows / degree) * degree * cols
