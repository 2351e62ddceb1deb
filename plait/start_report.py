"""The lines a run prints before its first step (rank 0): the layout and the model, the batch,
the precision and why, and warnings a user acts on (emulated bf16 or float8, a Hugging Face
folder's hyper-parameters left at the debug job's)."""

from __future__ import annotations

import math

import torch

from plait import float8, parallel
from plait.config import JobConfig, dp_degree, grad_accumulation_steps
from plait.hardware import peak_flops
from plait.hyperparameters import hf_start_lines
from plait.models.args import ModelArgs
from plait.models.transformer import Transformer, num_params


def print_start_report(cfg: JobConfig, args: ModelArgs, mesh, replicas, loader, precision, pipeline, peak,
                       shapes: list, device: torch.device) -> None:
    """`peak`: the device's measured matmul speed for the model's `shapes` (plait/hardware.py)."""
    t = cfg.training
    with torch.device("meta"):
        whole = Transformer(args)
    active = f" ({num_params(whole, active=True) / 1e6:.1f}M active: {args.top_k} of {args.n_experts} experts)" \
        if args.n_experts else ""
    model = cfg.checkpoint.load if cfg.model.flavor == "auto" else cfg.model.flavor
    print(f"plait: {parallel.describe(mesh)}{replicas.describe()} | {model}: "
          f"{num_params(whole) / 1e6:.1f}M params{' (tied embeddings)' if args.tie_embeddings else ''}{active}, "
          f"vocab {args.vocab_size} | {'+'.join(map(str, loader.num_sequences))} sequences of {t.seq_len} tokens | "
          f"global batch {t.global_batch_size} = micro {t.micro_batch_size} x dp {dp_degree(cfg)} x accum "
          f"{grad_accumulation_steps(cfg)} | {peak}\nplait: {precision.describe()}" +
          (f"\nplait: {pipeline.summary}" if pipeline else ""), flush=True)
    if loader.schedule.ends:  # (a ramp or a warm-up)
        print(f"plait: {loader.schedule.describe(t.steps)}", flush=True)
    for line in loader.schedule.phases.describe() if loader.schedule.phases else ():
        print(f"plait: {line}", flush=True)
    for line in hf_start_lines(cfg):
        print(line, flush=True)
    if precision.emulated:
        fp32_peak = peak_flops(device, torch.float32, shapes).flops
        print(f"plait: warning: bfloat16 was asked for, but this device has no bf16 matmul units: the model's "
              f"matmuls measured {fp32_peak / peak.flops:.0f}x slower in bf16 than in float32 here "
              f"(--training.mixed_precision_param auto picks float32 on such hardware)", flush=True)
    if t.float8 != "none":
        print(f"plait: {float8.summary(args, cfg, device, precision.compute)}", flush=True)
        if not float8.native(t.float8, device)[0]:
            print(f"plait: warning: {t.float8} is emulated here: a linear layer's training step measured "
                  f"{float8.slowdown(t.float8, precision.compute, max(shapes, key=math.prod)):.1f}x slower in "
                  f"{t.float8} than in {str(precision.compute).removeprefix('torch.')} (it pays off on GPUs with "
                  f"{'MXFP8' if float8.microscaling(t.float8) else 'float8'} tensor cores)", flush=True)
