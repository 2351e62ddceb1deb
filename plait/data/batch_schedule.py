"""What each step trains on when a run grows: the batch ramps up (training.batch_rampup) and the
sequence length warms up (training.seq_len_warmup), each a function of the tokens trained before
the step, so a resumed run computes every step's shape as the uninterrupted run did.

A step draws `rows` rows of training.seq_len tokens in the data loader's order (plait/data/loader.py)
and cuts each row into seq_len / length sequences of `length` tokens. A shorter length is the same
tokens in shorter sequences: a warm-up run trains, step by step, on exactly the tokens the run
without one trains on, and tokens per step follow the batch ramp alone.

- Batch: START + (G - START) x tokens / TOKENS rows, rounded down to a multiple of START, from START up
  to G = global_batch_size. START is a multiple of micro_batch_size x dp degree (every rank's
  micro-batches whole and equal), so every batch is; and the batches are the same in every layout
  that allows START, which the parity of layouts needs.
- Length: START + (seq_len - START) x tokens / TOKENS, rounded down to the longest length at most that
  which divides seq_len and the layout splits (cp's 2 x cp chunks, sequence parallelism's tp ranks).
  A micro-batch keeps its tokens: micro_batch_size x seq_len / length sequences of the length.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from plait.config import ConfigError, JobConfig, dp_degree
from plait.data.mixture import mix_sources
from plait.data.phases import Phases


@dataclass(frozen=True)
class StepShape:
    rows: int  # rows of seq_len tokens the step draws, over every data-parallel rank
    length: int  # tokens per sequence the model trains on
    seq_len: int

    @property
    def pieces(self) -> int:
        """Sequences each row is cut into."""
        return self.seq_len // self.length

    @property
    def sequences(self) -> int:
        return self.rows * self.pieces

    @property
    def tokens(self) -> int:
        return self.rows * self.seq_len


class BatchSchedule:
    """Each step's shape and the tokens trained before it (steps count from 1). `rampup` and
    `warmup`: (START, TOKENS), (0, 0) for none; `lengths`: the lengths a warm-up may use."""

    def __init__(self, seq_len: int, global_batch_size: int, rampup: tuple[int, int] = (0, 0),
                 warmup: tuple[int, int] = (0, 0), lengths: tuple[int, ...] = ()):
        self.seq_len, self.global_batch_size = seq_len, global_batch_size
        self.rampup, self.warmup, self.lengths = tuple(rampup), tuple(warmup), sorted(lengths)
        self.full = StepShape(global_batch_size, seq_len, seq_len)
        self.ends = max(self.rampup[1], self.warmup[1])  # tokens after which every step is full
        self.shapes: list[StepShape] = []  # of the steps before that, as far as asked (a ramp may outlast a run)
        self.before = [0]  # tokens trained before step i + 1
        self.phases: Phases | None = None  # (a phase's seq_len holds over the warm-up's)

    def _reach(self, step: int) -> None:
        while len(self.shapes) < step and self.before[-1] < self.ends:
            shape = self._shape_after(self.before[-1])
            self.shapes.append(shape)
            self.before.append(self.before[-1] + shape.tokens)

    @property
    def grows(self) -> bool:
        """Whether a step's batch or length may differ from the full step's."""
        return self.ends > 0 or bool(self.phases and any(p.seq_len for p in self.phases.phases))

    def _shape_after(self, tokens: int) -> StepShape:
        rows, length = self.global_batch_size, self.seq_len
        start, over = self.rampup
        if tokens < over:
            rows = (start + (self.global_batch_size - start) * tokens // over) // start * start
        start, over = self.warmup
        if tokens < over:
            target = start + (self.seq_len - start) * tokens // over
            length = max(n for n in self.lengths if n <= target)
        return StepShape(rows, length, self.seq_len)

    def shape(self, step: int) -> StepShape:
        self._reach(step)
        shape = self.shapes[step - 1] if step <= len(self.shapes) else self.full
        phase = self.phases.at(step) if self.phases else None
        return replace(shape, length=phase.seq_len) if phase and phase.seq_len else shape

    def tokens_before(self, step: int) -> int:
        """Tokens trained in steps 1 .. step - 1."""
        self._reach(step - 1)
        known = len(self.shapes)
        return self.before[min(step - 1, known)] + max(0, step - 1 - known) * self.full.tokens

    def describe(self, steps: int) -> str:
        """One line: how the run grows, and the tokens its `steps` train."""
        self._reach(steps)
        shapes = self.shapes[:steps]
        parts = []
        for on, name, size, full, unit in ((self.rampup[1], "batch ramp", lambda s: s.rows, self.global_batch_size,
                                            "sequences"),
                                           (self.warmup[1], "sequence warm-up", lambda s: s.length, self.seq_len,
                                            "tokens")):
            if on:
                growing = [size(s) for s in shapes if size(s) < full]
                sizes = " -> ".join(map(str, sorted(set(growing)) + [full]))
                parts.append(f"{name} {sizes} {unit} over steps 1-{len(growing)}" if len(growing) < steps else
                             f"{name} {sizes} {unit}, not done in {steps} steps")
        return f"{', '.join(parts)}: {self.tokens_before(steps + 1):,} tokens in {steps} steps"


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def splits(cfg: JobConfig, length: int) -> bool:
    """Whether the layout cuts a sequence of `length` tokens as it must: context parallelism into
    2 x cp equal chunks, sequence parallelism each cp rank's share over tp."""
    p = cfg.parallelism
    if p.cp > 1 and length % (2 * p.cp):
        return False
    return not (p.tp > 1 and p.sequence_parallel and (length // p.cp) % p.tp)


def batch_schedule(cfg: JobConfig) -> BatchSchedule:
    """The run's schedule and phases, from validated options (micro_batch_size filled in)."""
    t = cfg.training
    lengths = tuple(n for n in divisors(t.seq_len) if n >= t.seq_len_warmup[0] and splits(cfg, n)) \
        if t.seq_len_warmup[1] else ()
    schedule = BatchSchedule(t.seq_len, t.global_batch_size, t.batch_rampup, t.seq_len_warmup, lengths)
    if t.phases:  # (a phase from a number of tokens starts where the ramp's tokens put it)
        schedule.phases = Phases(t.phases, t.steps, schedule.tokens_before)
    return schedule


def check_growth(cfg: JobConfig) -> None:
    """training.batch_rampup, seq_len_warmup and phases against the batch, the length and the layout."""
    t = cfg.training
    granule = t.micro_batch_size * dp_degree(cfg)
    for name, (start, over) in (("batch_rampup", t.batch_rampup), ("seq_len_warmup", t.seq_len_warmup)):
        if over < 0 or start < 0 or bool(start) != bool(over):
            raise ConfigError(f"training.{name}: START TOKENS, both > 0 (or both 0 for none), got {start} {over}")
        if over and cfg.parallelism.pp > 1:
            raise ConfigError(f"training.{name}: not with parallelism.pp > 1 (the pipeline's schedule fixes its "
                              "micro-batches' number and shape when it is built)")
    start = t.batch_rampup[0]
    if start and (start % granule or start > t.global_batch_size):
        raise ConfigError(f"training.batch_rampup: a start batch of {start} sequences; allowed: a multiple of "
                          f"micro_batch_size x dp degree = {granule} (a smaller training.micro_batch_size allows "
                          f"smaller steps), at most global_batch_size {t.global_batch_size}")
    for phase in batch_schedule(cfg).phases.phases if t.phases else ():
        if phase.mix:  # (its sources exist: before any rank starts)
            mix_sources(phase.mix, f"training.phases: phase {phase.number}'s mix")
        length = phase.seq_len
        if length and (t.seq_len % length or not splits(cfg, length) or cfg.parallelism.pp > 1):
            raise ConfigError(f"training.phases: phase {phase.number}'s seq_len={length}; allowed: a length that "
                              f"divides training.seq_len {t.seq_len} and the layout splits, not under pipeline "
                              f"parallelism: {[n for n in divisors(t.seq_len) if splits(cfg, n)]}")
    start = t.seq_len_warmup[0]
    if start:
        allowed = [n for n in divisors(t.seq_len)[:-1] if splits(cfg, n)]
        if start not in allowed:
            raise ConfigError(f"training.seq_len_warmup: a start length of {start} tokens; allowed: a length that "
                              f"divides training.seq_len {t.seq_len} and the layout splits, shorter than it: "
                              f"{allowed or 'none here'}")
