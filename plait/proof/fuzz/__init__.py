"""Proofs that generate their cases (hypothesis): each generator is a strategy over one space of
inputs and a property every case must keep, and a failure shrinks to the smallest case that breaks
it, printed as what reproduces it.

    hf_configs  Hugging Face config.json fields against transformers' own models
    restart     a run stopped and resumed equals the run uninterrupted, over the job options
    options     every `plait train` option: two steps at the reference's loss, or one line
    files       mutations of every file plait reads: the same result, or one line

CI runs each with a fixed seed and a fixed budget (tests/test_fuzz.py), with the examples that
once failed pinned; `python -m plait.proof.fuzz NAME --examples N --seed S` runs one for long.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import HealthCheck, example, given, seed, settings
from hypothesis import strategies as st


class Counterexample(AssertionError):
    """A case that breaks the property; its message says how to reproduce it."""


def scratch_folder(prefix: str) -> Path:
    """A folder for one process's cases, removed when the process exits: the references a
    generator keeps for the whole run hold checkpoints (gigabytes over a CI run), and a machine
    that runs the suite day after day must not fill its disk with them."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


@dataclass
class Generator:
    """A strategy over cases, the property (returns how the case ended: a Counter key, e.g.
    'equal', 'refused', 'skipped: transformers cannot run it'; raises Counterexample), and the
    cases that once failed, run first every time."""
    strategy: st.SearchStrategy
    check: callable
    pinned: list = field(default_factory=list)


def run(generator: Generator, examples: int, seed_value: int, pinned: bool = True) -> Counter:
    """Run `examples` generated cases (and the pinned ones); how each ended, counted. Raises the
    shrunk Counterexample of the first failure."""
    outcomes: Counter = Counter()
    if examples == 0:  # the pinned cases alone
        for case in generator.pinned if pinned else ():
            outcomes[generator.check(case)] += 1
        return outcomes

    # (no database: a run is what its seed says, the same on every machine; no deadline: a
    # case's time depends on the CPU; the health checks would fail slow cases, not wrong ones)
    @settings(max_examples=examples, deadline=None, database=None, print_blob=False,
              suppress_health_check=list(HealthCheck))
    @seed(seed_value)
    @given(generator.strategy)
    def prove(case):
        outcomes[generator.check(case)] += 1

    for case in generator.pinned if pinned else ():
        prove = example(case)(prove)
    prove()
    return outcomes


def refusal(world: int, argv: list[str]) -> str | None:
    """The start-up checks' one line (the options, then the model they make: what `plait train
    --nproc N` checks before it starts a rank) where they refuse the job; a Counterexample where
    they fail in any other way."""
    from plait.arguments import parse_args
    from plait.checks import check_model, check_options
    from plait.config import ConfigError

    command = f"plait train --nproc {world} {' '.join(argv)}"
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            check_model(check_options(parse_args(argv), world))  # (what the launcher checks)
    except ConfigError as e:
        if "\n" in str(e).strip():
            raise Counterexample(f"refused in more than one line: {str(e)!r}: {command}") from None
        return str(e)
    except SystemExit as e:  # (tyro's --help, never asked here)
        raise Counterexample(f"exit {e.code} instead of a refusal: {command}") from None
    except Exception as e:  # noqa: BLE001 (a traceback is the failure being looked for)
        raise Counterexample(f"{type(e).__name__}: {e}: {command}") from e
    return None
