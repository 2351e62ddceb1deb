"""Batches: packed sequences in an order that depends only on (seed, step), never on the layout.

Each source's token stream is cut into sequences of seq_len + 1 tokens (the last label needs one
more); its sequences are read in an endless series of epochs, each a fresh pseudo-random
permutation. The permutation is a keyed bijection computed per position (a Feistel network), so
it takes no memory however large the corpus.

Step k fills global-batch positions [0, G): with one source, position i is that source's
sequence k*G + i; with a mixture, each position draws its source from the weights, seeded by
(seed, step), and takes that source's next sequence. Data-parallel rank r takes the contiguous
share r of the G positions, cut into micro-batches, so any dp degree and micro-batch size trains
on the same data per step. The loader's state (step, sequences used per source) is JSON in the
checkpoint, and a resumed run continues exactly, with the same global batch or another (the
stream goes on where it stopped). A growing run (plait/data/batch_schedule.py) draws each step's
own number of sequences, and may cut each into shorter ones; a phase (plait/data/phases.py) draws
from its own mixture, whose sources the run's data may not hold (after the run's own, in `sources`).
"""

from __future__ import annotations

import numpy as np
import torch

from plait.config import ConfigError
from plait.data.batch_schedule import BatchSchedule

ROUNDS = 6
_MIX = 0x6D6978  # separates the mixture's random stream from the permutations'


def _mix64(x: np.ndarray) -> np.ndarray:
    # splitmix64's finaliser: every input bit flips each output bit with probability ~1/2
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def permute(positions: np.ndarray, n: int, key: list[int]) -> np.ndarray:
    """A pseudo-random bijection of [0, n) keyed by `key`, applied to `positions`: a balanced
    Feistel network on the smallest power of 4 >= n, repeated while a value falls outside
    [0, n) (cycle walking: the result stays a bijection of [0, n))."""
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half) - 1)
    keys = np.random.default_rng(key).integers(0, 1 << 63, ROUNDS, dtype=np.uint64)
    out = np.asarray(positions, dtype=np.uint64).copy()
    todo = np.ones(len(out), dtype=bool)
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps by design
        while todo.any():
            left, right = out[todo] >> np.uint64(half), out[todo] & mask
            for k in keys:
                left, right = right, left ^ (_mix64(right ^ k) & mask)
            out[todo] = (left << np.uint64(half)) | right
            todo = out >= n
    return out.astype(np.int64)


