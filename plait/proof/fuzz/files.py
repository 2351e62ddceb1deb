"""The files plait reads, mutated: a Hugging Face folder (config.json, the safetensors index,
tokenizer.json), a plait checkpoint (plait.json, DCP's .metadata), an eval task JSONL, a metrics
JSONL for `plait plot`, a TOML config, a tokenized folder (manifest.json, its shards) and a JSONL
corpus. Each mutation is one of: the file truncated, a JSON value made null, of another type,
huge, a text with Unicode line separators, a path leaving the folder, a key dropped, or the file
replaced by a dangling link, a folder, or a link to /dev/zero.

Property: the command that reads the file (as a user runs it) either gives the unmutated file's
output, or stops with exit code 2 and one line `plait: error: ...`; never a traceback, never a
read of a file outside the folder (an audit hook watches every open), never a hang (an alarm), never
unbounded memory (an address-space limit).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import resource
import shutil
import signal
import sys
import tempfile
import tomllib
import traceback
from functools import cache
from pathlib import Path

from hypothesis import strategies as st

from plait.proof.fuzz import Counterexample, scratch_folder, Generator

SECONDS = 60  # a command reading one small file that runs longer is hanging
HEADROOM = 4 << 30  # bytes of address space a command may add: a tiny model's files need far less
SEPARATORS = "a\u2028b\u0085c\u2029d\x0be"
OUTSIDE = "outside"  # the folder beside the input that no command may read from


@cache
def template() -> Path:
    """The unmutated inputs, made once per process: a plait checkpoint of the debug model, its
    export as a sharded Hugging Face folder, a tokenized folder, and the small files."""
    import torch

    from plait.cli import main
    from plait.checkpoint.offline import load_full_state_dict
    from plait.hf.weights import write_weights
    from plait.checkpoint.manifest import read_manifest, manifest_model

    root = scratch_folder("plait-fuzz-files-")
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        corpus = root / "corpus.jsonl"
        corpus.write_text("".join(json.dumps({"text": f"document {i}: plait trains models " * 4}) + "\n"
                                  for i in range(40)))
        assert main(["seed-checkpoint", "--data.path", str(corpus), "--data.vocab_size", "300",
                     "--out", str(root / "ckpt")]) == 0
        assert main(["export", "--checkpoint", str(root / "ckpt"), "--out", str(root / "hf")]) == 0
        args = manifest_model(read_manifest(root / "ckpt"), root / "ckpt", "checkpoint")
        (root / "hf" / "model.safetensors").unlink()  # sharded: the index is read too
        write_weights(load_full_state_dict(root / "ckpt", args, "checkpoint"), args, root / "hf", torch.float32,
                      1 << 16)
        assert main(["tokenize", "--data.path", str(corpus), "--data.tokenizer",
                     str(root / "ckpt" / "tokenizer.json"), "--out", str(root / "tokens"), "--workers", "1"]) == 0
    (root / "tasks.jsonl").write_text("".join(json.dumps(
        {"context": f"Question {i}: plait", "choices": [" trains", " sleeps"], "gold": 0}) + "\n" for i in range(3)))
    (root / "metrics.jsonl").write_text("".join(json.dumps(
        {"step": s, "loss": 5.0 - s / 10, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1000.0}) + "\n"
        for s in range(1, 6)))
    shutil.copy(Path(__file__).parents[2] / "configs" / "debug.toml", root / "job.toml")
    return root


def generate(folder: str) -> list[str]:
    return ["generate", "--checkpoint", folder, "--prompt", "plait trains", "--max_new_tokens", "3",
            "--temperature", "0", "--ids"]


# file -> (the folder (under the base) it lives in, the command that reads it, given that folder)
TARGETS = {
    "hf/config.json": ("hf", generate),
    "hf/model.safetensors.index.json": ("hf", generate),
    "hf/tokenizer.json": ("hf", generate),
    "ckpt/plait.json": ("ckpt", generate),
    "ckpt/.metadata": ("ckpt", generate),
    "ckpt/tokenizer.json": ("ckpt", generate),
    "tasks.jsonl": ("tasks.jsonl", lambda f: ["eval", "--checkpoint", "{base}/ckpt", "--tasks", f]),
    "metrics.jsonl": ("metrics.jsonl", lambda f: ["plot", f, "--out", "{base}/plot.png"]),
    "job.toml": ("job.toml", lambda f: ["plan", "--config", f, "--world", "2", "--device_memory_gib", "80"]),
    "tokens/manifest.json": ("tokens", lambda f: ["seed-checkpoint", "--data.path", f, "--out", "{base}/seed"]),
    "corpus.jsonl": ("corpus.jsonl", lambda f: ["seed-checkpoint", "--data.path", f, "--data.vocab_size", "300",
                                                "--out", "{base}/seed"]),
}


def json_paths(value, prefix=()) -> list[tuple]:
    """Every value's path in a JSON document (long lists: their first entries)."""
    paths = [prefix]
    if isinstance(value, dict):
        for k, v in list(value.items())[:64]:
            paths += json_paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value[:4]):
            paths += json_paths(v, (*prefix, i))
    return paths


