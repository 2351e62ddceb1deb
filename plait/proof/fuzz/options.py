"""Every option of `plait train`, generated: on the debug job (two steps), one to four options
set to values drawn from their type in the config dataclasses (their limits and past them: 0,
-1, huge, not-a-number, an empty or unknown text, each allowed value of a choice and one that is
not), at one, two or four ranks. Property: the start-up checks (what `plait train --nproc N` runs
before it starts any rank) refuse the job in one line (ConfigError), or the job trains its two
steps with every loss within the parity bound of the same job on one device (its parallelism
options dropped); never another exception, never a traceback, never a hang.
"""

from __future__ import annotations

import types
import typing
from dataclasses import fields, is_dataclass
from functools import cache

from hypothesis import strategies as st

from plait.proof.fuzz import Generator
from plait.proof.fuzz import refusal
from plait.proof.fuzz.trained import TASKS, VALIDATION, train_against_reference

BASE = ["--training.steps", "2", "--training.seq_len", "32", "--training.global_batch_size", "4"]
# Options that start something other than a training job (a lighthouse, a launch) or read the
# network: left at their defaults.
LEFT_ALONE = {"nproc", "max_restarts", "fault_tolerance.enable", "fault_tolerance.lighthouse", "metrics.wandb_project"}


@cache
def options() -> dict[str, type]:
    """`section.key` -> its type, for every option of the train command."""
    from plait.config import JobConfig

    found = {}

    def walk(cls, prefix: str):
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            if f.name.startswith("_"):
                continue
            if is_dataclass(hints[f.name]):
                walk(hints[f.name], f"{prefix}{f.name}.")
            elif f"{prefix}{f.name}" not in LEFT_ALONE:
                found[f"{prefix}{f.name}"] = hints[f.name]

    walk(JobConfig, "")
    return found


def values(hint) -> st.SearchStrategy:
    """Command-line words for a value of type `hint`: legal ones and ones just past the limits."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return st.sampled_from([[str(a)] for a in args] + [["not_a_choice"]])
    if hint is bool:
        return st.sampled_from([[], ["false"], ["maybe"]])  # (a bare flag: true)
    if hint is int:
        return st.sampled_from([-1, 0, 1, 2, 3, 4, 7, 64, 2 ** 31, 10 ** 30]).map(lambda v: [str(v)])
    if hint is float:
        return st.sampled_from(["-1", "0", "1e-12", "0.5", "1", "3", "1e30", "nan", "inf"]).map(lambda v: [v])
    if hint is str:
        return st.sampled_from(["", "x", "/nonexistent/path", "..", "a b"]).map(lambda v: [v])
    if origin in (tuple, list):
        return st.lists(values(args[0]), max_size=3).map(lambda vs: [w for v in vs for w in v])
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*(values(a) for a in args if a is not type(None)))
    return st.just(["x"])


def legal_values(name: str, hint) -> st.SearchStrategy | None:
    """Command-line words for values a job that trains would use (None: left at its default), so
    the cases that pass the start-up checks are jobs worth training: the debug flavors, small
    counts, generated validation and task files."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if name == "model.flavor":
        return st.sampled_from([[a] for a in args if a.startswith("debug")])
    if name in FILES:
        return st.sampled_from(FILES[name]).map(lambda v: [v])
    if origin is typing.Literal or hint is bool:
        return st.sampled_from([[str(a)] for a in args] if args else [[], ["false"]])
    if hint is int:
        return st.sampled_from([0, 1, 2, 4]).map(lambda v: [str(v)])
    if hint is float:
        return st.sampled_from(["0", "0.01", "0.5", "0.9"]).map(lambda v: [v])
    if origin is tuple and args[0] in (int, float):
        return st.lists(st.sampled_from(["0", "1", "2"] if args[0] is int else ["0.5", "0.9", "0.99"]),
                        min_size=1, max_size=2)
    return None


# Options the trained cases set themselves (a drawn value would be overridden): the thread count
# (parity runs pin one per rank: it changes a matmul's summation order), the files it reads back.
HARNESS = {"training.threads", "metrics.jsonl", "checkpoint.folder", "checkpoint.load", "config"}
# A job's text options that name files: the generated ones (a validation set, a task whose
# contexts hold the end-of-text token's text), placeholders until the case runs.
FILES = {"data.val_path": [VALIDATION], "eval.loss_sets": [f"prose:{VALIDATION}"], "eval.tasks": ["sample", TASKS]}


@st.composite
def jobs(draw, legal: bool = False) -> tuple[int, list[str]]:
    """(ranks, the command line after `plait train`): values from their type's limits and past
    them, or (`legal`) values a job that trains would use."""
    space = {name: strategy for name, hint in options().items() if name not in (HARNESS if legal else ())
             if (strategy := legal_values(name, hint) if legal else values(hint)) is not None}
    names = draw(st.lists(st.sampled_from(sorted(space)), min_size=1, max_size=4, unique=True))
    argv = list(BASE)
    for name in names:
        argv += [f"--{name}", *draw(space[name])]
    return draw(st.sampled_from([1, 2, 4])), argv


def check_startup(job: tuple[int, list[str]]) -> str:
    """The start-up half alone (cheap: no rank starts)."""
    return "refused" if refusal(*job) is not None else "accepted"


def check(job: tuple[int, list[str]]) -> str:
    """The whole property: refused in one line, or two steps at the one-device reference's loss."""
    if refusal(*job) is not None:
        return "refused"
    return train_against_reference(*job)


PINNED = [
    (1, [*BASE, "--training.seq_len", "1"]),  # an odd length under the document mask: a shape error
    # a task context holding the end-of-text text, in the loop (issue 60, defect 4)
    (1, [*BASE, "--eval.interval", "1", "--eval.tasks", TASKS]),
    (2, [*BASE, "--model.flavor", "debug_moe", "--parallelism.pp", "2"]),  # PP + MoE's first step (third review)
]
GENERATOR = Generator(jobs(legal=True), check, PINNED)
STARTUP = Generator(jobs(), check_startup)
