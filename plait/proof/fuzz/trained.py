"""The trained half of the options generator: a job the start-up checks accept trains its steps
at one, two or four ranks, and again on one device with its parallelism options dropped (the
reference, forwarding the same sequences at once); every logged loss, validation loss, grad norm
and aux loss agrees within the parity bound of its precision. Where the job scores tasks in the
loop, the reference's last scores equal `plait eval` of its final checkpoint. A job that stops (a non-finite loss) must stop as its reference does,
in one line; a traceback or a run past TIMEOUT is a counter-example.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from functools import cache
from pathlib import Path

from plait.proof.fuzz import Counterexample, scratch_folder, refusal
from plait.proof.fuzz.restart import run as run_job
from plait.proof.fuzz.restart import validation_text

# Relative to the reference's loss. fp32: a layout reorders sums (the parity matrix's fp32 rows
# measure up to 8 ulps, 1e-6 of a loss near 8) and a drawn lr of 0.5 amplifies the first
# update's reordering into the second loss: 1e-5. bf16 and float8: the matrix's largest bound,
# MLA under TP in bf16 (3e-3: a bf16 rounding of an activation flips and the step carries it).
BOUNDS = {"fp32": 1e-5, "low": 3e-3}
COMPARED = ("loss", "val_loss", "grad_norm", "aux_loss")
# In-loop scores against `plait eval`'s, relative, for the log-likelihood means (gold_loss): the
# two forward the requests in batches of other sizes, and a CPU matmul's blocking (so its sums'
# order) depends on the rows it multiplies: measured 4.5e-10 (8.7934079557 vs 8.7934079597).
# A context scored under the training's document mask instead differed by 2e-4 (issue 60).
SCORE_BOUND = 1e-7
LAYOUT = ("--parallelism.", "--nproc")  # (dropped for the reference; the rest of the job is kept)
# Placeholders of the generated files in a drawn job (a validation set, a task whose contexts hold
# the end-of-text token's text), replaced by their paths when the case runs.
VALIDATION, TASKS = "{validation}", "{tasks}"


def reference_argv(world: int, argv: list[str]) -> list[str]:
    """`argv` without its parallelism options (each a flag and the words up to the next flag),
    forwarding the sequences each forward of the layout holds (a rank's micro-batch, a pipeline's
    share of it): a mixture of experts' aux loss is a function of the tokens of one forward."""
    from plait.arguments import parse_args
    from plait.checks import check_options
    from plait.parallel.stages import microbatches

    cfg = check_options(parse_args(argv), world)
    per_forward = cfg.training.micro_batch_size // (microbatches(cfg) if cfg.parallelism.pp > 1 else 1)
    kept, dropping = [], False
    for word in argv:
        if word.startswith("--"):
            dropping = word.startswith(LAYOUT)
        if not dropping:
            kept.append(word)
    return [*kept, "--training.micro_batch_size", str(per_forward)]


def files(argv: list[str]) -> list[str]:
    """The generated files in place of their placeholders."""
    return [w.replace(VALIDATION, validation_text()).replace(TASKS, task_file()) for w in argv]


@cache
def task_file() -> str:
    """A task whose contexts hold the end-of-text token's text (in the loop, under the training's
    document mask, it must still be scored as one plain causal text, as `plait eval` does)."""
    path = Path(validation_text()).parent / "task.jsonl"
    examples = [{"context": "A function definition is an executable statement.<|eos|>Its execution binds",
                 "choices": ["the function name", "a loop", "the file"], "gold": 0},
                {"context": "The loss is measured", "choices": [" here.", " nowhere.<|eos|>"], "gold": 0},
                {"context": "<|eos|>A list is", "choices": [" mutable", " a number"], "gold": 0}]
    path.write_text("".join(json.dumps(e) + "\n" for e in examples))
    return str(path)


def train(world: int, argv: list[str], folder: Path) -> tuple[list[dict], str]:
    """One `plait train` of the job: its metrics rows, or the one line it stopped with."""
    command = [sys.executable, "-m", "plait", "train", "--nproc", str(world), *argv, "--training.threads", "1",
               "--metrics.jsonl", str(folder / "metrics.jsonl"), "--checkpoint.folder", str(folder / "ckpt")]
    done = run_job(command, cwd=folder)
    shown = " ".join(command[1:])
    if "Traceback" in done.stdout:
        raise Counterexample(f"a traceback: {done.stdout[-3000:]}\n{shown}")
    if done.returncode != 0:
        lines = sorted({line for line in done.stdout.splitlines() if line.startswith("plait: error:")})
        if len(lines) != 1:
            raise Counterexample(f"exit {done.returncode} without one plait line: {done.stdout[-3000:]}\n{shown}")
        return [], lines[0]
    from plait import jsonl

    return list(jsonl.rows(folder / "metrics.jsonl")), ""


