"""`plait plot`: a run's curves from its metrics.jsonl in a PNG, without any service; several
runs overlaid, each in one colour. Also drawn at the end of a run (metrics.plot)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import tyro

from plait import jsonl
from plait.arguments import parse
from plait.config import ConfigError
from plait.jsonl import is_number

# (panel title, y label, keys drawn in it): val_loss shares loss's panel, as points where it was measured
PANELS = [("loss", "loss", ("loss", "val_loss")), ("learning rate", "lr", ("lr",)),
          ("gradient norm (before clipping)", "grad_norm", ("grad_norm",)),
          ("throughput", "tokens/s", ("tokens_per_sec",))]


def panels(runs: list[list[dict]]) -> list[tuple[str, str, tuple[str, ...]]]:
    """PANELS, with the named validation sets' losses beside val_loss and, where a run scored
    tasks (plait/evals), a panel of each task's acc."""
    keys = list(dict.fromkeys(key for rows in runs for row in rows for key in row))
    named = tuple(k for k in keys if k.startswith("val_loss_"))
    tasks = tuple(k for k in keys if k.startswith("eval_") and k.endswith("_acc") and k != "eval_acc")
    drawn = [(title, ylabel, keys + named if ylabel == "loss" else keys) for title, ylabel, keys in PANELS]
    return drawn + ([("downstream tasks (plait/evals)", "acc", tasks)] if tasks else [])


@dataclass
class PlotArgs:
    """Draw loss, val_loss, lr, grad_norm, tokens/s (and task scores) against step from metrics.jsonl files (one run each)."""

    files: Annotated[tuple[str, ...], tyro.conf.Positional, tyro.conf.arg(metavar="METRICS.jsonl [MORE.jsonl ...]")]
    """the metrics.jsonl of each run to draw; several are overlaid, one colour each"""
    out: Annotated[str, tyro.conf.arg(metavar="PNG")] = ""
    """the PNG to write; default: the first file's name with .png"""


def read_rows(path: Path) -> list[dict]:
    if not path.is_file():
        raise ConfigError(f"files: {path} does not exist")
    numbered = jsonl.lines(path, "files", ": is it a metrics.jsonl?")
    rows = []
    for number, line in numbered:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise ConfigError(f"files: {path} line {number} is not JSON: is it a metrics.jsonl?") from None
        # every row is drawn against its step (a validation set's documents, say, have none)
        if not isinstance(row, dict) or type(row.get("step")) is not int:
            raise ConfigError(f"files: {path} line {number} is not a row of metrics (a JSON object with a whole-number "
                              "step): is it a metrics.jsonl?")
        drawn = [k for k in row if is_drawn(k) and not (is_number(row[k]) or row[k] is None)]
        if drawn:
            raise ConfigError(f"files: {path} line {number}: {drawn[0]} is {json.dumps(row[drawn[0]])}, not a number "
                              "(or null): is it a metrics.jsonl?")
        rows.append(row)
    return rows


def is_drawn(key: str) -> bool:
    return any(key in keys for _, _, keys in PANELS) or key.startswith("val_loss_") or \
        (key.startswith("eval_") and key.endswith("_acc"))


def labels(paths: list[Path]) -> list[str]:
    """Each run's name in the legend: its file's stem, or its path where two stems are the same."""
    stems = [p.stem for p in paths]
    return stems if len(set(stems)) == len(stems) else [str(p) for p in paths]


def plot_runs(paths: list[Path], out: Path) -> list[list[dict]]:
    """Draw the runs of `paths` into `out`; returns their rows."""
    import matplotlib

    matplotlib.use("Agg")  # files only: training machines have no display
    import matplotlib.pyplot as plt

    runs = [read_rows(p) for p in paths]
    drawn = panels(runs)
    columns = (len(drawn) + 1) // 2
    fig, axes = plt.subplots(2, columns, sharex=True, figsize=(5.5 * columns, 7), squeeze=False)
    for ax in axes.flat[len(drawn):]:
        ax.set_visible(False)
    for (title, ylabel, keys), ax in zip(drawn, axes.flat):
        for i, (label, rows) in enumerate(zip(labels(paths), runs)):
            for key in keys:
                points = [(row["step"], row[key]) for row in rows if row.get(key) is not None]
                if points:
                    style = {"marker": "o", "linestyle": "--"} if key.startswith(("val_loss", "eval_")) else {}
                    ax.plot(*zip(*points), color=f"C{i % 10}", label=f"{label} {key}" if len(keys) > 1 else label,
                            **style)
        ax.set(title=title, ylabel=ylabel)
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize="small")
    for column in axes.T:  # each column's lowest panel shows the steps
        ax = column[1] if column[1].get_visible() else column[0]
        ax.xaxis.set_tick_params(labelbottom=True)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return runs


def main(argv: list[str]) -> int:
    opts = parse(PlotArgs, argv, "plait plot")
    if not opts.files:
        raise ConfigError("files: give one metrics.jsonl or more: plait plot METRICS.jsonl [MORE.jsonl ...] "
                          "--out run.png")
    paths = [Path(f) for f in opts.files]
    out = Path(opts.out) if opts.out else paths[0].with_suffix(".png")
    if out.suffix != ".png":
        raise ConfigError(f"out: {out} is not a .png file")
    steps = [row["step"] for rows in plot_runs(paths, out) for row in rows]
    span = f"steps {min(steps)}-{max(steps)}" if steps else "no steps yet"
    print(f"plait plot: wrote {out}: {len(paths)} run{'s' if len(paths) > 1 else ''}, {span}")
    return 0
