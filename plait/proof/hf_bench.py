"""Importing a sharded Hugging Face checkpoint, measured: seconds and peak memory per rank at each
world size, FSDP2 sharding the model as `plait train --checkpoint.load DIR` does.

    python -m plait.proof.hf_bench --out /tmp/hf-bench --worlds 1 2

Writes (once) a Llama 3.2 1B-shaped folder (tied, 128256 tokens, bf16, 1.24B parameters) in
shards of --shard_mb, then for each world size starts that many ranks which build the model on
the meta device, shard it and fill it from the folder (`fill_weights` over `HFWeights`, tensor
by tensor, memory-mapped). Prints one table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import tyro

WORKER = """
import json, os, resource, sys, time
import torch, torch.distributed as dist
from pathlib import Path
from plait import hf, parallel
from plait.checks import check_options
from plait.config import JobConfig
from plait.precision import resolve
from plait.train import init_distributed
from plait.models.weights import fill_weights

def gib(field):
    return int(next(line for line in open("/proc/self/status") if line.startswith(field)).split()[1]) / 2**20

folder, world = Path(sys.argv[1]), int(os.environ["WORLD_SIZE"])
cfg = check_options(JobConfig(), world)
cfg.training.mixed_precision_param = "float32"
init_distributed(cfg, torch.device("cpu"))
mesh = parallel.build_mesh(cfg, "cpu")[0]
args = hf.model_args(folder, "checkpoint.load")
model = parallel.build_model(args, mesh, cfg, resolve(cfg), torch.device("cpu"))
Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) restarts from here: the import's own
before, start = gib("VmRSS:"), time.perf_counter()
weights = hf.HFWeights(folder, args, "checkpoint.load")
fill_weights(model, lambda name, shape: weights[name], weights.buffers)
seconds = time.perf_counter() - start
print(json.dumps({"rank": dist.get_rank(), "seconds": seconds, "model_gib": before, "peak_gib": gib("VmHWM:")}))
dist.destroy_process_group()
"""


@dataclass
class HFBenchArgs:
    out: str
    """working folder: the generated checkpoint (2.5 GB)"""
    worlds: list[int] = field(default_factory=lambda: [1, 2])
    """world sizes to import at (FSDP2 over all ranks)"""
    shard_mb: int = 500
    """largest safetensors file of the generated checkpoint"""


def make_checkpoint(folder: Path, shard_mb: int) -> None:
    """Random bf16 weights of Llama 3.2 1B's shape, written by plait's exporter."""
    import torch

    from plait.hf.config import hf_config
    from plait.hf.weights import parameter_shapes, write_weights
    from plait.models.flavors import FLAVORS

    if (folder / "config.json").exists():
        return
    args = replace(FLAVORS["llama3_1b"], vocab_size=128256, tie_embeddings=True, max_seq_len=131072,
                   rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 8192})
    names, shapes = parameter_shapes(args)
    generator = torch.Generator().manual_seed(0)
    state = {name: (torch.randn(shapes[name], generator=generator) * 0.02).bfloat16() for name in names}
    write_weights(state, args, folder, torch.bfloat16, shard_mb << 20)
    (folder / "config.json").write_text(json.dumps(hf_config(args, torch.bfloat16, None, None), indent=1))


def main(argv: list[str] | None = None) -> int:
    opts = tyro.cli(HFBenchArgs, args=sys.argv[1:] if argv is None else argv)
    folder = Path(opts.out) / "llama3.2-1b-shaped"
    start = time.perf_counter()
    make_checkpoint(folder, opts.shard_mb)
    files = sorted(folder.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files) / 2**30
    print(f"checkpoint: {folder}, {len(files)} shards, {size:.2f} GiB bf16 (made in {time.perf_counter() - start:.0f}s)")
    print(f"{'world':>5} {'rank':>4} {'import s':>9} {'RSS before GiB':>15} {'peak RSS GiB':>13} {'added GiB':>10}")
    for world in opts.worlds:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
                               "--no-python", sys.executable, "-c", WORKER, str(folder)],
                              capture_output=True, text=True, env=env)
        if proc.returncode:
            print(proc.stderr[-3000:], file=sys.stderr)
            return 1
        for row in sorted((json.loads(line) for line in proc.stdout.split("\n") if line.startswith("{")),
                          key=lambda r: r["rank"]):
            print(f"{world:>5} {row['rank']:>4} {row['seconds']:>9.1f} {row['model_gib']:>15.2f} "
                  f"{row['peak_gib']:>13.2f} {row['peak_gib'] - row['model_gib']:>10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
