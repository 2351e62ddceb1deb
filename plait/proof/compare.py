"""`plait compare`: train one job under several layouts and report how far their losses drift.

Every run starts from one seed checkpoint, reads the same batches and runs deterministically
with one thread per rank, so a difference comes from the layout alone (reduction order, sharded
norms, precision). Runs are real `plait train` processes (torchrun for world > 1), like `plait bench`.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import shutil
import subprocess
import sys
import time
import typing
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Annotated, Literal

import tyro

from plait import jsonl
from plait.arguments import parse
from plait.arguments import parse_args
from plait.checks import check_options
from plait.arguments import sections
from plait.config import ConfigError, JobConfig

METRICS = ("loss", "val_loss", "grad_norm")  # compared between runs, when both have them
FLOOR = 1e-12  # where the log-scale plot shows a zero difference, so bitwise-equal runs stay visible
# Options compare sets in every run itself, and why neither a run nor the shared options may.
CONTROLLED = {"training.steps": "use plait compare --steps", "nproc": "give it per run as nproc=N",
              "training.threads": "pinned to 1 per rank: the thread count changes summation order",
              "debug.deterministic": "always on", "metrics.jsonl": "compare reads it",
              "checkpoint.load": "every run starts from compare's seed checkpoint"}
# Options every run must share: the seed checkpoint and the batches are made once for all runs, and
# validation losses are compared step for step.
SHARED = ("model.", "data.", "training.seed", "training.global_batch_size", "training.seq_len", "training.eval_")


@dataclass
class CompareArgs:
    """Train one job under several layouts from one seed checkpoint; compare per-step loss and grad norm.
    Train options shared by every run go after `--`."""

    out: str
    """folder for the seed checkpoint, per-run metrics, losses.json and losses.png (rewritten each time)"""
    run: Annotated[tuple[str, ...], tyro.conf.UseAppendAction] = ()
    """one run: comma-separated key=value overrides, e.g. "dp_replicate=2,tp=2" or "nproc=1,micro_batch_size=2";
    the first run is the reference"""
    steps: int = 8
    """optimizer steps per run"""
    atol: float | None = None
    """fail (exit 1) when a loss or grad norm differs from its reference by more than this"""
    assert_equal: bool = False
    """fail unless every run is bitwise equal to its reference (atol 0)"""
    export: str = ""
    """write the reference run's losses, with its config and torch version, to this golden JSON file"""
    golden: str = ""
    """also compare every run against the losses in this golden file (from --export)"""
    jobs: int = 1
    """runs trained at once (each runs one thread per rank, deterministically: results do not depend on it)"""


@dataclass
class Run:
    label: str
    world: int
    train_flags: list[str]
    config: dict


class RunFailed(RuntimeError):
    """A train process failed; the message holds its command and stderr tail."""


def option_types() -> dict[str, type]:
    """`section.key` -> type, for every train option."""
    return {f"{name}.{key}": hint for name, cls in sections().items()
            for key, hint in typing.get_type_hints(cls).items()}


def resolve_key(key: str, types: dict[str, type], spec: str) -> str:
    """`section.key` as written, or a bare key that names exactly one option."""
    if key in types or key == "nproc":
        return key
    matches = [name for name in types if name.split(".", 1)[1] == key]
    if len(matches) > 1:
        raise ConfigError(f"{key}: ambiguous in run {spec!r}, say which: {', '.join(matches)}")
    if not matches:
        unique = sorted(k for k, n in Counter(name.split(".", 1)[1] for name in types).items() if n == 1)
        close = difflib.get_close_matches(key, list(types) if "." in key else ["nproc", *unique], n=3)
        names = f"{', '.join(close[:-1])} or {close[-1]}" if len(close) > 1 else "".join(close)
        hint = f"; did you mean {names}?" if close else ""
        raise ConfigError(f"{key}: unknown option in run {spec!r}{hint} (a key is nproc, section.key, or a key "
                          "that names one train option: plait train --help lists them)")
    return matches[0]


