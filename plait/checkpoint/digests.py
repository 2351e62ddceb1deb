"""Digests of a checkpoint's files, so that a bit flipped on disk is found at resume, not trained on.

DCP stores no checksums. After a save, each rank hashes the files it wrote itself (in async mode
in the background, after its upload: training does not wait for it) and leaves the digests in a
sidecar; rank 0 gathers every rank's into the manifest, which is written last. At resume the
ranks share the files out and each hashes its share: the checkpoint is read once in all, not
once per rank, before DCP reads it again to load.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import torch.distributed as dist

from plait import file_names, storage
from plait.config import ConfigError

SIDECAR = ".digests-{rank}.json"
RANK0_FILES = (".metadata", "tokenizer.json")  # DCP's metadata (the coordinator's) and the run's tokenizer


def sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()  # releases the GIL: a background thread is cheap


def written_by(folder: Path, rank: int) -> list[str]:
    """The files of `folder` that `rank` wrote (DCP names its data files __{rank}_{i}.distcp)."""
    others = [name for name in RANK0_FILES if (folder / name).exists()] if rank == 0 else []
    return sorted(p.name for p in folder.glob(f"__{rank}_*.distcp")) + others


def collect(folder: Path, rank: int, world: int, timeout: float) -> dict[str, str] | None:
    """Call on every rank once its part of a save is on disk. Returns, on rank 0, the digest of
    every file of the checkpoint once every rank has left its own (None on the others)."""
    own = {name: sha256(folder / name) for name in written_by(folder, rank)}
    storage.write_atomically(folder / SIDECAR.format(rank=rank), json.dumps(own))
    if rank != 0:
        return None
    deadline = time.monotonic() + timeout
    sidecars = [folder / SIDECAR.format(rank=r) for r in range(world)]
    for r, sidecar in enumerate(sidecars):
        while not sidecar.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {r} left no digests of its files within {timeout:g}s")
            time.sleep(0.01 if not storage.is_remote(folder) else 0.2)  # (a store's looks are requests)
    digests = {}
    for sidecar in sidecars:
        digests.update(json.loads(sidecar.read_text()))
        sidecar.unlink()
    return digests


def damaged(folder: Path) -> str:
    return f"the checkpoint is damaged; move {folder} away to resume from the one before it"


def verify(folder: Path, manifest: dict, option: str, rank: int = 0, world: int = 1) -> None:
    """Every file of `folder` against its digest in `manifest` (its plait.json, as rank 0 read it),
    each rank hashing its share; with a process group, every rank raises the same one line if any
    share failed."""
    failure = first_mismatch(folder, manifest.get("digests"), rank, world)
    if world > 1:
        failures = [None] * world
        dist.all_gather_object(failures, failure)
        failure = next((f for f in failures if f), None)
    if failure:
        raise ConfigError(f"{option}: {failure}: {damaged(folder)}")


def first_stray(folder: Path, digests: dict[str, str] | None) -> str | None:
    """The first name in `digests` that is not a plain file directly inside `folder`
    (plait/file_names.py), as the start of a sentence, or None."""
    stray = file_names.first_stray(folder, digests or {})
    return f"its manifest names {stray}" if stray else None


def first_mismatch(folder: Path, digests: dict[str, str] | None, rank: int = 0, world: int = 1) -> str | None:
    """Hash this rank's share of the files (every world-th); the first that does not match its
    digest, as the start of a sentence, or None. Checkpoints written before digests pass."""
    if stray := first_stray(folder, digests):
        return f"{folder}: {stray}"
    for name in sorted(digests or {})[rank::world]:
        if not (folder / name).exists():
            return f"{folder / name} is missing"
        if sha256(folder / name) != digests[name]:
            return f"{folder / name} does not match the sha256 its manifest recorded at save time"
    return None