class BatchLoader:
    def __init__(self, sources: list, weights: list[float], seq_len: int, global_batch_size: int,
                 micro_batch_size: int, dp_rank: int, dp_size: int, seed: int, schedule: BatchSchedule | None = None,
                 phase_weights: dict[int, list[float]] | None = None):
        """`weights`: the run's own sources' (the first of `sources`); `phase_weights`: a phase's
        number -> its mixture's weight for each of `sources`."""
        self.sources, self.seq_len, self.seed = sources, seq_len, seed
        self.own = len(weights)  # the run's own sources: the rest are phases'
        self.phase_weights = {number: [w / sum(ws) for w in ws] for number, ws in (phase_weights or {}).items()}
        self.schedule = schedule or BatchSchedule(seq_len, global_batch_size)
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        option = "data.mix" if len(weights) > 1 else "data.path"
        for i, (source, n) in enumerate(zip(sources, self.num_sequences)):
            if n < global_batch_size:
                raise ConfigError(
                    f"{option if i < self.own else 'training.phases'}: {getattr(source, 'label', 'the corpus')} has "
                    f"{len(source)} tokens = {n} sequences of "
                    f"training.seq_len={seq_len}, fewer than training.global_batch_size={global_batch_size}")
        self.weights = [w / sum(weights) for w in weights] + [0.0] * (len(sources) - self.own)
        if global_batch_size % (dp_size * micro_batch_size):
            raise ConfigError(f"training.global_batch_size: {global_batch_size} must be a multiple of "
                              f"micro_batch_size ({micro_batch_size}) x dp degree ({dp_size})")
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.step = 0
        self.used = [0] * len(sources)  # sequences each source has given so far
        self.read_from: list[tuple[int, int, int]] = []  # the last step's rows: (source, first token, tokens) each

    @property
    def num_sequences(self) -> list[int]:
        return [(len(source) - 1) // self.seq_len for source in self.sources]

    def assignment(self, step: int, rows: int) -> np.ndarray:
        """The source of each of step's `rows` positions (`step` counts from 0): the same on every
        rank and in every layout."""
        phase = self.schedule.phases.at(step + 1) if self.schedule.phases else None
        weights = self.phase_weights.get(phase.number, self.weights) if phase else self.weights
        if len(self.sources) == 1:
            return np.zeros(rows, dtype=np.int64)
        draws = np.random.default_rng([self.seed, _MIX, step]).random(rows)
        # (the last source with any weight takes what rounding leaves past the sum)
        last = max(i for i, w in enumerate(weights) if w > 0)
        return np.minimum(np.searchsorted(np.cumsum(weights), draws, side="right"), last)

    def next_batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(inputs, labels) int64 [sequences, length] per micro-batch of this rank's next step:
        micro_batch_size sequences of seq_len, or under a sequence warm-up as many tokens in
        shorter sequences."""
        shape = self.schedule.shape(self.step + 1)
        source_of = self.assignment(self.step, shape.rows)
        index = np.empty(shape.rows, dtype=np.int64)  # each position's sequence count in its source
        for s in range(len(self.sources)):
            mine = source_of == s
            index[mine] = self.used[s] + np.arange(mine.sum())
            self.used[s] += int(mine.sum())
        count = shape.rows // self.dp_size
        share = slice(self.dp_rank * count, (self.dp_rank + 1) * count)  # this rank's contiguous part of the step
        rows, starts = [None] * count, [(0, 0)] * count
        for s, (source, n) in enumerate(zip(self.sources, self.num_sequences)):
            for epoch in np.unique(index[share][source_of[share] == s] // n).tolist():
                where = np.flatnonzero((source_of[share] == s) & (index[share] // n == epoch))
                sequences = permute(index[share][where] % n, n, [self.seed, s, epoch])
                for i, sequence in zip(where, sequences):
                    rows[i] = source.read(int(sequence) * self.seq_len, self.seq_len + 1)
                    starts[i] = (s, int(sequence) * self.seq_len)
        self.step += 1
        # each row cut into `pieces` sequences of `length` (+ the next token, the last label)
        seqs = torch.from_numpy(np.stack(rows)).unfold(1, shape.length + 1, shape.length).flatten(0, 1)
        self.read_from = [(s, first + piece * shape.length, shape.length + 1) for s, first in starts
                          for piece in range(shape.pieces)]
        return [(m[:, :-1].contiguous(), m[:, 1:].contiguous())
                for m in seqs.split(self.micro_batch_size * shape.pieces)]

    def describe_row(self, row: int, eos: int) -> str:
        """Where row `row` of this rank's last step was read: its source's shard file, tokens and
        documents (`eos` ends each)."""
        source, first, tokens = self.read_from[row]
        return self.sources[source].locate(first, tokens, eos)

    def state_dict(self) -> dict:
        """The run's own sources by position; the phases' by content (phases may change on resume)."""
        return {"step": self.step, "used": self.used[:self.own], "seq_len": self.seq_len,
                "global_batch_size": self.global_batch_size, "seed": self.seed,
                "num_sequences": self.num_sequences[:self.own], "weights": self.weights[:self.own],
                "phase_sources": {s.fingerprint: used for s, used in zip(self.sources[self.own:], self.used[self.own:])}}

    def load_state_dict(self, state: dict) -> None:
        # (not the global batch: the stream goes on where it stopped, in batches of any size)
        options = {"seq_len": "training.seq_len", "seed": "training.seed", "num_sequences": "data.path",
                   "weights": "data.mix"}
        mine = self.state_dict()
        for key, option in options.items():
            if state.get(key) != mine[key]:
                raise ConfigError(f"{option}: the checkpoint's data loader has {key}={state.get(key)} but this run "
                                  f"has {mine[key]}; resuming would not continue the same data order")
        self.step, self.used = int(state["step"]), [int(u) for u in state["used"]]
        self.used += [int(state.get("phase_sources", {}).get(s.fingerprint, 0)) for s in self.sources[self.own:]]


def eval_batches(source, seq_len: int, global_batch_size: int, micro_batch_size: int, dp_rank: int, dp_size: int,
                 steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's micro-batches of the validation set: the source's first steps x G sequences in
    order, step by step, each step split among dp ranks as training splits a step."""
    share = global_batch_size // dp_size
    rows = [source.read((step * global_batch_size + dp_rank * share + i) * seq_len, seq_len + 1)
            for step in range(steps) for i in range(share)]
    seqs = torch.from_numpy(np.stack(rows))
    return [(m[:, :-1].contiguous(), m[:, 1:].contiguous()) for m in seqs.split(micro_batch_size)]
