"""The on-disk cache ($PLAIT_CACHE, default ~/.cache/plait) that every rank of a host shares:
trained tokenizers, tokenized corpora, measured peaks. Below everything else in plait: it
imports nothing of it."""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path


def cache_dir() -> Path:
    d = Path(os.environ.get("PLAIT_CACHE") or Path.home() / ".cache" / "plait")
    d.mkdir(parents=True, exist_ok=True)
    return d


@contextlib.contextmanager
def file_lock(path: Path):
    """One process at a time (across processes of a host); released when the file closes."""
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def cached_file(path: Path, build, save, load):
    """Load `path`, building it first if needed. The lock makes one process build while the others
    wait; the atomic rename means nobody ever reads a half-written file. The builder loads the file
    back too, so every process gets exactly the same object."""
    if not path.exists():
        with file_lock(path.with_name(path.name + ".lock")):
            if not path.exists():
                tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
                save(build(), tmp)
                os.replace(tmp, path)
    return load(path)
