"""Checkpoints read and written in one process with no process group: a checkpoint's weights as
one full state dict (export, eval, generate, merge), and checkpoints of weights alone (a seed's,
a merge's). The folder may be a URL (plait/storage.py)."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from tokenizers import Tokenizer
from torch.distributed.checkpoint.api import CheckpointException

from plait.checkpoint import digests, safe_dcp
from plait.checkpoint.digests import verify
from plait.checkpoint.manifest import new_manifest, read_manifest, write_manifest
from plait.config import ConfigError, JobConfig
from plait.hf.tokenizer import TOKENIZER
from plait.models.args import ModelArgs
from plait.models.transformer import Transformer
from plait.models.weights import init_weights


def load_full_state_dict(folder: Path, args: ModelArgs, option: str, weights: str = "model") -> dict[str, torch.Tensor]:
    """A checkpoint's model weights (`weights` ema: their moving average, plait/ema.py) as one full
    CPU state dict, in one process (no process group)."""
    manifest = read_manifest(folder)
    verify(folder, manifest, option)
    if weights == "ema" and (manifest or {}).get("ema") is None:
        raise ConfigError(f"weights: {folder} holds no average of the weights (its run had no training.ema); "
                          "allowed here: model")
    model = Transformer(args)
    state = model.state_dict()
    # the average is of the parameters (a tied one once); the buffers are the model's
    parts = {"model": state} if weights == "model" else \
        {"ema": {name: state[name] for name, _ in model.named_parameters()},
         "model": {name: state[name] for name, _ in model.named_buffers() if name in state}}
    try:
        with warnings.catch_warnings():  # that no_dist means one process is what is meant here
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            safe_dcp.load({key: part for key, part in parts.items() if part}, folder, no_dist=True)
    except (Exception, CheckpointException) as e:
        raise ConfigError(f"checkpoint: loading {folder} failed: {str(e).splitlines()[0]}") from None
    return state


def write_seed_checkpoint(cfg: JobConfig, args: ModelArgs, out: Path, tokenizer: Tokenizer) -> None:
    """Model weights only, initialised from training.seed in one process with no process group."""
    model = Transformer(args)
    init_weights(model, cfg.training.seed)
    write_weights_checkpoint(model.state_dict(), new_manifest(cfg.model.flavor, args, "seed", 0), out, tokenizer)


def write_weights_checkpoint(state: dict[str, torch.Tensor], manifest: dict, out: Path, tokenizer: Tokenizer | None,
                             **extra) -> None:
    """A checkpoint of model weights alone (a seed's, a merge's), written in one process with no
    process group; `manifest` (new_manifest's) gets the digests and `extra`."""
    if read_manifest(out) is not None:
        raise ConfigError(f"out: {out} already holds a checkpoint; refusing to overwrite it")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.save({"model": state}, storage_writer=safe_dcp.writer(out), no_dist=True)
    if tokenizer is not None:
        (out / TOKENIZER).write_text(tokenizer.to_str(pretty=True))  # (as Tokenizer.save writes it)
    write_manifest(out, {**manifest, **extra, "digests": digests.collect(out, 0, 1, timeout=0)})
