"""The learning-rate schedule: linear warmup to the peak, then one of

- `cosine`: down to min_lr_ratio x the peak at the last step, along half a cosine;
- `wsd` (warmup-stable-decay): the peak until the last decay_fraction of the steps, then down to
  min_lr_ratio x the peak at the last step, along decay_shape. A run can be extended, or
  annealed, at any step of its stable phase: the schedule is a function of this run's
  options, so a resumed run with more steps decays later, from where it is;
- `constant`: the peak.

`factor(cfg)(done)` multiplies the peak for the step after `done` steps (LambdaLR's counter).
"""

from __future__ import annotations

import math

from plait.config import ConfigError, JobConfig
from plait.data.batch_schedule import batch_schedule

DECAY_SHAPES = {"linear": lambda q: q, "sqrt": math.sqrt, "cosine": lambda q: (1 - math.cos(math.pi * q)) / 2}


def decay_start(cfg: JobConfig, steps: float | None = None) -> float:
    """The last step at the peak under `wsd`: decay_fraction of the steps decay after it, and at
    least one (a fraction that rounds to none would leave the peak lr at the last step, where the
    schedule promises min_lr_ratio x lr). `steps`: the run's length (under a batch ramp in
    full steps' worth of tokens); training.steps by default."""
    steps = cfg.training.steps if steps is None else steps
    return steps - max(1, round(cfg.training.decay_fraction * steps))


def factor(cfg: JobConfig):
    """Under a batch ramp (training.batch_rampup) the schedule runs on tokens: a step is where the
    tokens trained through it put the run, counted in full steps (global_batch_size x seq_len
    tokens), so warmup_steps and the decay span as many tokens as without a ramp, and a ramp's
    small first steps move the lr as little as they move the weights. A phase with a decay
    replaces the schedule over its steps."""
    t = cfg.training
    warmup, floor, shape = t.warmup_steps, t.min_lr_ratio, DECAY_SHAPES[t.decay_shape]
    schedule = batch_schedule(cfg)
    ramp = bool(t.batch_rampup[1])

    def position(done: int) -> float:
        return schedule.tokens_before(done + 2) / schedule.full.tokens if ramp else done + 1

    steps = position(t.steps - 1)
    stable_until = decay_start(cfg, steps)

    def in_phase(done: int) -> float:
        """A phase's own decay (plait/data/phases.py), from where the run's schedule is at its start
        to `to` at its last step, over its steps (under a ramp: its tokens)."""
        phase = schedule.phases.at(done + 1) if schedule.phases else None
        if phase is None or not phase.decay:
            return at(done)
        first, last = schedule.phases.span(phase)
        start = at(first - 1)
        progress = (position(done) - position(first - 2)) / (position(last - 1) - position(first - 2))
        return start + (phase.to - start) * DECAY_SHAPES[phase.decay](progress)

    def at(done: int) -> float:
        step = position(done)
        if step <= warmup:
            return step / warmup
        if t.lr_schedule == "constant":
            return 1.0
        if t.lr_schedule == "cosine":
            progress = min(1.0, (step - warmup) / max(1, steps - warmup))
            return floor + (1 - floor) * (1 + math.cos(math.pi * progress)) / 2
        if step <= stable_until:
            return 1.0
        return 1 - (1 - floor) * shape(min(1.0, (step - stable_until) / (steps - stable_until)))

    return in_phase


def check_schedule(cfg: JobConfig) -> None:
    t = cfg.training
    if not 0 <= t.min_lr_ratio <= 1:
        raise ConfigError(f"training.min_lr_ratio: must be in [0, 1], got {t.min_lr_ratio}")
    if not 0 <= t.decay_fraction <= 1:
        raise ConfigError(f"training.decay_fraction: must be in [0, 1], got {t.decay_fraction}")
    if t.lr_schedule == "wsd" and t.decay_fraction == 0:
        raise ConfigError("training.decay_fraction: 0 leaves wsd no step to decay in; allowed: (0, 1], or "
                          "training.lr_schedule constant for no decay")
    if t.lr_schedule == "wsd" and decay_start(cfg) < t.warmup_steps:
        raise ConfigError(f"training.decay_fraction: {t.decay_fraction} of {t.steps} steps would start the decay at "
                          f"step {decay_start(cfg) + 1}, inside the {t.warmup_steps} warmup steps; lower it, or "
                          f"training.warmup_steps")
