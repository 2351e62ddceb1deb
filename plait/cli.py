"""`plait` command line: one entry point, one subcommand per job."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import typing
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Literal

from plait.arguments import parse, parse_args
from plait.config import ConfigError, JobConfig

USAGE = """usage: plait {train,tokenize,seed-checkpoint,export,generate,eval,bench,bench-context,compare,trace,plan,plot,doctor,
             lighthouse} [options]

subcommands:
  train            train a model (plait train --help lists every option)
  tokenize         tokenize a corpus once into a folder to train from: plait tokenize --data.path SRC --out DIR
  seed-checkpoint  write the initial weights of a job: plait seed-checkpoint [train options] --out DIR
  export           convert a checkpoint: plait export --checkpoint DIR --out DIR --format hf
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
            from plait.checks import check_options
            from plait.lighthouse import launch_groups

            check_options(cfg, cfg.nproc)
            return launch_groups(argv, cfg)
    if (cfg.nproc > 1 or cfg.max_restarts) and "RANK" not in os.environ:
        from plait.checks import check_options

        check_options(cfg, cfg.nproc)  # once here, so a mistake prints one line instead of one per rank
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
        print(f"plait: error: {e}", file=sys.stderr, flush=True)
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


def end_worker(code: int) -> typing.NoReturn:
    """End a training process whose work is done: its files are written and closed and its
    process group destroyed (after a barrier). Under `plait train --nproc` its exit code is left
    for the launcher first (torchrun's agent reports only its own, which after a signal is 1
    whatever the workers did). The interpreter's teardown is skipped: torch 2.13's C++
    destructors at exit occasionally abort a gloo process ('terminate called without an active
    exception', exit -6; seen in about 1 of 40 world-2 runs here), which torchrun takes for a
    failed worker (and --max-restarts would restart a finished job)."""
    if folder := os.environ.get(EXIT_CODES):
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        Path(folder, f"{attempt}-rank-{os.environ.get('RANK', '0')}").write_text(str(code))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


EXIT_CODES = "PLAIT_EXIT_CODES"  # the folder where workers leave their exit codes for launch_local


def die_with_parent() -> None:
    """Under `plait train --nproc`: end this process (torchrun's agent, or a worker) when the one
    that started it dies. They run in sessions of their own, so a SIGKILL to the launcher's
    process group (a timeout, an IDE's stop) reaches none of them: left running, the job would go
    on saving into the folder the next run resumes from. (Linux's parent-death signal; elsewhere
    nothing.)"""
    parent = os.getppid()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent:  # (it died before the signal was set)
        os._exit(128 + signal.SIGKILL)


def launch_local(argv: list[str], nproc: int, max_restarts: int, subcommand: str = "train") -> int:
    """`plait train --nproc N` (or `plait doctor --nproc N`): the same job under torchrun on this
    machine, with the exit code one process would have: 128 + the signal after a preemption, 1
    after an error, 0 done."""
    # torchrun would read a passed-through `--nproc` as an abbreviation of its own option.
    worker_argv, skip = [], False
    for i, arg in enumerate(argv):
        if skip or arg.startswith("--nproc="):
            skip = False
            continue
        skip = arg == "--nproc"
        if not skip:
            worker_argv.append(arg)
    from plait.preemption import handled

    # The signals the workers handle: torchrun's agent handles SIGUSR1 too (by default it would
    # die of it before its workers save), and leaves one this process ignores ignored.
    signals = handled()
    command = [sys.executable, "-m", "plait.torchrun", "--standalone", f"--nproc-per-node={nproc}",
               f"--max-restarts={max_restarts}", f"--signals-to-handle={','.join(sig.name for sig in signals)}",
               "-m", "plait", subcommand, *worker_argv]
    with tempfile.TemporaryDirectory(prefix="plait-exit-") as codes:
        torchrun, signum = _run_forwarding_signals(command, {**os.environ, EXIT_CODES: codes}, signals)
        attempts: dict[int, list[int]] = {}
        for path in Path(codes).iterdir():
            attempts.setdefault(int(path.name.split("-")[0]), []).append(int(path.read_text()))
    return exit_code(torchrun, signum, attempts[max(attempts)] if attempts else [], nproc)


