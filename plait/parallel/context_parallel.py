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
at a time.

Latent attention (MLA) gathers less (`cp_gather latent`): each token's normalised key latent
and RoPE key (kv_lora_rank + qk_rope_head_dim values, DeepSeek-V3's 576 against 128 heads x
(192 + 128) = 40,960 of keys and values), which every rank expands into the whole sequence's
keys and values itself (cp times wkv_b's work). The latents' gradients come back reduce-
scattered as K/V's do, and wkv_b's weight gradient, each rank's queries' share, is summed over
cp with every other weight's.

`cp_kind ulysses` (DeepSpeed-Ulysses) moves heads instead: an all-to-all turns each rank's
sequence chunks of q, k and v (every head) into the whole sequence of 1/cp of the heads;
attention runs locally on whole sequences, under whatever mask the model uses (SDPA's causal
path where it is causal), and a second all-to-all turns the output back into sequence chunks
of every head. Per layer it moves q, k, v and the output once each way (4 x tokens x heads /
cp), where the all-gather moves the whole sequence's K/V to every rank: Ulysses' bytes per rank
stay flat as cp grows, the all-gather's grow with it. Key/value heads split over cp too; where
cp does not divide them (grouped-query attention, or TP leaving one head per rank) they are
repeated up to the least multiple of cp first, each query head still meeting its own group's
keys, as DeepSpeed and torchtitan do.
"""

from __future__ import annotations

import copy
import functools
import math

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from plait.config import ConfigError, JobConfig
from plait.models.args import ModelArgs
from plait.models.linear_attention import GatedDeltaNet
from plait.models.masking import block_mask, chunk_segments, document_ids, positions_in_documents
from plait.models.moe import moe_layers
from plait.parallel.linear_context import apply_linear_cp, owner_index


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
    if p.cp_kind == "hybrid" and not (1 < p.cp_ulysses < p.cp and p.cp % p.cp_ulysses == 0):
        raise ConfigError(f"parallelism.cp_ulysses: {p.cp_ulysses} with cp_kind hybrid must divide cp {p.cp} and lie "
                          f"strictly between 1 and it (1 is allgather, cp is ulysses); allowed: "
                          f"{[d for d in range(2, p.cp) if p.cp % d == 0] or 'none at this cp'}")
    if p.cp_kind != "hybrid" and p.cp_ulysses:
        raise ConfigError(f"parallelism.cp_ulysses: {p.cp_ulysses} is the Ulysses degree of cp_kind hybrid; with "
                          f"cp_kind {p.cp_kind} allowed: 0")
    if p.tp > 1 and p.sequence_parallel and (t.seq_len // p.cp) % p.tp:
        raise ConfigError(f"training.seq_len: each cp rank's {t.seq_len // p.cp} tokens do not split over tp {p.tp} "
                          f"(parallelism.sequence_parallel); allowed: a multiple of {math.lcm(2 * p.cp, p.cp * p.tp)}")


def check_heads(args: ModelArgs, cfg: JobConfig) -> None:
    """Ulysses splits each tp rank's query heads over cp (hybrid: over cp_ulysses): one line
    before any process group."""
    p = cfg.parallelism
    heads = args.n_heads // p.tp
    if p.cp > 1 and p.cp_kind == "ulysses" and heads % p.cp:
        raise ConfigError(f"parallelism.cp: {p.cp} does not divide the {heads} query heads each tp rank holds "
                          f"(parallelism.cp_kind ulysses splits them over cp); allowed: a divisor of {heads}, or "
                          f"cp_kind allgather or hybrid")
    if p.cp > 1 and p.cp_kind == "hybrid" and heads % p.cp_ulysses:
        raise ConfigError(f"parallelism.cp_ulysses: {p.cp_ulysses} does not divide the {heads} query heads each tp "
                          f"rank holds; allowed: a divisor of {heads} and of cp {p.cp}")


def chunk_indices(seq_len: int, rank: int, cp: int, device=None) -> torch.Tensor:
    """The sequence indices cp rank `rank` holds: chunks rank and 2·cp-1-rank of 2·cp."""
    if cp == 1:  # the whole sequence in order, of any length (an odd one has no two equal chunks)
        return torch.arange(seq_len, device=device)
    chunk = seq_len // (2 * cp)
    index = torch.arange(seq_len, device=device).view(2 * cp, chunk)
    return torch.cat([index[rank], index[2 * cp - 1 - rank]])


def sequence_order(gathered: torch.Tensor, cp: int, dim: int) -> torch.Tensor:
    """Chunks all-gathered rank by rank ([r0: c0 c2cp-1][r1: c1 c2cp-2]...) back in order c0 c1 ... c2cp-1."""
    parts = gathered.unflatten(dim, (cp, 2, -1))
    first, second = parts.select(dim + 1, 0), parts.select(dim + 1, 1).flip(dim)
    return torch.cat([first, second], dim).flatten(dim, dim + 1)


def rank_order(x: torch.Tensor, cp: int, dim: int) -> torch.Tensor:
    """The inverse of `sequence_order`: chunks c0 ... c2cp-1 regrouped as [r0: c0 c2cp-1][r1: c1 c2cp-2]..."""
    parts = x.unflatten(dim, (2, cp, -1))
    first, second = parts.select(dim, 0), parts.select(dim, 1).flip(dim)
    return torch.stack([first, second], dim + 1).flatten(dim, dim + 2)


def heads_to_ranks(x: torch.Tensor, n: int, group) -> torch.Tensor:
    """[batch, heads, chunk, d] of every head -> [batch, heads / n, n x chunk, d]: this rank's
    share of the heads over the chunks of the n ranks of `group`, rank by rank (one all-to-all,
    with autograd)."""
    batch, heads, chunk, d = x.shape
    x = x.reshape(batch, n, heads // n, chunk, d).movedim(1, 0).contiguous()  # slice j goes to rank j
    x = funcol.all_to_all_single_autograd(x, None, None, group)  # slice j came from rank j: its chunks
    return x.movedim(0, 2).flatten(2, 3)


def ranks_to_heads(x: torch.Tensor, n: int, group) -> torch.Tensor:
    """The inverse of `heads_to_ranks`: [batch, heads / n, n x chunk, d] -> [batch, heads, chunk, d]."""
    batch, heads, length, d = x.shape
    x = x.unflatten(2, (n, length // n)).movedim(2, 0).contiguous()  # rank j's chunks go back to rank j
    x = funcol.all_to_all_single_autograd(x, None, None, group)  # slice j: heads group j of this rank's chunks
    return x.movedim(0, 1).flatten(1, 2)


def repeat_kv(x: torch.Tensor, cp: int) -> torch.Tensor:
    """Key/value heads repeated (each in place, so query head i still meets group i // (heads /
    kv heads)) up to the least multiple of cp: all-to-all splits them over cp."""
    kv = x.shape[1]
    return x.repeat_interleave(math.lcm(kv, cp) // kv, dim=1) if kv % cp else x


class BatchLayout:
    """What this rank's model gets of each micro-batch: (tokens, labels, forward kwargs). Under the
    causal mask without cp, the batch as it is (SDPA's causal path); else RoPE positions and a
    mask (plait/models/masking.py) for this rank's share of the sequence. Under Ulysses
    (`whole_sequences`: attention meets whole sequences) the causal mask needs no mask either.
    FlexAttention gets a BlockMask per (window, chunk) of the model's blocks (`spans`, 0 = none),
    and the document ids. A model
    that predicts further tokens (multi-token prediction) gets tokens t+1 and t+2 of each position."""

    def __init__(self, mask: str, kernel: str, eos: int, cp_rank: int, cp: int, whole_sequences: bool = False,
                 spans: tuple[tuple[int, int], ...] = ((0, 0),), predicts_further: bool = False):
        self.document, self.kernel, self.eos, self.rank, self.cp = mask == "document", kernel, eos, cp_rank, cp
        self.whole_sequences, self.spans, self.predicts_further = whole_sequences, spans, predicts_further

    def causal(self) -> BatchLayout:
        """This layout under the causal mask (cp's split and kernel unchanged): for evaluation
        requests, each one text scored as `plait eval` and lm-evaluation-harness score it, an
        end-of-text token in a context restarting neither attention nor RoPE positions."""
        plain = copy.copy(self)
        plain.document = False
        return plain

    def flex_masks(self, documents: torch.Tensor, queries: torch.Tensor) -> dict:
        """FlexAttention's BlockMask by (window, chunk), and the document ids (linear attention's restarts)."""
        return {(window, chunk): block_mask(chunk_segments(documents, chunk), queries, window or chunk)
                for window, chunk in self.spans} | {"documents": documents}

    def __call__(self, inputs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
        mine, my_labels, kwargs = self.split(inputs, labels)
        if self.predicts_further:  # multi-token prediction: tokens t+1 and t+2 (-100 past the sequence's end)
            further = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)
            if self.cp > 1:  # (shifted on the whole sequence: a chunk's last t+2 is the next chunk's)
                further = further[:, chunk_indices(labels.shape[1], self.rank, self.cp, labels.device)]
            kwargs["next_tokens"] = (my_labels, further)
        return mine, my_labels, kwargs

    def split(self, inputs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
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
        mask = {"mask": self.flex_masks(documents, queries) if self.kernel == "flex" else documents}
        if not self.document and self.whole_sequences:
            mask = {}  # SDPA's causal path, on each head's whole sequence
        if self.cp == 1:  # the whole sequence: nothing to shard
            return inputs, labels, {"positions": positions, **mask}
        return inputs[:, queries], labels[:, queries], {"positions": positions[:, queries], **mask}


def apply_cp(model: nn.Module, cp_mesh: DeviceMesh, kind: str = "allgather", ulysses_degree: int = 0,
             latent: bool = True) -> None:
    """Hand every attention kernel what it needs of the whole sequence (forward hooks on each
    block's `attention.core`): under allgather the sequence's keys and values and where its
    queries lie in the sequence; under ulysses the whole sequence of its share of the heads, its
    output turned back into this rank's chunks; under hybrid Ulysses over groups of
    `ulysses_degree` neighbouring cp ranks, then the all-gather of those heads' keys and values
    over the groups. Under allgather latent attention (`latent`) gathers its key latents and RoPE
    keys instead (a forward hook on `attention.key_latents`): its kernel gets whole keys already.
    Every mixture of experts gets the sum over the cp ranks of its routing's counts; every linear-
    attention block its chunks' incoming states and windows (plait/parallel/linear_context.py). The
    model itself is untouched."""
    group, cp, rank = cp_mesh.get_group(), cp_mesh.size(), cp_mesh.get_local_rank()
    n, heads_group = (cp, group) if kind == "ulysses" else (ulysses_degree, None)  # heads split over n ranks
    if kind == "hybrid":  # cp rank = group index x ulysses_degree + rank in its Ulysses group
        split = cp_mesh._unflatten(0, (cp // ulysses_degree, ulysses_degree), ("cp_allgather", "cp_ulysses"))
        heads_group, keys_group = split["cp_ulysses"].get_group(), split["cp_allgather"].get_group()

    def chunk_runs(ranks, chunk: int) -> tuple[tuple[int, int], ...]:
        """Where the chunks of cp ranks `ranks` lie in the sequence: chunks r and 2·cp-1-r of each."""
        return tuple(run for r in ranks for run in ((r * chunk, chunk), ((2 * cp - 1 - r) * chunk, chunk)))

    def window_keys(x: torch.Tensor, chunk: int, tail: int) -> torch.Tensor:
        """This rank's two chunks, each after the `tail` keys before it (chunk 0: none): every
        rank's chunks' tails all-gathered (with autograd), not the whole sequence."""
        tails = torch.cat([x[:, :, chunk - tail:chunk], x[:, :, 2 * chunk - tail:]], dim=2).contiguous()
        every = funcol.all_gather_tensor_autograd(tails, gather_dim=2, group=group)  # rank by rank, 2 tails each
        segments = []
        for i, c in enumerate((rank, 2 * cp - 1 - rank)):
            if c > 0:  # chunk c - 1's tail, from the rank holding it (first or second of its chunks)
                at = owner_index(c - 1, cp)
                segments.append(every[:, :, at * tail:(at + 1) * tail])
            segments.append(x[:, :, i * chunk:(i + 1) * chunk])
        return torch.cat(segments, dim=2)

    def window_runs(chunk: int, tail: int) -> tuple[tuple[int, int], ...]:
        """Where the keys `window_keys` returns lie in the sequence."""
        return tuple((c * chunk - tail, tail + chunk) if c > 0 else (0, chunk) for c in (rank, 2 * cp - 1 - rank))

    def whole_sequence(module, args):
        q, k, v, mask = args
        chunk, tail = q.shape[2] // 2, module.reach - 1
        if 0 < tail <= chunk:  # a window (or attention chunk) within a chunk: each chunk's predecessor's tail
            k, v = (window_keys(t, chunk, tail) for t in (k, v))
            return q, k, v, mask, chunk_runs([rank], chunk), window_runs(chunk, tail)
        # [batch, heads, seq, head_dim]: gathered along the sequence, with autograd (the
        # backward reduce-scatters the gradients); funcol keeps it traceable by torch.compile.
        k, v = (sequence_order(funcol.all_gather_tensor_autograd(t.contiguous(), gather_dim=2, group=group), cp, 2)
                for t in (k, v))
        return q, k, v, mask, chunk_runs([rank], chunk)

    def whole_latents(module, args, out):
        # [batch, seq, ...]: gathered along the sequence, with autograd, as K/V are
        return tuple(sequence_order(funcol.all_gather_tensor_autograd(t.contiguous(), gather_dim=1, group=group), cp, 1)
                     for t in out)

    def keys_already_whole(module, args):
        q, k, v, mask = args
        return q, k, v, mask, chunk_runs([rank], q.shape[2] // 2)

    def my_heads(heads: int) -> slice:
        """The query heads `heads_to_ranks` leaves this rank (for their sinks)."""
        share = heads // n
        return slice(rank % n * share, (rank % n + 1) * share)

    def head_shards(module, args):
        q, k, v, mask = args
        heads = my_heads(q.shape[1])
        q, k, v = (sequence_order(heads_to_ranks(t, cp, group), cp, 2) for t in (q, repeat_kv(k, cp), repeat_kv(v, cp)))
        return q, k, v, mask, (), (), heads  # the whole sequence's queries: the mask's rows are all of it

    def head_shards_then_keys(module, args):
        q, k, v, mask = args
        chunk, heads = q.shape[2] // 2, my_heads(q.shape[1])
        q, k, v = (heads_to_ranks(t, n, heads_group) for t in (q, repeat_kv(k, n), repeat_kv(v, n)))
        k, v = (sequence_order(funcol.all_gather_tensor_autograd(t, gather_dim=2, group=keys_group), cp, 2)
                for t in (k, v))
        first = rank - rank % n  # the queries: this Ulysses group's chunks, rank by rank
        return q, k, v, mask, chunk_runs(range(first, first + n), chunk), (), heads

    def back_to_chunks(module, args, out):
        return ranks_to_heads(rank_order(out, cp, 2) if kind == "ulysses" else out, n, heads_group)

    pre_hook = {"allgather": whole_sequence, "ulysses": head_shards, "hybrid": head_shards_then_keys}[kind]
    for block in model.blocks():
        if isinstance(block.attention, GatedDeltaNet):
            apply_linear_cp(block.attention, group, rank, cp)
            continue
        if kind == "allgather" and latent and hasattr(block.attention, "key_latents"):
            block.attention.key_latents.register_forward_hook(whole_latents)
            block.attention.core.register_forward_pre_hook(keys_already_whole)
            continue
        block.attention.core.register_forward_pre_hook(pre_hook)
        if kind != "allgather":
            block.attention.core.register_forward_hook(back_to_chunks)
    for moe in moe_layers(model):  # its load-balancing loss over whole sequences, not this rank's chunks
        moe.sequence_sum, moe.sequence_ranks = functools.partial(funcol.all_reduce, reduceOp="sum", group=group), cp
