"""What torch.compile did in a run (compile.report): its graph breaks with their reasons, and
the recompiles after step 2 with the guard that failed, written per rank as JSON at the end (the
first evaluation's forwards without gradients compile their own graphs once: listed apart).

A graph break splits a compiled region in two, with eager Python between; a recompile after the
first steps means a guard (a shape, a Python value) changed mid-run and each change costs a
compilation. A run whose blocks compile cleanly has neither. Read from dynamo's own counters
(`torch._dynamo.utils.counters`: each graph break's reason, the graphs compiled) and its
`recompiles` log (the guard that failed), which this module takes off stderr into the report.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

SETTLED = 2  # compilations up to this step are the first ones (step 1's, and step 2's after the warm-up)


class CompileReport:
    """`first`: the run's first step (after a resume, the step after the checkpoint's): "after step
    2" counts from there, as a resumed run compiles its graphs again."""

    def __init__(self, path: str, rank: int, first: int = 1):
        from torch._dynamo.utils import counters

        self.path, self.rank, self.counters, self.settles = path, rank, counters, first + SETTLED
        self.step, self.recompiles, self.evaluation_graphs, self.settled_graphs = 0, [], [], None
        torch._logging.set_logs(recompiles=True)
        self.log = logging.getLogger("torch._dynamo.guards.__recompiles")
        self.handler = _Records(self)
        self.log.handlers, self.log.propagate = [self.handler], False

    def at_step(self, step: int) -> None:
        """Called before each step: compilations from here on belong to it."""
        if step == self.settles:
            self.settled_graphs = self.counters["stats"]["unique_graphs"]
        self.step = step

    def write(self) -> Path:
        """The report, `path` with the rank before its suffix (report.json -> report.rank0.json)."""
        graphs = self.counters["stats"]["unique_graphs"]
        report = {
            "rank": self.rank,
            "graph_breaks": [{"reason": reason.strip().splitlines()[0], "count": count}
                             for reason, count in self.counters["graph_break"].items()],
            "graphs": graphs,
            "recompiles_after_step_2": [r for r in self.recompiles if r["step"] >= self.settles],
            "evaluation_graphs": self.evaluation_graphs,
            "graphs_after_step_2": graphs - self.settled_graphs if self.settled_graphs is not None else 0,
        }
        path = rank_path(self.path, self.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1))
        torch._logging.set_logs()  # (dynamo's logging back to its defaults)
        return path


def rank_path(path: str | Path, rank: int) -> Path:
    """Where rank `rank` writes the report asked for at `path`: report.json -> report.rank0.json."""
    path = Path(path)
    return path.with_name(f"{path.stem}.rank{rank}{path.suffix or '.json'}")


def counts(path: Path) -> dict:
    """A written report's graph breaks and recompiles after step 2, counted (the bench's columns)."""
    report = json.loads(path.read_text())
    return {"graph_breaks": sum(b["count"] for b in report["graph_breaks"]),
            "recompiles": len(report["recompiles_after_step_2"])}


class _Records(logging.Handler):
    """The `recompiles` log's messages, each with the step it came in, as the report's rows."""

    def __init__(self, report: CompileReport):
        super().__init__()
        self.report = report

    def emit(self, record: logging.LogRecord) -> None:
        lines = record.getMessage().splitlines()
        guards = [line.strip().removeprefix("- ") for line in lines[1:] if line.strip().startswith("- ")]
        row = {"step": self.report.step, "what": lines[0] if lines else "", "guards": guards[:4]}
        # a forward without gradients (an evaluation's: the validation loss's document mask, the
        # tasks' plain causal one): graphs compiled once and kept beside training's (dynamo caches
        # them all), not recompiles that come again
        evaluation = any(guard.endswith("GLOBAL_STATE changed: grad_mode") for guard in guards)
        (self.report.evaluation_graphs if evaluation else self.report.recompiles).append(row)