@cache
def reference(argv: tuple[str, ...], root: str) -> tuple[list[dict], str, Path]:
    """The one-device run of the job (shared by every layout of the same job)."""
    folder = Path(tempfile.mkdtemp(dir=root))
    rows, stopped = train(1, list(argv), folder)
    return rows, stopped, folder


def precision(argv: list[str]) -> str:
    import torch

    from plait.arguments import parse_args
    from plait.precision import resolve

    chosen = resolve(parse_args(argv))  # (auto: bf16 where this CPU multiplies it natively)
    return "fp32" if chosen.compute == torch.float32 and chosen.reduce == torch.float32 and \
        chosen.float8 == "none" else "low"


def scored_as_plait_eval(argv: list[str], rows: list[dict], folder: Path) -> None:
    """The reference's last in-loop task scores are `plait eval`'s of its final checkpoint (fp32):
    accuracies equal, log-likelihood means within SCORE_BOUND."""
    from plait.arguments import parse_args

    cfg = parse_args(argv)
    in_loop = {k: v for k, v in rows[-1].items() if k.startswith("eval_") and k != "eval_time"}
    if not in_loop or not cfg.eval.interval or precision(argv) != "fp32":
        return
    e = cfg.eval
    command = [sys.executable, "-m", "plait", "eval", "--checkpoint", str(folder / "ckpt"), "--tasks", *e.tasks,
               "--limit", str(e.limit), "--num_fewshot", str(e.num_fewshot), "--target_delimiter",
               e.target_delimiter, "--fewshot_delimiter", e.fewshot_delimiter, "--max_length",
               str(cfg.training.seq_len), "--json"]
    done = run_job(command, cwd=folder, merge=False)
    if done.returncode != 0:
        raise Counterexample(f"plait eval of the reference failed: {done.stderr[-3000:]}\n{' '.join(command[1:])}")
    scores = json.loads(done.stdout)
    differ = {k: (v, scores[k]) for k, v in in_loop.items() if k in scores and
              abs(v - scores[k]) > (SCORE_BOUND * abs(v) if k.endswith("_loss") else 0)}
    if differ:
        raise Counterexample(f"in-loop scores differ from plait eval's (in the loop, plait eval): {differ}\n"
                             f"plait train --nproc 1 {' '.join(argv)}")


def train_against_reference(world: int, argv: list[str]) -> str:
    argv = files(argv)
    root = scratch()
    ref_argv = reference_argv(world, argv)
    if refusal(1, ref_argv) is not None:
        return "no one-device reference (refused there)"
    ref_rows, ref_stopped, ref_folder = reference(tuple(ref_argv), str(root))
    shown = f"plait train --nproc {world} {' '.join(argv)}"
    if ref_rows:
        scored_as_plait_eval(ref_argv, ref_rows, ref_folder)
    if world == 1 and not any(word.startswith(LAYOUT) for word in argv):
        return "stopped in one line" if ref_stopped else "trained (is its own reference)"
    folder = Path(tempfile.mkdtemp(dir=root))
    try:
        rows, stopped = train(world, argv, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if stopped or ref_stopped:
        if stopped != ref_stopped:
            raise Counterexample(f"stopped {stopped!r}, the one-device reference {ref_stopped!r}\n{shown}")
        return "stopped as its reference, in one line"
    bound = BOUNDS[precision(argv)]
    for row, ref in zip(rows, ref_rows, strict=True):
        for name in COMPARED:
            if name in ref and abs(row[name] - ref[name]) > bound * max(1.0, abs(ref[name])):
                raise Counterexample(f"step {ref['step']} {name} {row[name]!r} vs {ref[name]!r} on one device "
                                     f"(bound {bound} relative)\n{shown}")
    return f"trained at the reference's loss ({precision(argv)})"


@cache
def scratch() -> Path:
    return scratch_folder("plait-fuzz-options-")
