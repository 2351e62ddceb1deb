"""Loss spikes: each step's loss and gradient norm judged against the run's own recent history.

A value is a spike when it is over median + threshold x spread of the last WINDOW steps that were
not spikes, where spread = 1.4826 x the median absolute deviation (the standard deviation, for
normally distributed values, of a statistic one outlier cannot move). Only values over the median
count: a loss falling fast is training, not a spike. Nothing is judged before KNOWN steps are
known, and a spike does not join the history, so a run of spikes is not learnt as normal.

Every rank judges the same values (the loss and norm are reduced over all ranks before), so every
rank decides to skip the same steps without a collective. The history is saved with a checkpoint
(the manifest's "spikes") so that a resumed run judges its steps as the uninterrupted run did.
"""

from __future__ import annotations

import statistics
from collections import deque

from plait.config import ConfigError

WINDOW, KNOWN = 100, 20
ROBUST = 1.4826  # the median absolute deviation x this = the standard deviation of a normal distribution
WATCHED = ("loss", "grad_norm")


class SpikeWatch:
    def __init__(self, threshold: float):
        self.threshold = threshold
        self.history = {name: deque(maxlen=WINDOW) for name in WATCHED}

    def limit(self, name: str) -> float | None:
        """The value over which `name` is a spike now (None: too little history)."""
        known = self.history[name]
        if len(known) < KNOWN:
            return None
        median = statistics.median(known)
        spread = ROBUST * statistics.median(abs(v - median) for v in known)
        return median + self.threshold * spread

    def judge(self, values: dict[str, float]) -> dict[str, float]:
        """The watched values over their limits, each with its limit (empty: no spike); an
        unspiked step's values join the history."""
        over = {name: limit for name in WATCHED if (limit := self.limit(name)) is not None and values[name] > limit}
        if not over:
            for name in WATCHED:
                self.history[name].append(values[name])
        return over

    def state_dict(self) -> dict:
        return {name: list(values) for name, values in self.history.items()}

    def load_state_dict(self, state: dict) -> None:
        values = [state.get(name, []) if isinstance(state, dict) else None for name in WATCHED]
        if not all(isinstance(v, list) and all(isinstance(x, (int, float)) for x in v) for v in values):
            raise ConfigError(f"checkpoint.folder: the manifest's spikes are not lists of numbers per {WATCHED}")
        for name, known in zip(WATCHED, values):
            self.history[name] = deque(map(float, known), maxlen=WINDOW)


def spike_line(step: int, over: dict[str, float], values: dict[str, float], policy: str, rolled_back) -> str:
    """The line a spike prints: the step, each value over its threshold, and what was done."""
    what = ", ".join(f"{name} {values[name]:.4g} over its threshold {limit:.4g}" for name, limit in over.items())
    if policy == "rollback" and rolled_back is not None:
        done = (f"rolled back to {rolled_back}'s weights and optimizer state: the steps since are undone and their "
                "data not seen again, the schedule goes on")
    elif policy == "warn":
        done = "trained on (training.spike_policy warn)"
    else:
        done = "skipped: no update, the schedule and data go on" + (
            " (rollback: no checkpoint to roll back to yet)" if policy == "rollback" else "")
    return (f"plait: step {step}: spike: {what} (training.spike_threshold: median + threshold x spread of the last "
            f"{WINDOW} steps); {done}")
