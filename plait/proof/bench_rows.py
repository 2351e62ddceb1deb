"""The rows `plait bench` can measure: each row's layout and flags, when it applies, what it is
compared with (plait/proof/bench.py runs them)."""

from __future__ import annotations

import importlib.util
from typing import Literal

import torch

from plait.hf.config import FAMILIES as HF_FAMILIES
from plait.models.flavors import FLAVORS
from plait.proof.bench_table import PP_MICROBATCHES

Row = Literal["raw_pytorch", "transformers", "single", "raw_fsdp2", "ddp", "ddp_classic", "fsdp2", "simple_fsdp",
              "simple_fsdp_compiled", "fsdp2_compiled", "fsdp2_ac_selective", "fsdp2_ac_full", "tp", "ddp_tp", "fsdp2_tp", "simple_fsdp_tp",
              "pp", "pp_fsdp2", "cp", "single_float8", "fsdp2_float8", "fsdp2_float8_rowwise", "fsdp2_float8_compiled",
              "fsdp2_mxfp8", "ep", "dense_twin", "attention_twin", "no_mtp", "single_muon", "fsdp2_muon",
              "fsdp2_untracked", "single_offload", "fsdp2_offload"]
# row: the rows holding the whole state it divides (in order of preference). Sharding holds
# 1/world of DDP's state per rank; a pipeline stage 1/pp of the single device's.
STATE_REFERENCES = {"fsdp2": ("ddp", "ddp_classic"), "simple_fsdp": ("ddp", "ddp_classic"), "pp": ("single",)}
# A mixture of experts' dense model of equal active parameters (the dense_twin row), beside its FSDP2 and EP rows.
DENSE_TWINS = {"small_moe": "small_moe_dense"}
# A latent-attention model's twin with grouped-query attention (the attention_twin row)
ATTENTION_TWINS = {"small_mla": "small_mla_gqa"}
# The raw loops (plait/proof/baseline.py): row -> the loop's own options.
RAW = {"raw_pytorch": [], "transformers": ["--model", "transformers"], "raw_fsdp2": []}
# the recorder off: no hang dumps, no slow-rank checks (docs/diagnostics.md), what they cost is FSDP2's tax against it
ENVIRONMENT = {"fsdp2_untracked": {"TORCH_FR_BUFFER_SIZE": "0"}}
# Rows plan predicts (fully_shard, eager, tensorwise float8; no raw loop, classic DDP, SimpleFSDP, compile, MXFP8)
PREDICTED = ("single", "ddp", "fsdp2", "fsdp2_ac_selective", "fsdp2_ac_full", "tp", "ddp_tp", "fsdp2_tp", "pp",
             "pp_fsdp2", "cp", "ep", "dense_twin", "attention_twin", "no_mtp", "single_muon", "fsdp2_muon",
             "single_float8", "fsdp2_float8", "single_offload", "fsdp2_offload")
# Rows `--compile` measures compiled as well (each block compiled, in plait and in the loops alike; under
# ep, a mixture of experts by regions: plait/parallel/__init__.py).
COMPILABLE = ("raw_pytorch", "transformers", "single", "raw_fsdp2", "fsdp2", "ep")


