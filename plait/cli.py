"""`plait` command line: one entry point, one subcommand per job."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from plait.arguments import parse
from plait.config import ConfigError, parse_args, validate

USAGE = """usage: plait {train,tokenize,seed-checkpoint,export,bench,compare,trace,plan} [options]

subcommands:
  train            train a model (plait train --help lists every option)
  tokenize         tokenize a corpus once into a folder to train from: plait tokenize --data.path SRC --out DIR
  seed-checkpoint  write the initial weights of a job: plait seed-checkpoint [train options] --out DIR
  export           convert a checkpoint: plait export --checkpoint DIR --out DIR --format hf
  generate         continue a text: plait generate --checkpoint DIR --prompt TEXT [--temperature 0]
  bench            measure layouts x precisions side by side (plait bench --help)
  compare          train under several layouts from one seed, compare losses (plait compare --help)
  plan             predicted memory, communication and step time of every layout: plait plan --world N --device_memory_gib G
  trace            collectives by phase, dtype and size in profiler traces: plait trace DIR [--expect SPEC]...
"""


def train(argv: list[str]) -> int:
    cfg = parse_args(argv, prog="plait train")
    if (cfg.nproc > 1 or cfg.max_restarts) and "RANK" not in os.environ:
        # Check options once here, so a mistake prints one line instead of one per rank.
        validate(cfg, cfg.nproc)
        return launch_local(argv, cfg.nproc, cfg.max_restarts)
    if cfg.nproc > 1 and int(os.environ.get("WORLD_SIZE", "1")) != cfg.nproc:
        raise ConfigError(f"nproc: {cfg.nproc} does not match torchrun's world size {os.environ['WORLD_SIZE']}")
    from plait.checkpoint import SaveFailed
    from plait.preemption import Preempted
    from plait.train import TrainingError, run

    try:
        run(cfg)
    except (TrainingError, SaveFailed) as e:
        print(f"plait: error: {e}", file=sys.stderr, flush=True)
        return 1
    except Preempted as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"plait: stopped on {e}", file=sys.stderr, flush=True)
        return e.exit_code
    return 0


TORCHRUN_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


def launch_local(argv: list[str], nproc: int, max_restarts: int) -> int:
    """`plait train --nproc N`: the same job under torchrun on this machine."""
    # torchrun would read a passed-through `--nproc` as an abbreviation of its own option.
    worker_argv, skip = [], False
    for i, arg in enumerate(argv):
        if skip or arg.startswith("--nproc="):
            skip = False
            continue
        skip = arg == "--nproc"
        if not skip:
            worker_argv.append(arg)
    # torchrun's agent handles SIGUSR1 too (by default it would die of it before its workers save).
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               f"--max-restarts={max_restarts}", f"--signals-to-handle={TORCHRUN_SIGNALS}", "-m", "plait", "train",
               *worker_argv]
    # A scheduler signals every process of the job, a container runtime only its first (this one):
    # SIGTERM and SIGUSR1 are forwarded to the workers, which save and stop (a duplicate changes
    # nothing).
    job = subprocess.Popen(command)
    signalled: list[int] = []

    def forward(signum, frame):
        workers = descendants(job.pid)
        signalled.extend(workers)
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, forward)
    stopping = False
    while job.poll() is None:
        # Once the signalled workers have saved and gone, the agent goes too: it would restart them.
        if signalled and not stopping and not any(alive(pid) for pid in signalled):
            stopping = True
            with contextlib.suppress(ProcessLookupError):
                os.kill(job.pid, signal.SIGTERM)
        time.sleep(0.1)
    # torchrun can return while its workers still save (a second SIGTERM ends its wait early):
    # the job ends when its last worker does.
    while any(alive(pid) for pid in signalled):
        time.sleep(0.1)
    return job.returncode


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (torchrun's workers are its children), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    found, stack = [], [pid]
    while stack:
        kids = children.get(stack.pop(), [])
        found += kids
        stack += kids
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited


def tokenize(argv: list[str]) -> int:
    from plait.data.tokenize import main as tokenize_main

    return tokenize_main(argv)


def bench(argv: list[str]) -> int:
    from plait.proof.bench import main as bench_main

    return bench_main(argv)


def compare(argv: list[str]) -> int:
    from plait.proof.compare import main as compare_main

    return compare_main(argv)


def trace(argv: list[str]) -> int:
    from plait.proof.trace import main as trace_main

    return trace_main(argv)


def plan(argv: list[str]) -> int:
    from plait.plan import main as plan_main

    return plan_main(argv)


def seed_checkpoint(argv: list[str]) -> int:
    """One process, no process group: the job's model initialised from training.seed, weights only."""
    if "--out" not in argv[:-1]:
        raise ConfigError("out: plait seed-checkpoint needs --out DIR")
    i = argv.index("--out")
    out, argv = Path(argv[i + 1]), argv[:i] + argv[i + 2:]
    cfg = parse_args(argv, prog="plait seed-checkpoint")
    from plait import hf
    from plait.checkpoint import write_seed_checkpoint
    from plait.data import build_tokenizer

    tokenizer = build_tokenizer(cfg.data)
    args = hf.job_model(cfg, tokenizer.get_vocab_size())
    write_seed_checkpoint(cfg, args, out, tokenizer)
    print(f"plait: seed checkpoint of {cfg.model.flavor.replace('auto', 'debug')} (seed {cfg.training.seed}) written to {out}")
    return 0


@dataclass
class ExportArgs:
    checkpoint: str
    """a plait checkpoint folder (seed or training)"""
    out: str
    """folder to write"""
    format: Literal["hf"] = "hf"
    """hf: Hugging Face Llama (config.json, safetensors, tokenizer), as transformers loads it"""
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """dtype of the exported weights"""
    shard_mb: int = 5000
    """largest weight file; a bigger model is written as shards + model.safetensors.index.json"""


def export(argv: list[str]) -> int:
    import torch

    from plait.hf.export import export_checkpoint

    opts = parse(ExportArgs, argv, "plait export")
    if opts.shard_mb < 1:
        raise ConfigError(f"shard_mb: must be >= 1, got {opts.shard_mb}")
    wrote = export_checkpoint(Path(opts.checkpoint), Path(opts.out), getattr(torch, opts.dtype), opts.shard_mb << 20)
    print(f"plait: exported {opts.checkpoint} to {opts.out} as Hugging Face Llama, {opts.dtype}: {wrote}")
    return 0


def generate(argv: list[str]) -> int:
    from plait.generate import main as generate_main

    return generate_main(argv)


COMMANDS = {"train": train, "tokenize": tokenize, "seed-checkpoint": seed_checkpoint, "export": export,
            "generate": generate, "bench": bench, "compare": compare,
            "trace": trace, "plan": plan}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(USAGE, file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    try:
        return COMMANDS[argv[0]](argv[1:])
    except ConfigError as e:
        print(f"plait: error: {e}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
