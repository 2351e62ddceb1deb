"""`plait` command line: one entry point, one subcommand per job."""

from __future__ import annotations

import difflib
import json
import os
import signal
import sys
from dataclasses import dataclass
from importlib.metadata import version
from typing import Literal

from plait.arguments import parse, parse_args
from plait.config import ConfigError, JobConfig
from plait.launch import EXIT_CODES, die_with_parent, end_worker, launch_local

USAGE = """usage: plait {train,recipes,tokenize,seed-checkpoint,export,merge,generate,eval,bench,bench-context,compare,trace,plan,
             plot,doctor,lighthouse,why-hung} [options]

subcommands:
  train            train a model (plait train --help lists every option)
  recipes          the shipped configs, for real runs and tries: plait train --config NAME
  tokenize         tokenize a corpus once into a folder to train from: plait tokenize --data.path SRC --out DIR
  seed-checkpoint  write the initial weights of a job: plait seed-checkpoint [train options] --out DIR
  export           convert a checkpoint: plait export --checkpoint DIR --out DIR --format hf
  merge            average checkpoints of one model: plait merge CKPT CKPT [...] --out DIR [--weights W W ...]
  generate         continue a text: plait generate --checkpoint DIR --prompt TEXT [--temperature 0]
  eval             score a checkpoint on multiple-choice tasks: plait eval --checkpoint DIR [--tasks FILE.jsonl]
  bench            measure layouts x precisions side by side (plait bench --help)
  bench-context    long sequences: seq_len x cp x cp kind x (causal, document), tokens/s and memory
  compare          train under several layouts from one seed, compare losses (plait compare --help)
  plan             predicted memory, communication and step time of every layout: plait plan --world N --device_memory_gib G
  trace            collectives by phase, dtype and size in profiler traces: plait trace DIR [--expect SPEC]...
  plot             loss, val_loss, lr, grad_norm, tokens/s of runs in a PNG: plait plot METRICS.jsonl [MORE.jsonl] --out run.png
  doctor           is this machine (cluster) fit to train: hardware, compute, corruption, network, a job, storage
  lighthouse       where fault-tolerant replica groups meet: plait lighthouse [--port 29510] [--min_replicas 1]
  why-hung         which rank is behind, on which collective, from a job's dumps: plait why-hung FOLDER

plait --version prints the installed version.
"""


def train(argv: list[str]) -> int:
    try:
        return _train(argv)
    except KeyboardInterrupt:  # Ctrl-C while starting (the imports take seconds) or closing: no step to finish, nothing to save
        if os.environ.get("RANK", "0") == "0":
            print("plait: stopped on SIGINT outside the training steps: nothing saved", file=sys.stderr, flush=True)
        end_worker(128 + signal.SIGINT)


def _train(argv: list[str]) -> int:
    cfg = parse_args(argv, prog="plait train")
    if cfg.fault_tolerance.enable and "RANK" not in os.environ:
        from plait.parallel.replica_groups import lighthouse

        if not lighthouse(cfg):  # every group here, meeting at a lighthouse of their own
            from plait.checks import check_model, check_options
            from plait.lighthouse import launch_groups

            check_model(check_options(cfg, cfg.nproc))
            return launch_groups(argv, cfg)
    if (cfg.nproc > 1 or cfg.max_restarts) and "RANK" not in os.environ:
        from plait.checks import check_model, check_options
        from plait.hardware import pick_device
        from plait.parallel.data_parallel import check_offload

        check_model(check_options(cfg, cfg.nproc))  # once here: a mistake is one line, not one per rank
        check_offload(cfg, pick_device(cfg.training.device))
        warn_of_oversubscription(cfg)
        return launch_local(argv, cfg.nproc, cfg.max_restarts)
    if cfg.nproc > 1 and int(os.environ.get("WORLD_SIZE", "1")) != cfg.nproc:
        raise ConfigError(f"nproc: {cfg.nproc} does not match torchrun's world size {os.environ['WORLD_SIZE']}")
    from plait.checkpoint.checkpointer import SaveFailed
    from plait.preemption import Preempted
    from plait.train import TrainingError, run

    try:
        run(cfg)
        code = 0
    except (TrainingError, SaveFailed) as e:
        sys.stderr.write(f"plait: error: {e}\n")  # (one write: the ranks' lines do not interleave)
        sys.stderr.flush()
        if then := getattr(e, "then", None):  # (a timeout: the other ranks' dumps, before this rank goes)
            then()
        code = 1
    except Preempted as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"plait: stopped on {e}", file=sys.stderr, flush=True)
        code = e.exit_code
    end_worker(code)


def warn_of_oversubscription(cfg) -> None:
    """One line where --nproc asks for more ranks than this machine has cores (or refuses more than its GPUs)."""
    from plait.hardware import local_ranks_warning

    if warning := local_ranks_warning(cfg.nproc, cfg.training.device):
        print(f"plait: warning: {warning}", file=sys.stderr, flush=True)


def recipes(argv: list[str]) -> int:
    """The named configs (plait/configs), each with the first line of its header comment (the
    rest of the header gives the sources of its values, its hardware and plan's layout)."""
    from plait.arguments import CONFIG_DIR

    if argv in (["-h"], ["--help"]):
        print("usage: plait recipes [-h]\n\nThe named configs, each with its header's first line.")
        return 0
    if argv:
        raise ConfigError(f"recipes: takes no options, got {' '.join(argv)}")
    print("plait train --config NAME (docs/recipes.md; each file's header: sources, hardware, layout):")
    for path in sorted(CONFIG_DIR.glob("*.toml")):
        print(f"  {path.stem:16} {path.read_text().splitlines()[0].lstrip('# ')}")
    return 0


