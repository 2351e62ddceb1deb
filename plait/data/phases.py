"""Phases of a run (training.phases, or a TOML file's [[phase]] tables): from a step, or from a
number of tokens trained, the run may draw its batches from another mixture, decay the lr its own
way, and train shorter sequences. The canonical use is an anneal: the last N tokens on a
high-quality mixture with the lr decayed to 0 (OLMo 2 and 3, Llama 3).

A phase is one string of KEY=VALUE words:

    step=161 mix=docs:0.5,web:0.5 decay=linear to=0 seq_len=64

- `step` (its first step) or `tokens` (its first step is the first with that many tokens trained
  before it): exactly one; phases in order, each ends where the next begins, the last at the end;
- `mix`: data.mix's "PATH:WEIGHT,..." for its batches (default: the run's data.path or data.mix);
- `decay` (linear, sqrt or cosine) and `to` (default 0): the lr goes from where the run's schedule
  is at the phase's start to `to` x lr at its last step; without `decay` the schedule goes on;
- `seq_len`: sequences of this many tokens, a length that divides training.seq_len (the rows of
  training.seq_len tokens cut shorter, as many tokens a step: plait/data/batch_schedule.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from plait.config import ConfigError, Data

DECAYS = ("linear", "sqrt", "cosine")
KEYS = {"step": int, "tokens": int, "mix": str, "decay": str, "to": float, "seq_len": int}


@dataclass(frozen=True)
class Phase:
    number: int  # its place in the list, from 1
    step: int = 0
    tokens: int = 0
    mix: str = ""
    decay: str = ""
    to: float = 0.0
    seq_len: int = 0

    def describe(self, first: int, last: int) -> str:
        start = f"step {self.step}" if self.step else f"{self.tokens:,} tokens"
        parts = [f"mix {self.mix}" if self.mix else "the run's data"]
        if self.decay:
            parts.append(f"lr {self.decay} to {self.to:g} x lr")
        if self.seq_len:
            parts.append(f"sequences of {self.seq_len}")
        return f"phase {self.number}: steps {first}-{last} (from {start}): {', '.join(parts)}"


def parse_phase(text: str, number: int) -> Phase:
    """One phase's string -> a Phase; one line naming the phase and the word where it is wrong."""
    where = f"training.phases: phase {number} ({text!r})"
    values = {}
    for word in text.split():
        key, sign, value = word.partition("=")
        if not sign or key not in KEYS:
            raise ConfigError(f"{where}: {word!r} is not KEY=VALUE with a KEY of {', '.join(KEYS)}")
        try:
            values[key] = KEYS[key](value)
        except ValueError:
            raise ConfigError(f"{where}: {key}={value} is not {'an integer' if KEYS[key] is int else 'a number'}") \
                from None
    if ("step" in values) == ("tokens" in values) or values.get("step", values.get("tokens", 1)) < 1:
        raise ConfigError(f"{where}: give where it starts, step=N or tokens=N (one of them, >= 1)")
    if values.get("decay", "linear") not in DECAYS:
        raise ConfigError(f"{where}: decay={values['decay']}; allowed: {', '.join(DECAYS)}")
    if not (math.isfinite(values.get("to", 0.0)) and 0 <= values.get("to", 0.0) <= 1) or \
            ("to" in values and "decay" not in values):
        raise ConfigError(f"{where}: to= is the lr a decay reaches, a fraction of training.lr in [0, 1] (with decay=)")
    return Phase(number, **values)


class Phases:
    """The run's phases, each with its first and last step; `at(step)` is the phase a step is in
    (None before the first). `tokens_before`: a step's tokens trained before it (the batch ramp's)."""

    def __init__(self, specs: tuple[str, ...], steps: int, tokens_before):
        self.phases = [parse_phase(text, i) for i, text in enumerate(specs, 1)]
        self.firsts = [p.step or self._first_with(p.tokens, steps, tokens_before) for p in self.phases]
        self.lasts = [first - 1 for first in self.firsts[1:]] + [steps]
        for phase, first, before in zip(self.phases, self.firsts, [0, *self.firsts]):
            if first > steps or first <= before:
                raise ConfigError(f"training.phases: phase {phase.number} starts at step {first}, "
                                  + (f"after the run's last, {steps}" if first > steps else
                                     "not after the phase before it") + "; phases are in order, inside the run")

    @staticmethod
    def _first_with(tokens: int, steps: int, tokens_before) -> int:
        low, high = 1, steps + 1  # the first step whose tokens before it reach `tokens` (steps + 1: none)
        while low < high:
            middle = (low + high) // 2
            low, high = (middle + 1, high) if tokens_before(middle) < tokens else (low, middle)
        return low

    def at(self, step: int) -> Phase | None:
        index = sum(first <= step for first in self.firsts) - 1
        return self.phases[index] if index >= 0 else None

    def span(self, phase: Phase) -> tuple[int, int]:
        return self.firsts[phase.number - 1], self.lasts[phase.number - 1]

    def describe(self) -> list[str]:
        return [phase.describe(first, last) for phase, first, last in zip(self.phases, self.firsts, self.lasts)]


def phase_paths(cfg: Data, phases: tuple[str, ...]) -> list[str]:
    """The sources the phases' mixtures name that the run's own data does not, in order."""
    from plait.data.mixture import mix_sources

    own = {path for path, _ in mix_sources(cfg.mix)} if cfg.mix else {cfg.path}
    found = []
    for number, text in enumerate(phases, 1):
        mix = parse_phase(text, number).mix
        for path, _ in mix_sources(mix, f"training.phases: phase {number}'s mix") if mix else []:
            if path not in own and path not in found:
                found.append(path)
    return found
