"""Every option of `plait train`, generated: on the debug job (two steps), one to four options
set to values drawn from their type in the config dataclasses (their limits and past them: 0,
-1, huge, not-a-number, an empty or unknown text, each allowed value of a choice and one that is
not), at one or two ranks. Property: the start-up checks (what `plait train --nproc N` runs before
it starts any rank) either accept the job or refuse it with one line (ConfigError); never another
exception, never a hang. (Training the accepted jobs two steps against the one-device reference
is what this generator does next: see docs/proofs.md.)
"""

from __future__ import annotations

import contextlib
import io
import types
import typing
from dataclasses import fields, is_dataclass
from functools import cache

from hypothesis import strategies as st

from plait.proof.fuzz import Counterexample, Generator

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


@st.composite
def jobs(draw) -> tuple[int, list[str]]:
    """(ranks, the command line after `plait train`)."""
    names = draw(st.lists(st.sampled_from(sorted(options())), min_size=1, max_size=4, unique=True))
    argv = list(BASE)
    for name in names:
        argv += [f"--{name}", *draw(values(options()[name]))]
    return draw(st.sampled_from([1, 2])), argv


def check(job: tuple[int, list[str]]) -> str:
    from plait.arguments import parse_args
    from plait.checks import check_options
    from plait.config import ConfigError

    world, argv = job
    command = f"plait train --nproc {world} {' '.join(argv)}"
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            check_options(parse_args(argv), world)
    except ConfigError as e:
        if "\n" in str(e).strip():
            raise Counterexample(f"refused in more than one line: {str(e)!r}: {command}") from None
        return "refused"
    except SystemExit as e:  # (tyro's --help, never asked here)
        raise Counterexample(f"exit {e.code} instead of a refusal: {command}") from None
    except Exception as e:  # noqa: BLE001 (a traceback is the failure being looked for)
        raise Counterexample(f"{type(e).__name__}: {e}: {command}") from e
    return "accepted"


GENERATOR = Generator(jobs(), check)
