"""The end of a run in one dict: what it reached, what it cost, where its weights are, what to type next.

plait.train builds it on rank 0 from the run's per-step rows; MetricsLogger.finish prints it (`lines`)
and writes it where the metrics go, so a script or a dashboard reads the numbers the console showed.
Speeds are means over the run's steps after its first: the first step carries the warm-up (kernel
selection, allocator growth, compilation) and would dominate a short run's mean.
"""

from __future__ import annotations

import os
from pathlib import Path


def process_age() -> float:
    """Seconds since this process started, so that start-up counts the interpreter's and torch's
    imports too; 0 where /proc does not say (then start-up counts from plait.train.run)."""
    try:
        with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
            started = int(stat.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")  # field 22
            return max(0.0, float(uptime.read().split()[0]) - started)
    except (OSError, ValueError, IndexError):
        return 0.0


def mean_speed(steps: list[tuple[float, float | None, float]]) -> tuple[float, float | None]:
    """(tokens/s, MFU) over `steps`, (step_time, mfu, tokens) triples: the mean speed, and MFU's
    time-weighted mean, which is the MFU of that speed (MFU is proportional to tokens/s); MFU
    None where a step has none."""
    seconds = sum(t for t, _, _ in steps)
    mfus = [m for _, m, _ in steps]
    mfu = None if None in mfus else sum(m * t for t, m, _ in steps) / seconds
    return sum(n for _, _, n in steps) / seconds, mfu


def build(rows: list[dict], loader, startup_s: float, wall_s: float, checkpoint: Path | None) -> dict:
    """`rows`: this run's per-step rows (after a resume, its steps only); `loader`: the run's
    BatchLoader (its sources, and the sequences each gave since step 1, resumed runs included);
    `startup_s`: from the start of the run to its first step; `checkpoint`: the newest complete
    one, or None."""
    last = rows[-1] if rows else {}
    timed = rows[1:] or rows  # the first step's warm-up left out, unless it is the only one
    tokens_per_sec, mfu = mean_speed([(row["step_time"], row["mfu"], loader.schedule.shape(row["step"]).tokens)
                                      for row in timed]) if timed else (None, None)
    val = [row for row in rows if "val_loss" in row]
    evaluated = [row for row in rows if any(map(is_score, row))]
    summary = {
        "step": loader.step, "steps_run": len(rows), "loss": last.get("loss"),
        "val_loss": val[-1]["val_loss"] if val else None, "val_step": val[-1]["step"] if val else None,
        "tokens": loader.schedule.tokens_before(loader.step + 1),
        "sources": [{"source": source.label, "sequences": used, "epochs": used / per_epoch}
                    for source, used, per_epoch in zip(loader.sources, loader.used, loader.num_sequences)],
        "wall_time_s": wall_s, "startup_s": startup_s, "first_step_s": rows[0]["step_time"] if rows else None,
        "tokens_per_sec": tokens_per_sec, "mfu": mfu,
        "mean_over_steps": [timed[0]["step"], timed[-1]["step"]] if timed else None,
        "checkpoint": str(checkpoint) if checkpoint else None,
        # the last scores of eval.tasks and eval.loss_sets, and the share of the run evaluations took
        "evals": {key: value for key, value in evaluated[-1].items() if is_score(key)} if evaluated else {},
        "eval_step": evaluated[-1]["step"] if evaluated else None,
        "eval_time_s": sum(row.get("eval_time", 0.0) for row in rows),
    }
    summary["next"] = next_commands(checkpoint)
    return summary


def next_commands(checkpoint: Path | None) -> dict[str, str]:
    if checkpoint is None:
        return {}
    return {"export": f"plait export --checkpoint {checkpoint} --out hf-{checkpoint.name}",
            "resume": f"the same plait train command with a larger --training.steps resumes from {checkpoint}"}


def is_score(key: str) -> bool:
    """A row's task score or named validation loss (plait/evals), not the evaluation's time."""
    return key.startswith(("eval_", "val_loss_")) and key != "eval_time"


def eval_scores(row: dict) -> str:
    """A row's task scores and named validation losses, as one line shows them."""
    tasks = [key.removesuffix("_acc").removeprefix("eval_") for key in row
             if key.startswith("eval_") and key.endswith("_acc") and key != "eval_acc"]
    parts = [f"{task} acc {row[f'eval_{task}_acc']:.3f} acc_norm {row[f'eval_{task}_acc_norm']:.3f}" for task in tasks]
    parts += [f"{key} {value:.4f}" for key, value in row.items() if key.startswith("val_loss_")]
    return " | ".join(parts)


def lines(summary: dict) -> list[str]:
    """The summary as the console shows it."""
    if summary["steps_run"]:
        val = f" | val_loss {summary['val_loss']:.4f} (step {summary['val_step']})" if summary["val_step"] else ""
        data = ", ".join(f"{s['epochs']:.2f} epochs of {s['source']}" for s in summary["sources"])
        first, last = summary["mean_over_steps"]
        over = f"step {first}" if first == last else f"steps {first}-{last}"
        if summary["steps_run"] > 1:
            over += ", the first step's warm-up left out"
        mfu = "n/a" if summary["mfu"] is None else f"{100 * summary['mfu']:.2f}%"
        out = [f"plait: done: step {summary['step']} | loss {summary['loss']:.4f}{val} | {summary['tokens']:,} tokens "
               f"({data})",
               f"plait: time: {summary['wall_time_s']:.1f} s in all: start-up {summary['startup_s']:.1f} s, first step "
               f"{summary['first_step_s']:.1f} s | {summary['tokens_per_sec']:,.0f} tok/s, mfu {mfu} (mean over {over})"]
        if summary["evals"]:
            share = summary["eval_time_s"] / summary["wall_time_s"]
            out.append(f"plait: evals (step {summary['eval_step']}): {eval_scores(summary['evals'])} | "
                       f"{summary['eval_time_s']:.1f} s evaluating, {100 * share:.1f}% of the run")
    else:
        out = [f"plait: done: nothing to train, the checkpoint is at step {summary['step']} already"]
    if summary["checkpoint"]:
        out.append(f"plait: last checkpoint {summary['checkpoint']}: export it with `{summary['next']['export']}`; "
                   f"{summary['next']['resume']}")
    else:
        out.append("plait: no checkpoint saved: the weights of this run are lost (checkpoint.folder keeps them)")
    return out
