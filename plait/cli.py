"""`plait` command line: one entry point, one subcommand per job."""

from __future__ import annotations

import os
import subprocess
import sys

from plait.config import ConfigError, parse_args, validate

USAGE = """usage: plait {train,bench} [options]

subcommands:
  train   train a model (plait train --help lists every option)
  bench   measure layouts x precisions side by side (plait bench --help)
"""


def train(argv: list[str]) -> int:
    cfg = parse_args(argv, prog="plait train")
    if cfg.nproc > 1 and "RANK" not in os.environ:
        # Check options once here, so a mistake prints one line instead of one per rank.
        validate(cfg, cfg.nproc)
        return launch_local(argv, cfg.nproc)
    if cfg.nproc > 1 and int(os.environ.get("WORLD_SIZE", "1")) != cfg.nproc:
        raise ConfigError(f"nproc: {cfg.nproc} does not match torchrun's world size {os.environ['WORLD_SIZE']}")
    from plait.train import TrainingError, run

    try:
        run(cfg)
    except TrainingError as e:
        print(f"plait: error: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


def launch_local(argv: list[str], nproc: int) -> int:
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
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "plait", "train", *worker_argv]
    return subprocess.run(command).returncode


def bench(argv: list[str]) -> int:
    from plait.bench import main as bench_main

    return bench_main(argv)


COMMANDS = {"train": train, "bench": bench}


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