def override_flags(name: str, kind: type, value: str, spec: str) -> list[str]:
    """Check the value against the option's type here, so a bad one is one line naming the key
    (tyro would print a whole usage screen), and turn it into train flags."""
    if kind is bool:
        if value.lower() not in ("true", "false"):
            raise ConfigError(f"{name}: {value!r} in run {spec!r} is not true or false")
        section, key = name.split(".", 1)
        return [f"--{name}" if value.lower() == "true" else f"--{section}.no_{key}"]
    if typing.get_origin(kind) is Literal:
        if value not in typing.get_args(kind):
            raise ConfigError(f"{name}: {value!r} in run {spec!r} is not one of {list(typing.get_args(kind))}")
    else:
        try:
            kind(value)
        except ValueError:
            raise ConfigError(f"{name}: {value!r} in run {spec!r} is not {kind.__name__}") from None
    return [f"--{name}", value]


def parse_run(spec: str, types: dict[str, type]) -> tuple[list[str], int | None]:
    """`key=value,...` -> (train flags, nproc if given)."""
    flags, nproc = [], None
    for item in filter(None, spec.split(",")):
        key, sep, value = (part.strip() for part in item.partition("="))
        if not sep:
            raise ConfigError(f"run {spec!r}: {item!r} is not key=value")
        name = resolve_key(key, types, spec)
        if name == "nproc":
            if not value.isdigit() or int(value) < 1:
                raise ConfigError(f"nproc: {value!r} in run {spec!r} is not a positive int")
            nproc = int(value)
        elif name in CONTROLLED:
            raise ConfigError(f"{name}: set by plait compare ({CONTROLLED[name]})")
        elif name.startswith(SHARED):
            raise ConfigError(f"{name}: must be the same in every run; give it after -- with the shared options")
        else:
            flags += override_flags(name, types[name], value, spec)
    return flags, nproc


def flat(cfg: JobConfig) -> dict:
    """Every option as `section.key`, tuples as lists: what a golden file's JSON gives back."""
    return {f"{section}.{key}": list(value) if isinstance(value, tuple) else value
            for section, values in dataclasses.asdict(cfg).items() if isinstance(values, dict)
            for key, value in values.items()}


def plan(args: CompareArgs, shared: list[str]):
    """The shared config, its model shape and every run, all validated before anything is
    launched: a typo in the last run must not cost the minutes of the ones before it."""
    if len(args.run) < (1 if args.golden or args.export else 2):
        raise ConfigError("run: give at least two --run (one is enough with --golden or --export)")
    if args.steps < 1:
        raise ConfigError(f"steps: must be >= 1, got {args.steps}")
    for arg in shared:
        if (name := arg.lstrip("-").split("=", 1)[0].replace("-", "_")) in CONTROLLED:
            raise ConfigError(f"{name}: set by plait compare ({CONTROLLED[name]})")
    types = option_types()
    overrides = [parse_run(spec, types) for spec in args.run]
    # Torch and the tokenizer take seconds to load: the typos above fail before them.
    from plait.data import build_tokenizer
    from plait.job_model import job_model
    from plait.parallel.tensor_parallel import check_divisibility

    shared_cfg = parse_args([*shared, "--training.steps", str(args.steps)], prog="plait compare")
    try:  # model and data options are shared, so one tokenizer settles the model for every run
        tokenizer = build_tokenizer(shared_cfg.data)
        model = job_model(shared_cfg, tokenizer.get_vocab_size())
    except ValueError as e:
        raise ConfigError(str(e)) from None
    runs = []
    for i, (spec, (flags, nproc)) in enumerate(zip(args.run, overrides)):
        train_flags = [*shared, *flags, "--training.steps", str(args.steps), "--training.threads", "1",
                       "--debug.deterministic"]
        cfg = parse_args(train_flags, prog="plait compare")
        p = cfg.parallelism
        world = nproc or p.dp_replicate * max(p.dp_shard, 1) * p.tp * p.pp
        try:
            check_options(cfg, world)
            check_divisibility(model, cfg)  # a tp that does not split the heads fails now, not mid-compare
        except ConfigError as e:
            raise ConfigError(f"run {spec!r} (world {world}): {e}") from None
        label = spec or "defaults"  # the same run twice is a fair check of run-to-run determinism
        label = label if all(r.label != label for r in runs) else f"{label} #{i + 1}"
        runs.append(Run(label, world, train_flags, flat(cfg)))
    return shared_cfg, model, tokenizer, runs


