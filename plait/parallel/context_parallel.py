"""Context parallelism: every sequence split over the `cp` ranks, attention exact as unsharded.

A sequence of S tokens is cut into 2·cp chunks and cp rank r holds chunks r and 2·cp-1-r: under
a causal mask the early chunks' queries see few keys and the late ones many, so pairing one of
each gives every rank the same attention work. Tokens, labels, RoPE positions and the mask's
query rows are sharded together, before the model (`BatchLayout`); parameters are the same on
every cp rank, which FSDP2 shards over dp_shard x cp like data-parallel ranks.

Attention needs each query against the whole sequence's keys and values: every layer all-gathers
K and V over the cp group (forward) and reduce-scatters their gradients (backward), then puts
the gathered chunks back in sequence order, so each query row meets the same keys in the same
order as without cp. K/V travel in the compute dtype, and so do their gradients: each rank's
partial dK/dV is already rounded to it by the attention kernel, and at cp 2 a sum of two
operands rounds once whether it is taken in bf16 or in fp32 (at larger cp bf16 rounds once per
partial sum). This all-gather form runs on gloo as on NCCL; it holds the full K/V of one layer
at a time (a ring that passes them rank to rank would hold two chunks; plait has none yet).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from plait.config import ConfigError, JobConfig
from plait.models.masking import allowed, block_mask, document_ids, positions_in_documents
from plait.models.moe import moe_layers


def check_context_parallel(cfg: JobConfig) -> None:
    """cp against the other options, before any process group: one line each."""
    p, t = cfg.parallelism, cfg.training
    if p.cp == 1:
        return
    if p.dp_backend != "fsdp2":
        raise ConfigError(f"parallelism.dp_backend: {p.dp_backend} cannot run with cp > 1 (its parameters would be "
                          "reduced over dp only, and the cp ranks hold parts of one sequence whose gradients must be "
                          "averaged too); allowed with cp > 1: fsdp2 (DDP, FSDP2, HSDP over dp x cp)")
    if t.seq_len % (2 * p.cp):
        raise ConfigError(f"training.seq_len: {t.seq_len} does not split into 2 x cp = {2 * p.cp} equal chunks "
                          f"(parallelism.cp {p.cp} load-balances causal attention with two chunks per rank); "
                          f"allowed: a multiple of {2 * p.cp}")
    if p.tp > 1 and p.sequence_parallel and (t.seq_len // p.cp) % p.tp:
        raise ConfigError(f"training.seq_len: each cp rank's {t.seq_len // p.cp} tokens do not split over tp {p.tp} "
                          f"(parallelism.sequence_parallel); allowed: a multiple of {math.lcm(2 * p.cp, p.cp * p.tp)}")


def chunk_indices(seq_len: int, rank: int, cp: int, device=None) -> torch.Tensor:
    """The sequence indices cp rank `rank` holds: chunks rank and 2·cp-1-rank of 2·cp."""
    chunk = seq_len // (2 * cp)
    index = torch.arange(seq_len, device=device).view(2 * cp, chunk)
    return torch.cat([index[rank], index[2 * cp - 1 - rank]])


def sequence_order(gathered: torch.Tensor, cp: int, dim: int) -> torch.Tensor:
    """Chunks all-gathered rank by rank ([r0: c0 c2cp-1][r1: c1 c2cp-2]...) back in order c0 c1 ... c2cp-1."""
    parts = gathered.unflatten(dim, (cp, 2, -1))
    first, second = parts.select(dim + 1, 0), parts.select(dim + 1, 1).flip(dim)
    return torch.cat([first, second], dim).flatten(dim, dim + 1)


class BatchLayout:
    """What this rank's model gets of each micro-batch: (tokens, labels, forward kwargs). Under the
    causal mask without cp, the batch as it is (SDPA's causal path); else RoPE positions and a
    mask (plait/models/masking.py) for this rank's share of the sequence."""

    def __init__(self, mask: str, kernel: str, eos: int, cp_rank: int, cp: int):
        self.document, self.kernel, self.eos, self.rank, self.cp = mask == "document", kernel, eos, cp_rank, cp

    def __call__(self, inputs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
        if not self.document and self.cp == 1:
            return inputs, labels, {}
        batch, seq = inputs.shape
        queries = chunk_indices(seq, self.rank, self.cp, inputs.device)
        if self.document:
            documents = document_ids(inputs, self.eos)
            positions = positions_in_documents(documents)
        else:
            documents = torch.zeros_like(inputs)
            positions = torch.arange(seq, device=inputs.device).expand(batch, -1)
        mask = block_mask(documents, queries) if self.kernel == "flex" else allowed(documents, queries)
        if self.cp == 1:  # the whole sequence: nothing to shard
            return inputs, labels, {"positions": positions, "mask": mask}
        return inputs[:, queries], labels[:, queries], {"positions": positions[:, queries], "mask": mask}


def apply_cp(model: nn.Module, cp_mesh: DeviceMesh) -> None:
    """Hand every attention kernel the whole sequence's keys and values and where its queries
    lie in the sequence (a pre-hook on each block's `attention.core`), and every mixture of
    experts the sum over the cp ranks of its routing's counts: the model itself is untouched."""
    group, cp, rank = cp_mesh.get_group(), cp_mesh.size(), cp_mesh.get_local_rank()

    def whole_sequence(module, args):
        q, k, v, mask = args
        # [batch, heads, seq, head_dim]: gathered along the sequence, with autograd (the
        # backward reduce-scatters the gradients); funcol keeps it traceable by torch.compile.
        k, v = (sequence_order(funcol.all_gather_tensor_autograd(t.contiguous(), gather_dim=2, group=group), cp, 2)
                for t in (k, v))
        chunk = q.shape[2] // 2  # this rank's queries: chunks rank and 2·cp-1-rank, where they lie
        return q, k, v, mask, ((rank * chunk, chunk), ((2 * cp - 1 - rank) * chunk, chunk))

    for block in model.layers.values():
        block.attention.core.register_forward_pre_hook(whole_sequence)
    for moe in moe_layers(model):  # its load-balancing loss over whole sequences, not this rank's chunks
        moe.sequence_sum, moe.sequence_ranks = functools.partial(funcol.all_reduce, reduceOp="sum", group=group), cp