def tokenize(argv: list[str]) -> int:
    from plait.data.tokenize import main as tokenize_main

    return tokenize_main(argv)


def doctor(argv: list[str]) -> int:
    """Like `train`: one process per rank under torchrun (--nproc launches them here)."""
    from plait.doctor import parse, run

    cfg = parse(argv)
    if cfg.nproc > 1 and "RANK" not in os.environ:
        from plait.checks import check_options

        check_options(cfg, cfg.nproc)
        warn_of_oversubscription(cfg)
        return launch_local(argv, cfg.nproc, 0, "doctor")
    end_worker(run(cfg))


def bench(argv: list[str]) -> int:
    from plait.proof.bench import main as bench_main

    return bench_main(argv)


def bench_context(argv: list[str]) -> int:
    from plait.proof.context_bench import main as context_main

    return context_main(argv)


def compare(argv: list[str]) -> int:
    from plait.proof.compare import main as compare_main

    return compare_main(argv)


def trace(argv: list[str]) -> int:
    from plait.proof.trace import main as trace_main

    return trace_main(argv)


def plan(argv: list[str]) -> int:
    from plait.plan import main as plan_main

    return plan_main(argv)


def lighthouse(argv: list[str]) -> int:
    from plait.lighthouse import LighthouseConfig, serve

    return serve(parse(LighthouseConfig, argv, "plait lighthouse"))


def plot(argv: list[str]) -> int:
    from plait.metrics.plot import main as plot_main

    return plot_main(argv)


@dataclass
class SeedCheckpointConfig(JobConfig):
    out: str = ""
    """the folder to write the seed checkpoint to (required; never overwritten)"""


def seed_checkpoint(argv: list[str]) -> int:
    """One process, no process group: the job's model initialised from training.seed, weights only."""
    cfg = parse_args(argv, "plait seed-checkpoint", SeedCheckpointConfig)
    if not cfg.out:
        raise ConfigError("out: plait seed-checkpoint needs --out DIR")
    from plait import storage
    from plait.checkpoint.offline import write_seed_checkpoint
    from plait.data import build_tokenizer
    from plait.job_model import job_model

    out = storage.location(cfg.out, "out")
    tokenizer = build_tokenizer(cfg.data)
    args = job_model(cfg, tokenizer.get_vocab_size())
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
    """hf: a Hugging Face folder of the model's family (config.json, safetensors, tokenizer), as transformers loads it"""
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """dtype of the exported weights"""
    shard_mb: int = 5000
    """largest weight file; a bigger model is written as shards + model.safetensors.index.json"""
    weights: Literal["model", "ema"] = "model"
    """a plait checkpoint's weights, or their moving average (saved by a run with training.ema)"""


def export(argv: list[str]) -> int:
    import torch

    from plait.hf.export import export_checkpoint

    opts = parse(ExportArgs, argv, "plait export")
    if opts.shard_mb < 1:
        raise ConfigError(f"shard_mb: must be >= 1, got {opts.shard_mb}")
    from plait import storage

    out = storage.location(opts.out, "out")
    wrote = export_checkpoint(storage.location(opts.checkpoint, "checkpoint"), out, getattr(torch, opts.dtype),
                              opts.shard_mb << 20, opts.weights)
    architecture = json.loads((out / "config.json").read_text())["architectures"][0]  # as transformers reads it
    print(f"plait: exported {opts.checkpoint} to {opts.out} as Hugging Face {architecture}, {opts.dtype}: {wrote}")
    return 0


def merge(argv: list[str]) -> int:
    from plait.checkpoint.merge import main as merge_main

    return merge_main(argv)


def generate(argv: list[str]) -> int:
    from plait.generate import main as generate_main

    return generate_main(argv)


def why_hung(argv: list[str]) -> int:
    from plait.why_hung import main as why_hung_main

    return why_hung_main(argv)


def evaluate(argv: list[str]) -> int:
    from plait.evals.command import main as eval_main

    return eval_main(argv)


COMMANDS = {"train": train, "recipes": recipes, "tokenize": tokenize, "seed-checkpoint": seed_checkpoint, "export": export,
            "merge": merge, "generate": generate, "eval": evaluate, "bench": bench, "bench-context": bench_context,
            "compare": compare, "trace": trace, "plan": plan, "plot": plot, "doctor": doctor,
            "lighthouse": lighthouse, "why-hung": why_hung}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--version":
        print(f"plait {version('plait')}")
        return 0
    if not argv or argv[0] not in COMMANDS:
        asked = bool(argv) and argv[0] in ("-h", "--help")
        if argv and not asked:  # a typo: one line first, with the closest command
            close = difflib.get_close_matches(argv[0], COMMANDS, n=1)
            print(f"plait: error: {argv[0]!r} is not a command{f'; did you mean {close[0]}?' if close else ''} "
                  "(the commands are below)", file=sys.stderr)
        print(USAGE, file=sys.stdout if asked else sys.stderr)
        return 0 if asked else 2
    if EXIT_CODES in os.environ and "RANK" in os.environ:  # a worker of `plait train --nproc`
        die_with_parent()
    try:
        return COMMANDS[argv[0]](argv[1:])
    except ConfigError as e:
        sys.stderr.write(f"plait: error: {one_line(str(e))}\n")  # (one write: the ranks' lines do not interleave)
        sys.stderr.flush()
        return 2


def one_line(message: str) -> str:
    """`message` with each character that would end its line written as its escape: a value quoted
    from a file (a U+2028 in a JSON string) keeps the error on one line."""
    return "".join(c.encode("unicode_escape").decode() if len(f"{c}x".splitlines()) > 1 else c for c in message)


if __name__ == "__main__":
    sys.exit(main())