@cache
def target_paths(target: str) -> list[tuple]:
    text = (template() / target).read_text(errors="replace") if target != "ckpt/.metadata" else ""
    if target.endswith(".json"):
        return json_paths(json.loads(text))[1:]
    if target.endswith(".jsonl"):
        return [(n, *p) for n, line in enumerate(text.splitlines()[:3]) for p in json_paths(json.loads(line))[1:]]
    if target.endswith(".toml"):
        return json_paths(tomllib.loads(text))[1:]
    return []


def values(target: str) -> st.SearchStrategy:
    escape = st.sampled_from([f"../{OUTSIDE}/{Path(target).name}", f"{{outside}}/{Path(target).name}"])
    return st.one_of(st.none(), st.sampled_from(["x", "", [], {}, True, 0, -1, 1e308, 10 ** 40, 0.5]),
                     st.just(SEPARATORS), escape, st.just("DROP"))


@st.composite
def mutations(draw) -> tuple:
    """(target file, mutation): ("truncate", n) | ("value", path, new value) | ("file", kind)."""
    target = draw(st.sampled_from(sorted(TARGETS)))
    paths = target_paths(target)
    kinds = ["truncate", "file"] + (["value"] if paths else [])
    kind = draw(st.sampled_from(kinds))
    if kind == "truncate":
        return target, ("truncate", draw(st.floats(0, 0.999)))
    if kind == "file":
        return target, ("file", draw(st.sampled_from(["dangling link", "folder", "/dev/zero", "empty",
                                                      "binary", "separators"])))
    return target, ("value", draw(st.sampled_from(paths)), draw(values(target)))


def mutate(root: Path, target: str, mutation: tuple):
    """Apply `mutation` to the target file under `root`; the value it replaced (a value mutation)."""
    path = root / target
    kind = mutation[0]
    if kind == "truncate":
        data = path.read_bytes()
        path.write_bytes(data[:int(len(data) * mutation[1])])
    elif kind == "file":
        what = mutation[1]
        path.unlink()
        if what == "dangling link":
            path.symlink_to(root / "nowhere")
        elif what == "folder":
            path.mkdir()
        elif what == "/dev/zero":
            path.symlink_to("/dev/zero")
        else:
            path.write_bytes({"empty": b"", "binary": bytes(range(256)) * 4,
                              "separators": SEPARATORS.encode()}[what])
    else:
        _, where, value = mutation
        if isinstance(value, str):
            value = value.replace("{outside}", str(root / OUTSIDE))
        text = path.read_text()
        if target.endswith(".jsonl"):
            lines = text.splitlines()
            line = json.loads(lines[where[0]])
            old = at(line, where[1:])
            lines[where[0]] = json.dumps(replaced(line, where[1:], value), ensure_ascii=False)
            path.write_text("\n".join(lines) + "\n")
            return old
        document = (tomllib.loads if target.endswith(".toml") else json.loads)(text)
        old = at(document, where)
        new = replaced(document, where, "DROP" if value is None and target.endswith(".toml") else value)  # (no null)
        path.write_text(toml(new) if target.endswith(".toml") else json.dumps(new, ensure_ascii=False))
        return old


