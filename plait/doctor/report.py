"""The doctor's verdicts: one row per check (what was measured, against what, PASS/WARN/FAIL),
printed as a table and written as JSON."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

PASS, WARN, FAIL = "PASS", "WARN", "FAIL"


@dataclass
class Check:
    name: str  # "<area>: <what>", e.g. "compute: bf16 matmul"
    measured: str
    threshold: str
    result: str  # PASS, WARN or FAIL
    ranks: list[int] = field(default_factory=list)  # the ranks (or pairs' ranks) the verdict names
    values: dict = field(default_factory=dict)  # the numbers behind `measured`, for --json


def worst(checks: list[Check]) -> str:
    return FAIL if any(c.result == FAIL for c in checks) else WARN if any(c.result == WARN for c in checks) else PASS


def odd_ones(values: list) -> list[int]:
    """The ranks whose value differs from the most common one; every rank when no value is
    shared by more than one (two ranks that disagree: nothing says which one is wrong)."""
    counts = {v: values.count(v) for v in values}
    common = max(counts.values())
    if common == 1 and len(values) > 1:
        return list(range(len(values)))
    majority = next(v for v in values if counts[v] == common)
    return [rank for rank, v in enumerate(values) if v != majority]


def slow_ones(values: list[float], fraction: float) -> list[int]:
    """The ranks below `fraction` of the median (a throttled or faulty device, a slow link)."""
    median = statistics.median(values)
    return [rank for rank, v in enumerate(values) if v < fraction * median]


def rank_list(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def table(checks: list[Check]) -> str:
    rows = [("check", "measured", "threshold", "result")] + [(c.name, c.measured, c.threshold, c.result)
                                                             for c in checks]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = [" | ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def write_json(path: str, header: dict, checks: list[Check]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({**header, "result": worst(checks), "checks": [asdict(c) for c in checks]},
                                     indent=1) + "\n")