def read_golden(path: str, shared: dict, steps: int) -> dict:
    try:
        golden = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"golden: cannot read {path}: {e}") from None
    if not isinstance(golden, dict) or {"loss", "grad_norm", "shared", "torch"} - golden.keys():
        raise ConfigError(f"golden: {path} is not a golden file of plait compare --export")
    if len(golden["loss"]) != steps:
        raise ConfigError(f"golden: {path} holds {len(golden['loss'])} steps, this compare runs {steps} (--steps)")
    # Options added to plait after the file was written are not differences: only keys both know count.
    diff = [f"{k} {golden['shared'][k]!r} (golden) vs {v!r}" for k, v in shared.items()
            if k in golden["shared"] and golden["shared"][k] != v]
    if diff:
        raise ConfigError(f"golden: {path} was made with other shared options: {'; '.join(diff)}")
    if golden["torch"] != version("torch"):
        print(f"compare: note: {path} comes from torch {golden['torch']}, this is {version('torch')}; "
              "bitwise equality across versions is not expected", file=sys.stderr)
    return golden


def train(run: Run, seed: Path, metrics: Path) -> dict[str, list[float]]:
    """One `plait train` process (torchrun for world > 1) -> its per-step losses and grad norms, and
    its validation losses (at the evaluation steps; none without data.val_path)."""
    metrics.unlink(missing_ok=True)  # the logger appends: a rerun must not add to an old file
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={run.world}"] \
        if run.world > 1 else [sys.executable]
    command = [*launcher, "-m", "plait", "train", *run.train_flags, "--checkpoint.load", str(seed),
               "--metrics.jsonl", str(metrics)]
    start = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RunFailed(f"run {run.label!r} failed (exit {proc.returncode}): {' '.join(command)}\n"
                        f"{proc.stderr[-3000:]}")
    print(f"compare: {run.label} (world {run.world}): {time.perf_counter() - start:.1f}s", file=sys.stderr, flush=True)
    rows = jsonl.rows(metrics)
    return {"loss": [r["loss"] for r in rows], "grad_norm": [r["grad_norm"] for r in rows],
            "val_loss": [r["val_loss"] for r in rows if "val_loss" in r],
            "val_step": [r["step"] for r in rows if "val_loss" in r]}


def compared(values: dict, ref: dict) -> list[str]:
    """The metrics both runs have: loss and grad norm always, validation loss where both evaluated."""
    return [m for m in METRICS if values.get(m) and ref.get(m)]


def difference(run: Run, values: dict, ref_label: str, ref: dict) -> dict:
    metrics = compared(values, ref)
    row = {"run": run.label, "world": run.world, "vs": ref_label, "bitwise": all(values[m] == ref[m] for m in metrics)}
    for metric in metrics:
        diffs = [abs(a - b) for a, b in zip(values[metric], ref[metric])]
        worst = max(range(len(diffs)), key=diffs.__getitem__)
        steps = values["val_step"] if metric == "val_loss" else range(1, len(diffs) + 1)
        row[f"{metric}_abs"], row[f"{metric}_step"] = diffs[worst], steps[worst]
        row[f"{metric}_rel"] = max(d / abs(b) if b else d for d, b in zip(diffs, ref[metric]))
    return row


def markdown(table: list[dict]) -> str:
    def num(row: dict, key: str) -> str:
        return f"{row[key]:.1e}" if key in row else "-"
    lines = ["| run | world | vs | max abs Δloss | max rel Δloss | max abs Δval_loss | max abs Δgrad_norm "
             "| max rel Δgrad_norm | bitwise |", "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['run']} | {r['world']} | {r['vs']} | {num(r, 'loss_abs')} | {num(r, 'loss_rel')} "
              f"| {num(r, 'val_loss_abs')} | {num(r, 'grad_norm_abs')} | {num(r, 'grad_norm_rel')} "
              f"| {'yes' if r['bitwise'] else 'no'} |" for r in table]
    return "\n".join(lines)


