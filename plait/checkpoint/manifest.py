"""A checkpoint's manifest (`plait.json`) and the checks made on a folder before anything loads.

The manifest records the model's shape, the step, the data-loader and LR-schedule state, the RNG
state, the options a resumed run may change, and the sha256 of every file (`digests`). It is
written last, atomically, by rank 0 once every rank's data is on disk, so a folder without one is
never taken as complete. Every check here runs in one process, before any process group exists:
a folder that cannot start this run is refused in one line.
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import MISSING, asdict, fields
from importlib.metadata import version
from pathlib import Path

import torch
from torch.distributed.checkpoint.api import CheckpointException

from plait import file_names, jsonl, storage
from plait.checkpoint import digests, safe_dcp
from plait.checkpoint.digests import damaged
from plait.config import CHECKPOINT_MANIFEST, ConfigError, JobConfig
from plait.jsonl import is_int, is_number
from plait.models.args import ModelArgs
from plait.models.transformer import Transformer

MANIFEST = CHECKPOINT_MANIFEST
FORMAT = 1  # of the manifest and the state in it: a plait that reads an older format says so
OWNER = "plait-job.json"  # at the root of checkpoint.folder: the job whose folder it is
STEP_FOLDER = re.compile(r"step-(\d+)$")
# What a resumed run may change, each option under its section: the optimizer's, the schedule's
# (steps too: the schedule decays towards this run's last step) and clipping's. The manifest records
# them by bare name; a change is said once at resume.
RESUMABLE = {"lr": "training", "weight_decay": "training", "max_norm": "training", "steps": "training",
             "warmup_steps": "training", "global_batch_size": "training", "batch_rampup": "training",
             "seq_len_warmup": "training", "phases": "training",
             "lr_schedule": "training", "min_lr_ratio": "training", "decay_fraction": "training",
             "decay_shape": "training", "betas": "optimizer", "eps": "optimizer", "momentum": "optimizer",
             "ns_steps": "optimizer"}
MUON_ONLY = ("momentum", "ns_steps")  # options AdamW has no use for: neither recorded nor said for it


def read_manifest(folder: Path) -> dict | None:
    return jsonl.object_or_none(folder / MANIFEST)


def write_manifest(folder: Path, manifest: dict) -> None:
    storage.write_atomically(folder / MANIFEST, json.dumps(manifest, indent=1))  # complete from this instant on


def latest_complete(root: str) -> Path | None:
    """The newest step-N folder under `root` (a path or URL) that has a manifest."""
    if not root or not (folder := storage.location(root)).is_dir():
        return None
    steps = [(int(m.group(1)), p) for p in folder.iterdir() if (m := STEP_FOLDER.match(p.name))]
    for _, folder in sorted(steps, reverse=True):
        if read_manifest(folder) is not None:
            return folder
    return None


def checkpoint_in(folder: Path, option: str, say: bool = True) -> Path:
    """`folder` where a checkpoint is expected. A job folder (a checkpoint.folder: plait-job.json or
    step-N folders, no manifest of its own) means its newest complete checkpoint, said in one line
    (by rank 0, where `say`); one that holds none is refused, listing what it holds. Any other folder is itself."""
    if not folder.is_dir() or (folder / MANIFEST).exists() or (folder / "config.json").exists():
        return folder
    entries = list(folder.iterdir())
    steps = {p: int(m.group(1)) for p in entries if (m := STEP_FOLDER.match(p.name)) and p.is_dir()}
    if not steps and not (folder / OWNER).is_file():
        return folder
    newest = latest_complete(str(folder))
    if newest is None:
        held = [f"{p.name} (unfinished: no {MANIFEST})" if p in steps else p.name
                for p in sorted(entries, key=lambda p: (p in steps, steps.get(p, 0), p.name))]
        raise ConfigError(f"{option}: {folder} is a job folder without a complete checkpoint: it holds "
                          f"{', '.join(held)}; a run saves one at its last step, every checkpoint.interval steps, "
                          "and when a signal stops it")
    if say and os.environ.get("RANK", "0") == "0":
        print(f"plait: {folder} is a job folder: using its newest complete checkpoint {newest}", file=sys.stderr,
              flush=True)
    return newest


def resumable_options(cfg: JobConfig) -> dict:
    """This run's RESUMABLE options, by bare name, as JSON keeps them (a tuple as a list)."""
    return {name: list(value) if isinstance(value := getattr(getattr(cfg, section), name), tuple) else value
            for name, section in RESUMABLE.items() if cfg.optimizer.name == "muon" or name not in MUON_ONLY}


