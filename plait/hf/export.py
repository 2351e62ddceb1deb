"""`plait export`: a plait checkpoint -> a Hugging Face folder that transformers loads as is
(config.json, safetensors weights, tokenizer, generation defaults), of the model's own family."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from plait import storage
from plait.checkpoint.manifest import check_compatible, checkpoint_in, manifest_model, read_manifest
from plait.checkpoint.offline import load_full_state_dict
from plait.config import ConfigError
from plait.data.tokenizer import read_tokenizer
from plait.hf import tokenizer as hf_tokenizer
from plait.hf.config import hf_config
from plait.hf.weights import write_weights


def export_checkpoint(folder: Path, out: Path, dtype: torch.dtype, shard_bytes: int, weights: str = "model") -> str:
    """Write `out` from the checkpoint `folder` (a job folder: its newest); returns what was written,
    for the one line. `out` under a URL is written here first and uploaded (safetensors and the
    tokenizer write local files), config.json last: a folder without it is no Hugging Face folder."""
    if not storage.is_remote(out):
        return export_to_folder(folder, out, dtype, shard_bytes, weights)
    with tempfile.TemporaryDirectory(prefix="plait-export-") as staging:
        wrote = export_to_folder(folder, Path(staging), dtype, shard_bytes, weights)
        storage.upload(Path(staging), out, last="config.json")
    return wrote


def export_to_folder(folder: Path, out: Path, dtype: torch.dtype, shard_bytes: int, weights: str) -> str:
    folder = checkpoint_in(folder, "checkpoint")
    manifest = read_manifest(folder)
    if manifest is None:
        raise ConfigError(f"checkpoint: {folder} is not a complete plait checkpoint")
    args = manifest_model(manifest, folder, "checkpoint")
    check_compatible(folder, args, "checkpoint")
    state = load_full_state_dict(folder, args, "checkpoint", weights)
    tokenizer = None
    if (folder / hf_tokenizer.TOKENIZER).is_file():
        tokenizer = read_tokenizer(folder / hf_tokenizer.TOKENIZER, "checkpoint")
        if tokenizer.get_vocab_size() > args.vocab_size:
            raise ConfigError(f"checkpoint: {folder}'s tokenizer has {tokenizer.get_vocab_size()} tokens, more than "
                              f"the model's {args.vocab_size} embeddings")
    kept = [name for name in hf_tokenizer.COMPANIONS if (folder / name).is_file()]
    source = folder / hf_tokenizer.SOURCE_CONFIG  # the config.json of the folder the run started from
    source = json.loads(source.read_text()) if source.is_file() else None
    if source is not None and not kept:  # trained with another tokenizer: the source's token ids are not its
        source = {k: v for k, v in source.items() if k not in ("bos_token_id", "eos_token_id", "pad_token_id")}
    config = hf_config(args, dtype, *(hf_tokenizer.special_ids(tokenizer) if tokenizer is not None else (None, None)),
                       source=source)
    files = write_weights(state, args, out, dtype, shard_bytes)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    if tokenizer is None:  # checkpoints written before plait kept their tokenizer
        return f"{len(files)} weight file(s), no tokenizer ({folder} holds none: copy the run's tokenizer.json in)"
    hf_tokenizer.write(tokenizer, out, args.max_seq_len)
    hf_tokenizer.write_companions({name: (folder / name).read_bytes() for name in kept}, out)
    return f"{len(files)} weight file(s) and the tokenizer" + (f" (with the start folder's {', '.join(kept)})" * bool(kept))