def plot(series: dict[str, list[float]], reference: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: training machines have no display
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(8, 7))
    ref = series[reference]
    steps = range(1, len(ref) + 1)
    for i, (label, losses) in enumerate(series.items()):
        # Bitwise-equal curves lie on top of each other: line style and marker tell them apart;
        # the colour is fixed per run so both panels agree (each panel would cycle on its own).
        style = {"linestyle": ["-", "--", ":", "-."][i % 4], "marker": "os^vD"[i % 5], "markersize": 4,
                 "color": f"C{i % 10}", "label": label}
        top.plot(steps, losses, **style)
        if label != reference:
            bottom.semilogy(steps, [max(abs(a - b), FLOOR) for a, b in zip(losses, ref)], **style)
    top.set(ylabel="loss", title=f"loss per step (reference: {reference})")
    bottom.set(xlabel="step", ylabel=f"|loss - reference|\n(0 plotted at {FLOOR:g})")
    bottom.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
    top.legend()  # one legend serves both panels: each run keeps its colour and style in both
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str]) -> int:
    split = argv.index("--") if "--" in argv else len(argv)
    args = parse(CompareArgs, argv[:split], "plait compare")
    shared = argv[split + 1:]
    shared_cfg, model, tokenizer, runs = plan(args, shared)
    golden = read_golden(args.golden, flat(shared_cfg), args.steps) if args.golden else None
    atol = 0.0 if args.assert_equal else args.atol

    from plait.checkpoint.manifest import read_manifest
    from plait.checkpoint.offline import write_seed_checkpoint

    out, seed = Path(args.out), Path(args.out) / "seed"
    if seed.exists():
        # Only a seed checkpoint is removed (seconds to rewrite), never a folder compare did not make.
        if (read_manifest(seed) or {}).get("kind") != "seed":
            raise ConfigError(f"out: {seed} exists and is not a seed checkpoint; pick another --out")
        shutil.rmtree(seed)
    out.mkdir(parents=True, exist_ok=True)
    # What `plait seed-checkpoint` does, in this process: torch and the tokenizer are loaded already.
    write_seed_checkpoint(shared_cfg, model, seed, tokenizer)
    try:
        with ThreadPoolExecutor(max(1, args.jobs)) as pool:
            results = list(pool.map(lambda i: train(runs[i], seed, out / f"run-{i}.jsonl"), range(len(runs))))
    except RunFailed as e:
        print(f"plait: error: {e}", file=sys.stderr)
        return 1

    reference = runs[0].label
    table = [difference(run, values, reference, results[0]) for run, values in zip(runs[1:], results[1:])]
    series = {run.label: values["loss"] for run, values in zip(runs, results)}
    if golden:
        golden_label = f"golden {Path(args.golden).name}"
        table += [difference(run, values, golden_label, golden) for run, values in zip(runs, results)]
        series[golden_label] = golden["loss"]
    final_val = f", final val_loss {results[0]['val_loss'][-1]:.6f}" if results[0]["val_loss"] else ""
    print(f"reference: {reference}, {args.steps} steps, final loss {results[0]['loss'][-1]:.6f}{final_val}")
    print(markdown(table))
    plot(series, reference, out / "losses.png")
    (out / "losses.json").write_text(json.dumps(
        {"steps": args.steps, "reference": reference, "torch": version("torch"), "table": table,
         "runs": [{"run": run.label, "world": run.world, **values} for run, values in zip(runs, results)]}, indent=1))
    if args.export:
        Path(args.export).parent.mkdir(parents=True, exist_ok=True)
        Path(args.export).write_text(json.dumps({"torch": version("torch"), "run": reference, "config": runs[0].config,
                                                 "shared": flat(shared_cfg), **results[0]}, indent=1))
    failed = [f"{r['run']} vs {r['vs']}: {m} differs by {r[f'{m}_abs']:.1e} at step {r[f'{m}_step']} (atol {atol:g})"
              for r in table for m in METRICS if atol is not None and r.get(f"{m}_abs", 0) > atol]
    for line in failed:
        print(f"compare: FAILED {line}", file=sys.stderr)
    return 1 if failed else 0