def shown(value) -> str:
    if isinstance(value, (list, tuple)):
        return f"({', '.join(map(shown, value))})"
    return f"{value:g}" if isinstance(value, float) else str(value)


def check_optimizer_kept(folder: Path, cfg: JobConfig) -> None:
    """A training checkpoint resumes under the optimizer that wrote it (its state is that optimizer's)."""
    saved = (read_manifest(folder) or {}).get("hyperparameters", {}).get("optimizer", "adamw")
    if saved != cfg.optimizer.name:
        raise ConfigError(f"optimizer.name: {folder} was trained with {saved}, whose state does not carry over to "
                          f"{cfg.optimizer.name}; allowed here: {saved} (or a new checkpoint.folder that starts from "
                          f"these weights: --checkpoint.load {folder})")


def check_compatible(folder: Path, args: ModelArgs, option: str) -> dict:
    """Fail with one line, before any process group, if `folder` cannot start this model."""
    if not folder.is_dir():
        raise ConfigError(f"{option}: {str(folder)!r} is not a folder")
    manifest = read_manifest(folder)
    if manifest is None:
        raise ConfigError(f"{option}: {folder} has no {MANIFEST}: not a plait checkpoint, or a save that never "
                          "completed")
    if not is_int(manifest.get("format", 1)):
        raise ConfigError(f"{option}: {folder}'s {MANIFEST} records format {manifest['format']!r}, not a number: "
                          f"{damaged(folder)}")
    if manifest.get("format", 1) > FORMAT:  # manifests before the field are format 1
        raise ConfigError(f"{option}: {folder} was written by plait {manifest.get('plait')} in checkpoint format "
                          f"{manifest['format']}; this plait ({version('plait')}) reads formats up to {FORMAT}: "
                          "upgrade plait to resume it")
    theirs, ours = saved_model(manifest, folder, option), asdict(args)
    if theirs != ours:
        diff = ", ".join(f"{k} {theirs.get(k)} vs {ours[k]}" for k in ours if theirs.get(k) != ours[k])
        raise ConfigError(f"{option}: {folder} holds another model ({manifest.get('flavor')}: {diff} in this run)")
    try:
        metadata = safe_dcp.read_metadata(folder)
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        raise ConfigError(f"{option}: {folder} is unreadable: {e}") from None
    saved = metadata.state_dict_metadata
    ends: dict[str, int] = {}  # each data file must reach the end of the last item stored in it
    stored = (metadata.storage_data or {}).values()
    if stray := file_names.first_stray(folder, {info.relative_path for info in stored}):
        raise ConfigError(f"{option}: {folder}'s DCP metadata names {stray}: not a checkpoint plait (or DCP) writes")
    for info in stored:
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        size = (folder / name).stat().st_size if (folder / name).exists() else None
        if size is None or size < end:
            raise ConfigError(f"{option}: {folder / name} is {'missing' if size is None else f'truncated ({size} bytes)'}"
                              f", its checkpoint's metadata needs {end} bytes: {damaged(folder)}")
    if stray := digests.first_stray(folder, manifest.get("digests")):
        raise ConfigError(f"{option}: {folder}: {stray}; {damaged(folder)}")
    undigested = sorted(set(ends) - set(manifest.get("digests", ends)))  # checkpoints before digests have none
    if undigested:
        raise ConfigError(f"{option}: {folder}'s {MANIFEST} has no digest of {undigested[0]}, which its DCP metadata "
                          f"names: the manifest belongs to another save; {damaged(folder)}")
    with torch.device("meta"):
        expected = {f"model.{k}": v.shape for k, v in Transformer(args).state_dict().items()}
    missing = sorted(set(expected) - set(saved))
    wrong = [f"{k} {tuple(saved[k].size)} (expected {tuple(v)})" for k, v in expected.items()
             if k in saved and tuple(saved[k].size) != tuple(v)]
    if missing or wrong:
        raise ConfigError(f"{option}: {folder} does not match the model: missing {missing[:3]}, wrong shapes {wrong[:3]}")
    return manifest


