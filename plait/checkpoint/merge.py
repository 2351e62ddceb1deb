"""`plait merge`: the weighted average of checkpoints of one model (OLMo-core's model merger, the
"souping" of an anneal's last checkpoints), written as a plait checkpoint that trains, evaluates
and exports as any other.

    plait merge ckpt/step-900 ckpt/step-950 ckpt/step-1000 --out merged/
    plait merge run-a/ run-b/ --weights 0.7 0.3 --out merged/        # a job folder: its newest checkpoint

Each checkpoint is read whole on the CPU in one process (DCP reshards: the layouts they were saved
from do not matter); every weight is averaged in float64 and rounded once to its own dtype (the
checkpoints' float32), far below one float32 step from the exact mean. Weights,
never optimizer state: a merge starts a new run (`--checkpoint.load merged/`), as a seed checkpoint does.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
import tyro

from plait import storage
from plait.arguments import parse
from plait.checkpoint.offline import load_full_state_dict, write_weights_checkpoint
from plait.checkpoint.manifest import check_compatible, checkpoint_in, manifest_model, new_manifest, read_manifest
from plait.config import ConfigError
from plait.data.tokenizer import read_tokenizer
from plait.hf.tokenizer import TOKENIZER


@dataclass
class MergeArgs:
    checkpoints: tyro.conf.Positional[list[str]] = field(default_factory=list)
    """plait checkpoints (or job folders: their newest) of one model, from any layout"""
    out: str = ""
    """the folder to write the merged checkpoint to (never overwritten)"""
    weights: list[float] = field(default_factory=list)
    """one weight per checkpoint, >= 0, normalised to sum to 1 (default: equal)"""


def merge(folders: list, weights: list[float]) -> tuple[dict[str, torch.Tensor], dict, object]:
    """The weighted mean of the checkpoints' weights (`weights` summing to 1), the first one's
    manifest and its folder."""
    first = None
    for folder in folders:
        manifest = read_manifest(folder)
        if manifest is None:
            raise ConfigError(f"checkpoints: {folder} is not a complete plait checkpoint (no plait.json)")
        args = manifest_model(manifest, folder, "checkpoints")
        check_compatible(folder, args, "checkpoints")
        if first is not None and asdict(args) != asdict(first[1]):
            theirs, ours = asdict(args), asdict(first[1])
            differ = ", ".join(f"{k} {ours[k]} vs {theirs[k]}" for k in ours if ours[k] != theirs[k])
            raise ConfigError(f"checkpoints: {folder} holds another model than {first[0]} ({differ}); a merge "
                              "averages checkpoints of one model")
        first = first or (folder, args, manifest)
    merged, dtypes = {}, {}
    for folder, weight in zip(folders, weights):
        for name, tensor in load_full_state_dict(folder, first[1], "checkpoints").items():
            dtypes[name] = tensor.dtype
            merged[name] = merged.get(name, torch.zeros((), dtype=torch.float64)) + tensor.double() * weight
    return {name: t.to(dtypes[name]) for name, t in merged.items()}, first[2], first[0]


def main(argv: list[str]) -> int:
    opts = parse(MergeArgs, argv, "plait merge")
    if len(opts.checkpoints) < 2 or not opts.out:
        raise ConfigError("checkpoints: plait merge needs two checkpoints or more and --out DIR: plait merge CKPT "
                          "CKPT [...] --out DIR")
    weights = opts.weights or [1.0] * len(opts.checkpoints)
    if len(weights) != len(opts.checkpoints) or min(weights) < 0 or not math.fsum(weights) > 0:
        raise ConfigError(f"weights: {list(weights)}; give one weight >= 0 per checkpoint ({len(opts.checkpoints)}), "
                          "not all 0")
    shares = [w / math.fsum(weights) for w in weights]
    folders = [checkpoint_in(storage.location(c, "checkpoints"), "checkpoints") for c in opts.checkpoints]
    out = storage.location(opts.out, "out")
    if read_manifest(out) is not None:  # (before minutes of reading; the write checks it again)
        raise ConfigError(f"out: {out} already holds a checkpoint; refusing to overwrite it")
    state, manifest, source = merge(folders, shares)
    tokenizer = read_tokenizer(source / TOKENIZER, "checkpoints") if (source / TOKENIZER).is_file() else None
    record = {"merged": [{"checkpoint": str(f), "step": read_manifest(f)["step"], "weight": share}
                         for f, share in zip(folders, shares)]}
    args = manifest_model(manifest, source, "checkpoints")
    write_weights_checkpoint(state, new_manifest(manifest.get("flavor", ""), args, "merge", 0), out, tokenizer, **record)
    shown = ", ".join(f"{f} x {share:.3g}" for f, share in zip(folders, shares))
    print(f"plait: merged {len(folders)} checkpoints ({shown}) into {out}: start a run from it with --checkpoint.load "
          f"{out}, or export it")
    return 0
