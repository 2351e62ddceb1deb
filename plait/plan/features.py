"""What a job's options turn on that plan's counts depend on (the mask, Ulysses' degree, latent
gathers, sequence-wise balance, window tails, MXFP8 experts): shared by memory, comm and speed."""

from __future__ import annotations

import math

import torch

from plait import float8
from plait.config import JobConfig
from plait.models.args import ModelArgs


def ulysses_kv_heads(kv: int, n: int) -> int:
    """Key/value heads Ulysses splits over n ranks: kv, or repeated up to the least multiple of n."""
    return math.lcm(kv, n) if kv % n else kv


def ulysses_degree(cfg: JobConfig) -> int:
    """The ranks a layer's heads are split over by all-to-all: cp under Ulysses, cp_ulysses under
    hybrid, else 1 (keys and values all-gathered over the rest of cp)."""
    p = cfg.parallelism
    return {"ulysses": p.cp, "hybrid": p.cp_ulysses}.get(p.cp_kind, 1) if p.cp > 1 else 1


def masked(cfg: JobConfig, own_mask: bool = False) -> bool:
    """Whether attention runs under a mask built from document ids: the document mask, causal
    rows under all-gather or hybrid cp (Ulysses' whole sequences take SDPA's causal path), or a
    block with a mask of its own (ModelArgs.own_mask: a sliding window, sinks, an attention chunk)."""
    return cfg.model.attention_mask == "document" or 1 < cfg.parallelism.cp != ulysses_degree(cfg) or own_mask


def mx_experts(args: ModelArgs, cfg: JobConfig, e: int) -> bool:
    """Whether the experts' grouped matmuls run MXFP8 (bf16 compute, whole blocks); builds a model only under MXFP8."""
    if not (float8.microscaling(cfg.training.float8) and args.n_experts and e == 2):
        return False
    return not any(float8.expert_plan(args, cfg.training.float8, torch.device("cpu"), torch.bfloat16).values())


def latent_gather(cfg: JobConfig) -> bool:
    """Latent attention under all-gather cp gathers each token's key latent and RoPE key and
    expands them on every rank (cp_gather latent), not every head's keys and values."""
    p = cfg.parallelism
    return p.cp > 1 and p.cp_kind == "allgather" and p.cp_gather == "latent"


def sequence_aux(args: ModelArgs, cfg: JobConfig) -> bool:
    """A sigmoid router's layers compute DeepSeek-V3's sequence-wise loss (moe_sequence_aux_coef)."""
    return bool(args.n_experts) and args.router != "softmax" and cfg.training.moe_sequence_aux_coef > 0


def window_tail_keys(args: ModelArgs, cfg: JobConfig, block: int, tokens: int) -> int:
    """Under all-gather cp, the keys a rank gathers for a sliding (or chunked) block whose window
    (attention chunk) fits in a chunk: window - 1 before each of its two chunks of each sequence
    (0: it gathers them all)."""
    p, tail = cfg.parallelism, args.reach(block) - 1
    sequences = tokens * p.cp // cfg.training.seq_len
    fits = p.cp > 1 and p.cp_kind == "allgather" and 0 < tail <= cfg.training.seq_len // (2 * p.cp)
    return 2 * sequences * tail if fits else 0