def manifest_model(manifest: dict, folder: Path, option: str) -> ModelArgs:
    """The model a manifest records. A field this plait does not know means a newer plait wrote
    it (a model this one cannot build): one line naming the field, not a TypeError."""
    if not isinstance(manifest.get("model_args"), dict):
        raise ConfigError(f"{option}: {folder}'s manifest records no model (model_args): the checkpoint is damaged")
    known = {f.name for f in fields(ModelArgs)}
    if unknown := sorted(set(manifest["model_args"]) - known):
        raise ConfigError(f"{option}: {folder} records the model field(s) {', '.join(unknown)}, which this plait "
                          f"({version('plait')}) does not know: the checkpoint was written by a newer plait "
                          f"({manifest.get('plait', 'version not recorded')}); upgrade plait to read it")
    required = [f.name for f in fields(ModelArgs) if f.default is MISSING and f.name not in manifest["model_args"]]
    if required:
        raise ConfigError(f"{option}: {folder}'s manifest records no {required[0]} of the model: {damaged(folder)}")
    hints = {f.name: f.type for f in fields(ModelArgs)}
    for name, value in manifest["model_args"].items():
        if not fits(value, hints[name]):
            raise ConfigError(f"{option}: {folder}'s manifest records the model's {name} as {value!r}, which is not "
                              f"{hints[name]}: {damaged(folder)}")
    return ModelArgs(**manifest["model_args"])


def fits(value, hint: str) -> bool:
    """Whether a JSON value is one of ModelArgs' field type `hint` (sizes never negative)."""
    size = is_int(value) and 0 <= value < 1 << 40
    return {"int": size, "bool": isinstance(value, bool), "str": isinstance(value, str),
            "float": is_number(value), "float | None": value is None or is_number(value),
            "dict | None": value is None or isinstance(value, dict),
            "tuple[int, ...]": isinstance(value, list) and all(is_int(v) and 0 <= v < 1 << 40 for v in value),
            }.get(hint, True)


def saved_model(record: dict, path: Path, option: str) -> dict:
    """A manifest's (or owner file's) model_args with the fields added since it was written at
    their defaults: the same model reads as the same."""
    return asdict(manifest_model(record, path, option)) if "model_args" in record else {}


def job_identity(cfg: JobConfig, args: ModelArgs, tokens_sha256: str) -> dict:
    """What makes two runs one job, whose checkpoints they may share: the model, the token stream
    (corpus and tokenizer, by content), the seed and the sequence length (the rows the stream is cut
    into). Layout, steps, lr, the global batch (the stream goes on in batches of the new size) and
    the like may change between restarts of one job."""
    t = cfg.training
    return {"model_args": asdict(args), "tokens_sha256": tokens_sha256[:16], "training.seed": t.seed,
            "training.seq_len": t.seq_len}


def check_owner(root: str, identity: dict) -> None:
    """Refuse, with one line, a checkpoint.folder that another job owns: sharing one, two jobs
    would delete each other's saves in flight as debris, prune each other's checkpoints and
    resume from each other's."""
    owner = jsonl.object_or_none(storage.location(root) / OWNER) if root else None
    if owner is not None:
        owner = {**owner, "model_args": saved_model(owner, storage.location(root) / OWNER, "checkpoint.folder")}
    if owner is not None and any(owner.get(k) != v for k, v in identity.items()):  # (an older owner's extra keys)
        differ = [f"{k} {owner.get(k)} vs {v}" for k, v in identity.items() if k != "model_args" and owner.get(k) != v]
        theirs, ours = owner.get("model_args") or {}, identity["model_args"]  # the model: each field that differs
        differ += [f"model {name} {theirs.get(name)} vs {ours.get(name)}" for name in sorted({*theirs, *ours})
                   if theirs.get(name) != ours.get(name)]
        raise ConfigError(f"checkpoint.folder: {root} belongs to another job ({', '.join(differ)} in this run); give "
                          "this job a folder of its own, or start from one of its checkpoints with --checkpoint.load")


def claim_folder(root: Path, identity: dict) -> None:
    if not (root / OWNER).exists():
        root.mkdir(parents=True, exist_ok=True)
        storage.write_atomically(root / OWNER, json.dumps(identity, indent=1))


def new_manifest(flavor: str, args: ModelArgs, kind: str, step: int, **extra) -> dict:
    return {"format": FORMAT, "plait": version("plait"), "kind": kind, "step": step, "flavor": flavor,
            "model_args": asdict(args), **extra}
