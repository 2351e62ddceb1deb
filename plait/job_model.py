"""The run's model, decided once from the options and what checkpoint.load names.

A Hugging Face folder's config.json or a plait checkpoint's manifest is the model (its
tokenizer.json the tokenizer: plait/start_folder.py's job_tokenizer); without either, model.flavor's
shape with the tokenizer's vocabulary. Every check that needs the model (pipeline, TP, EP,
float8, the checkpoint to load) reads this decision, so a checkpoint of a job that started from
a Hugging Face folder is that model again, not the debug flavor.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from plait.checkpoint.manifest import read_manifest, manifest_model
from plait.config import ConfigError, JobConfig
from plait.hf.config import describe_difference, is_hf_folder, model_args
from plait.start_folder import job_tokenizer, start_folder
from plait.models.args import ModelArgs
from plait.models.flavors import model_args as flavor_args
from plait.models.flavors import shrunk


def folder_model(folder: Path, option: str) -> ModelArgs:
    """The model a folder holds: a Hugging Face folder's config.json, a plait checkpoint's manifest."""
    if is_hf_folder(folder):
        return model_args(folder, option)
    manifest = read_manifest(folder)
    if manifest is None or "model_args" not in manifest:
        raise ConfigError(f"{option}: {folder} is neither a plait checkpoint (plait.json) nor a Hugging Face folder "
                          "(config.json)")
    return manifest_model(manifest, folder, option)


def flavor_model(cfg: JobConfig, tokenizer_vocab: int) -> ModelArgs:
    """model.flavor's shape, with the model options that change it."""
    args = flavor_args(cfg.model.flavor.replace("auto", "debug"), tokenizer_vocab, cfg.model.n_layers)
    if cfg.model.shrink:
        args = shrunk(args, tokenizer_vocab)
    args = replace(args, tie_embeddings=args.tie_embeddings or cfg.model.tie_embeddings,
                   max_seq_len=cfg.model.max_seq_len or args.max_seq_len)
    if cfg.model.mtp_layers >= 0:
        args = replace(args, mtp_layers=cfg.model.mtp_layers)
    if cfg.model.sliding_window:
        if not set(cfg.model.full_layers) <= set(range(args.n_layers)):
            raise ConfigError(f"model.full_layers: {list(cfg.model.full_layers)}, but the model has blocks 0 to "
                              f"{args.n_layers - 1}")
        args = replace(args, sliding_window=cfg.model.sliding_window, full_layers=tuple(cfg.model.full_layers))
    return args


def job_model(cfg: JobConfig, tokenizer_vocab: int) -> ModelArgs:
    """The run's model: the one checkpoint.load's folder holds (a model option given as well must
    agree with it), else model.flavor's shape. ValueError or ConfigError (one line) if they disagree."""
    folder = start_folder(cfg)
    if folder is None:
        return flavor_model(cfg, tokenizer_vocab)
    args = folder_model(folder, "checkpoint.load")
    if cfg.model.shrink:
        raise ConfigError(f"model.shrink: the model is {folder}'s, whose weights have its shapes; shrink cuts a "
                          "model.flavor (leave checkpoint.load out, or shrink out)")
    held = "its config.json" if is_hf_folder(folder) else "its manifest"
    m = cfg.model
    if m.tie_embeddings and not args.tie_embeddings:
        raise ConfigError(f"model.tie_embeddings: {folder} has an output layer of its own (not tied to the embedding)")
    if m.flavor != "auto":  # a flavor (with the model options) names a shape: ties and MTP are the folder's
        flavor = replace(flavor_model(cfg, args.vocab_size), tie_embeddings=args.tie_embeddings,
                         mtp_layers=args.mtp_layers)
        if describe_difference(flavor, args):
            raise ConfigError(f"model.flavor: {m.flavor} is not the model of {folder} "
                              f"({describe_difference(flavor, args)} in {held}); leave model.flavor out to "
                              "train the folder's model")
    if m.max_seq_len not in (0, args.max_seq_len):
        raise ConfigError(f"model.max_seq_len: {m.max_seq_len}, but {folder} takes {args.max_seq_len} positions "
                          f"({held}); allowed: 0 or {args.max_seq_len}")
    if m.sliding_window and (m.sliding_window, tuple(m.full_layers)) != (args.sliding_window, args.full_layers):
        raise ConfigError(f"model.sliding_window: {held} sets the windows (sliding_window {args.sliding_window}, full "
                          f"blocks {list(args.full_layers)}); allowed: 0, or the same")
    if m.mtp_layers == 0:  # (trained without the folder's MTP module; an export then has none)
        args = replace(args, mtp_layers=0)
    elif m.mtp_layers > args.mtp_layers:
        raise ConfigError(f"model.mtp_layers: {m.mtp_layers}, but {folder} holds no multi-token prediction weights; "
                          "allowed: -1 or 0")
    if m.n_layers not in (0, args.n_layers):
        raise ConfigError(f"model.n_layers: {m.n_layers}, but {folder} has {args.n_layers} blocks; allowed: 0 or "
                          f"{args.n_layers}")
    if tokenizer_vocab > args.vocab_size:
        raise ConfigError(f"data.tokenizer: has {tokenizer_vocab} tokens, more than the {args.vocab_size} embeddings "
                          f"of {folder}: token ids past {args.vocab_size - 1} would have no embedding; use the "
                          "folder's own tokenizer")
    return args


def model_shape(cfg: JobConfig) -> ModelArgs:
    """The job's model from options and files alone: what checkpoint.load's folder holds, or the
    flavor with the tokenizer's vocabulary (nothing is tokenized: plan needs shapes only)."""
    from plait.data import vocab_size
    from plait.models.flavors import FLAVORS

    vocab = 0  # the tokenizer's, as training settles it (a Hugging Face folder's must fit its embeddings)
    if start_folder(cfg) is not None or cfg.model.flavor == "auto" or FLAVORS[cfg.model.flavor].vocab_size == 0 \
            or cfg.model.shrink:
        vocab = vocab_size(replace(cfg.data, tokenizer=job_tokenizer(cfg)))
    return job_model(cfg, vocab)
