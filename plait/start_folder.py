"""The folder a job starts from: what `checkpoint.load` names when it holds a model (a Hugging
Face folder or a plait checkpoint), and the tokenizer that comes with it."""

from __future__ import annotations

from pathlib import Path

from plait import storage
from plait.config import CHECKPOINT_MANIFEST, JobConfig


def start_folder(cfg: JobConfig) -> Path | None:
    """checkpoint.load when it holds a model: a Hugging Face folder or a plait checkpoint (plait/job_model.py)."""
    load = storage.location(cfg.checkpoint.load, "checkpoint.load") if cfg.checkpoint.load else None
    return load if load and any((load / name).is_file() for name in ("config.json", CHECKPOINT_MANIFEST)) else None


def hf_folder(cfg: JobConfig) -> Path | None:
    """checkpoint.load when it is a Hugging Face folder (its config.json gives the model)."""
    return folder if (folder := start_folder(cfg)) and (folder / "config.json").is_file() else None


def job_tokenizer(cfg: JobConfig) -> str:
    """data.tokenizer, else the tokenizer.json of the folder checkpoint.load starts from (its
    embeddings are that tokenizer's); empty: a BPE is trained on the corpus."""
    own = folder / "tokenizer.json" if (folder := start_folder(cfg)) else None
    return cfg.data.tokenizer or (str(own) if own and own.is_file() else "")