def at(document, where: tuple):
    for key in where:
        document = document[key]
    return document


def replaced(document, where: tuple, value):
    if not where:
        return value
    head, rest = where[0], where[1:]
    if not rest and value == "DROP":  # (a key of an object, an entry of a list)
        document.pop(head)
        return document
    document[head] = replaced(document[head], rest, value)
    return document


def toml(table: dict) -> str:
    """A TOML file of sections of scalars (what a plait config is); other values as JSON text."""
    lines = []
    for section, values in table.items():
        if not isinstance(values, dict):
            lines.append(f"{section} = {json.dumps(values)}")
            continue
        lines.append(f"[{section}]")
        lines += [f"{k} = {'true' if v is True else 'false' if v is False else json.dumps(v)}" for k, v in
                  values.items() if v is not None]
    return "\n".join(lines) + "\n"


def run_command(root: Path, target: str) -> tuple[int, str, str, list[str]]:
    """(exit code, stdout, stderr, paths opened under the outside folder) of the target's command."""
    from plait.cli import main

    where, command = TARGETS[target]
    argv = [a.replace("{base}", str(root)) for a in command(str(root / where))]
    opened: list[str] = []
    outside = str(root / OUTSIDE)

    def watch(event, args):
        if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
            real = os.path.realpath(os.fsdecode(args[0]))
            if real.startswith(outside):
                opened.append(real)

    out, err = io.StringIO(), io.StringIO()
    with bounded(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        WATCHERS.append(watch)
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
        finally:
            WATCHERS.remove(watch)
    return code, out.getvalue().replace(str(root), "ROOT"), err.getvalue(), opened


WATCHERS: list = []  # (an audit hook cannot be removed: one hook calls whichever watchers are on)


@cache
def _install_hook() -> None:
    sys.addaudithook(lambda event, args: [w(event, args) for w in WATCHERS])


@contextlib.contextmanager
def bounded():
    """An alarm at SECONDS and an address-space limit HEADROOM above today's."""
    def hang(*_):
        raise TimeoutError(f"the command ran past {SECONDS} s")

    previous = signal.signal(signal.SIGALRM, hang)
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    used = int(Path("/proc/self/statm").read_text().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (used + HEADROOM, hard))
    signal.alarm(SECONDS)
    try:
        yield
    finally:
        signal.alarm(0)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        signal.signal(signal.SIGALRM, previous)


@cache
def unmutated(target: str) -> tuple[int, str]:
    with tempfile.TemporaryDirectory() as tmp:
        root = copy(Path(tmp))
        code, out, err, _ = run_command(root, target)
        assert code == 0, f"the unmutated {target} fails: {err}"
        return code, out


def legal_change(old, new) -> bool:
    """A value of the same kind (a number for a number, a text for a text), or a setting left out:
    a file saying something else, not a broken one."""
    number = (int, float)
    return new == "DROP" and isinstance(old, (dict, int, float, str)) or (isinstance(old, bool) == isinstance(new, bool) and isinstance(old, number) and isinstance(new, number)
            ) or (type(old) is type(new) and not isinstance(old, (dict, list)))


def says_less(path: Path) -> bool:
    """A truncated TOML or JSONL file that is still one (shorter: it says less, and is not broken)."""
    try:
        if path.suffix == ".toml":
            tomllib.loads(path.read_text())
            return True
        return path.suffix == ".jsonl" and all(json.loads(line) is not None for line in
                                               path.read_text().split("\n") if line.strip())
    except ValueError:
        return False


def copy(tmp: Path) -> Path:
    root = tmp / "in"
    shutil.copytree(template(), root, symlinks=True)
    shutil.copytree(template(), root / OUTSIDE, symlinks=True)  # (what an escaping path would find)
    return root


def check(case: tuple) -> str:
    _install_hook()
    target, mutation = case
    expected = unmutated(target)
    with tempfile.TemporaryDirectory() as tmp:
        root = copy(Path(tmp))
        try:
            old = mutate(root, target, mutation)
        except (KeyError, IndexError, TypeError):
            return "skipped: not a mutation of this file"
        described = f"{target} {mutation!r}"
        try:
            code, out, err, opened = run_command(root, target)
        except Exception as e:  # noqa: BLE001 (a traceback is the failure being looked for)
            raise Counterexample(f"{type(e).__name__}: {e} ({described})\n{traceback.format_exc()}") from None
        if opened:
            raise Counterexample(f"read outside the folder: {opened} ({described})")
        if code == 1 and "plan: fits nowhere" in out:  # (plan's answer that no layout fits: exit code 1)
            code = 0
        if code == 0 and (code, out) == expected:
            return "same output"
        # (plait reads a tokenizer.json through the tokenizers library: one it accepts is another tokenizer)
        dropped = mutation[0] == "value" and mutation[2] is None and target.endswith(".toml")
        if code == 0 and mutation[0] == "value" and (legal_change(old, mutation[2]) or dropped or
                                                     target.endswith("tokenizer.json")):
            return "other output (another legal value)"
        if code == 0 and mutation[0] in ("truncate", "file") and says_less(root / target):
            return "other output (a file that says less)"
        if code == 0:
            raise Counterexample(f"accepted and different: {out[-500:]!r} vs {expected[1][-500:]!r} ({described})")
        lines = err.strip().splitlines()
        if code != 2 or len(lines) != 1 or not lines[0].startswith("plait: error: "):
            raise Counterexample(f"exit code {code}, stderr {err.strip()[-2000:]!r} ({described})")
    return "refused"


# The cases this generator once failed on (each fixed with it), run first every time.
PINNED = [
    ("hf/model.safetensors.index.json", ("value", ("weight_map", "model.embed_tokens.weight"), SEPARATORS)),
    ("ckpt/plait.json", ("value", ("model_args", "n_layers"), None)),  # TypeError
    ("ckpt/plait.json", ("value", ("model_args", "dim"), None)),
    ("ckpt/plait.json", ("value", ("format",), None)),
    ("ckpt/plait.json", ("value", ("model_args", "dim"), "DROP")),  # TypeError: a required field
    ("ckpt/plait.json", ("file", "binary")),  # UnicodeDecodeError
    ("ckpt/plait.json", ("file", "/dev/zero")),  # MemoryError: a read without end
    ("hf/tokenizer.json", ("truncate", 0.0)),  # the tokenizers library's bare Exception
    ("metrics.jsonl", ("value", (0, "loss"), {})),
    ("metrics.jsonl", ("value", (0, "loss"), [])),
    ("job.toml", ("file", "binary")),
    ("corpus.jsonl", ("file", "/dev/zero")),
    ("hf/config.json", ("value", ("hidden_size",), 10 ** 40)),  # torch's overflow (TypeError)
    ("hf/config.json", ("value", ("num_key_value_heads",), None)),  # k_proj's shape: a RuntimeError in copy_
    ("job.toml", ("value", ("training", "global_batch_size"), 10 ** 40)),  # plan searched its divisors: a hang
    ("job.toml", ("value", ("training", "seq_len"), 10 ** 40)),
    ("hf/tokenizer.json", ("truncate", 0.5)),  # the tokenizers library panics (a BaseException) on some
]
GENERATOR = Generator(mutations(), check, PINNED)