def layouts(nproc: int) -> dict[str, tuple[str, int, list[str]]]:
    """row: (description, world size, extra flags); every row runs in fp32 and in bf16."""
    n = str(nproc)
    tp = ["--parallelism.tp", "2"]
    pp = ["--parallelism.pp", "2", "--parallelism.pp_microbatches", str(PP_MICROBATCHES)]
    simple = ["--parallelism.dp_backend", "simple_fsdp", "--parallelism.dp_shard", n]
    float8 = ["--training.float8", "tensorwise"]
    return {
        "raw_pytorch": ("raw PyTorch loop (no plait)", 1, []),
        "transformers": ("transformers' model, raw loop", 1, []),
        "single": ("single device", 1, []),
        "raw_fsdp2": ("raw FSDP2 loop (fully_shard, no plait)", nproc, []),
        "ddp": ("DDP (fully_shard, replicate mesh)", nproc, ["--parallelism.dp_replicate", n]),
        "ddp_classic": ("DDP (classic, autocast)", nproc, ["--parallelism.dp_backend", "ddp", "--parallelism.dp_replicate",
                                                          n, "--training.mixed_precision_mode", "autocast"]),
        "fsdp2": ("FSDP2", nproc, ["--parallelism.dp_shard", n]),
        "simple_fsdp": ("SimpleFSDP fully_shard", nproc, simple),
        "simple_fsdp_compiled": ("SimpleFSDP fully_shard, compiled", nproc, [*simple, "--compile.enable"]),
        "fsdp2_compiled": ("FSDP2, compiled", nproc, ["--parallelism.dp_shard", n, "--compile.enable"]),
        **{f"fsdp2_ac_{mode}": (f"FSDP2, AC {mode}", nproc, ["--parallelism.dp_shard", n,
                                                            "--activation_checkpoint.mode", mode])
           for mode in ("selective", "full")},
        "tp": ("TP2", 2, tp),
        "ddp_tp": (f"DDP{n}+TP2", 2 * nproc, ["--parallelism.dp_replicate", n, "--parallelism.dp_shard", "1", *tp]),
        "fsdp2_tp": (f"FSDP2({n})+TP2", 2 * nproc, ["--parallelism.dp_shard", n, *tp]),
        "simple_fsdp_tp": (f"SimpleFSDP({n})+TP2", 2 * nproc, [*simple, *tp]),
        "pp": (f"PP2 (1f1b, {PP_MICROBATCHES} micro-batches)", 2, pp),
        "pp_fsdp2": (f"PP2+FSDP2({n})", 2 * nproc, [*pp, "--parallelism.dp_shard", n]),
        "cp": ("CP2 (each sequence over 2 ranks)", 2, ["--parallelism.cp", "2", "--parallelism.dp_shard", "1"]),
        "single_float8": ("single device, float8 tensorwise", 1, float8),
        "fsdp2_float8": ("FSDP2, float8 tensorwise (float8 all-gather)", nproc, ["--parallelism.dp_shard", n, *float8]),
        "fsdp2_float8_rowwise": ("FSDP2, float8 rowwise", nproc,
                                 ["--parallelism.dp_shard", n, "--training.float8", "rowwise"]),
        "fsdp2_float8_compiled": ("FSDP2, float8 tensorwise, compiled", nproc,
                                  ["--parallelism.dp_shard", n, *float8, "--compile.enable"]),
        "fsdp2_mxfp8": ("FSDP2, MXFP8 (the experts too, in bf16)", nproc,
                        ["--parallelism.dp_shard", n, "--training.float8", "mxfp8"]),
        # mixtures of experts only: experts split over the FSDP2 ranks; the dense twin as FSDP2
        "ep": (f"EP{n} over FSDP2({n})", nproc, ["--parallelism.dp_shard", n, "--parallelism.ep", n]),
        "dense_twin": ("FSDP2, the dense twin (equal active parameters)", nproc, ["--parallelism.dp_shard", n]),
        "attention_twin": ("FSDP2, its twin with grouped-query attention", nproc, ["--parallelism.dp_shard", n]),
        "no_mtp": ("FSDP2 without multi-token prediction", nproc, ["--parallelism.dp_shard", n, "--model.mtp_layers", "0"]),
        "single_muon": ("single device, Muon", 1, ["--optimizer.name", "muon"]),
        "fsdp2_muon": ("FSDP2, Muon", nproc, ["--parallelism.dp_shard", n, "--optimizer.name", "muon"]),
        "fsdp2_untracked": ("FSDP2 without the collective recorder", nproc, ["--parallelism.dp_shard", n]),
        "single_offload": ("single device, optimizer offloaded", 1, ["--training.offload", "optimizer"]),
        "fsdp2_offload": ("FSDP2, optimizer offloaded", nproc, ["--parallelism.dp_shard", n, "--training.offload",
                                                             "optimizer"]),
    }


def applies(key: str, flavor: str, attention_mask: str) -> str:
    """Why a row does not apply to a flavor, or "" when it does."""
    if key == "ep" and not FLAVORS[flavor].n_experts:
        return "it needs a mixture of experts (e.g. --flavor small_moe)"
    if key == "dense_twin" and flavor not in DENSE_TWINS:
        return f"only {', '.join(DENSE_TWINS)} has a dense twin"
    if key == "attention_twin" and flavor not in ATTENTION_TWINS:
        return f"only {', '.join(ATTENTION_TWINS)} has a twin of another attention"
    if key == "no_mtp" and not FLAVORS[flavor].mtp_layers:
        return "it needs multi-token prediction (e.g. --flavor small_mla)"
    if key.endswith("_offload") and not torch.cuda.is_available():
        return "it needs a GPU (on a CPU the host is the device)"
    if key == "transformers":
        if importlib.util.find_spec("transformers") is None:
            return "transformers is not installed (pip install -e '.[test]')"
        if FLAVORS[flavor].family not in HF_FAMILIES:
            return f"transformers has no {FLAVORS[flavor].family} model plait exports"
        if attention_mask != "causal":
            return "its loop runs the causal mask only"
    return ""


def gpus_missing(world: int) -> bool:
    """A GPU machine with fewer GPUs than ranks cannot run the row (one GPU per rank)."""
    return torch.cuda.is_available() and torch.cuda.device_count() < world