def _run_forwarding_signals(command: list[str], env: dict, signals: tuple[int, ...]) -> tuple[int, int]:
    """Run torchrun and wait for it and for the workers it had; a stopping signal meanwhile goes
    to its agent, which forwards it to the workers and, shutting down, never restarts them (a
    container runtime signals only this process, a closed terminal sends SIGHUP to it; repeats
    change nothing). A second Ctrl-C kills the job at once, as it ends one process. The agent
    runs in a session of its own, as its workers do: a terminal's Ctrl-C reaches it only from
    here, after this process has counted it, so a second Ctrl-C is never taken for a first one
    (both could reach this process before it had run its handler once). The handlers are in
    place before the agent starts: a signal while it starts is passed on as soon as it has (one
    before, and it never starts). Returns (torchrun's exit code, the signal: SIGINT after a
    second Ctrl-C, or 0)."""
    received: list[int] = []
    workers: list[int] = []
    job: list[subprocess.Popen] = []  # once started

    def act(n: int) -> None:
        """What the n-th signal received does to the started job."""
        signum, agent = received[n], job[0].pid
        if n == 0:
            workers.extend(descendants(agent))
            with contextlib.suppress(ProcessLookupError):
                os.kill(agent, signum)
        elif signum == signal.SIGINT and received[:n + 1].count(signal.SIGINT) == 2:
            for pid in [agent, *workers, *descendants(agent)]:  # the agent first: it sees no worker die
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def forward(signum, frame):
        received.append(signum)
        if job:
            act(len(received) - 1)

    previous = {sig: signal.signal(sig, forward) for sig in signals}
    try:
        if not received:
            job.append(subprocess.Popen(command, env=env, start_new_session=True))
            for n in range(len(received)):  # (those that came while it started; a repeat changes nothing)
                act(n)
            job[0].wait()
            # torchrun can return while its workers still save (a repeated signal ends its wait
            # early): the job ends when its last worker does.
            while any(alive(pid) for pid in workers):
                time.sleep(0.1)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return job[0].returncode if job else 0, signal.SIGINT if received.count(signal.SIGINT) > 1 else (received or [0])[0]


def exit_code(torchrun: int, signum: int, reported: list[int], nproc: int) -> int:
    """The job's exit code: torchrun's, unless a signal stopped it; then what the workers of the
    last attempt reported."""
    if not signum:
        return torchrun
    if errors := [c for c in reported if 0 < c < 128]:
        return errors[0]  # a save that failed on the way out, say: as one process would say
    if len(reported) == nproc and not any(reported):
        return 0  # the signal came after the last step: the job is done
    return 128 + signum


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
    out = Path(cfg.out)
    from plait.checkpoint.checkpointer import write_seed_checkpoint
    from plait.data import build_tokenizer
    from plait.job_model import job_model

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


def export(argv: list[str]) -> int:
    import torch

    from plait.hf.export import export_checkpoint

    opts = parse(ExportArgs, argv, "plait export")
    if opts.shard_mb < 1:
        raise ConfigError(f"shard_mb: must be >= 1, got {opts.shard_mb}")
    wrote = export_checkpoint(Path(opts.checkpoint), Path(opts.out), getattr(torch, opts.dtype), opts.shard_mb << 20)
    architecture = json.loads(Path(opts.out, "config.json").read_text())["architectures"][0]  # as transformers reads it
    print(f"plait: exported {opts.checkpoint} to {opts.out} as Hugging Face {architecture}, {opts.dtype}: {wrote}")
    return 0


def generate(argv: list[str]) -> int:
    from plait.generate import main as generate_main

    return generate_main(argv)


def evaluate(argv: list[str]) -> int:
    from plait.evals.command import main as eval_main

    return eval_main(argv)


COMMANDS = {"train": train, "tokenize": tokenize, "seed-checkpoint": seed_checkpoint, "export": export,
            "generate": generate, "eval": evaluate, "bench": bench, "bench-context": bench_context, "compare": compare,
            "trace": trace, "plan": plan, "plot": plot, "doctor": doctor,
            "lighthouse": lighthouse}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--version":
        print(f"plait {version('plait')}")
        return 0
    if not argv or argv[0] not in COMMANDS:
        print(USAGE, file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    if EXIT_CODES in os.environ and "RANK" in os.environ:  # a worker of `plait train --nproc`
        die_with_parent()
    try:
        return COMMANDS[argv[0]](argv[1:])
    except ConfigError as e:
        print(f"plait: error: {one_line(str(e))}", file=sys.stderr, flush=True)
        return 2


def one_line(message: str) -> str:
    """`message` with each character that would end its line written as its escape: a value quoted
    from a file (a U+2028 in a JSON string) keeps the error on one line."""
    return "".join(c.encode("unicode_escape").decode() if len(f"{c}x".splitlines()) > 1 else c for c in message)


if __name__ == "__main__":
    sys.exit(main())
