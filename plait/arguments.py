"""Command lines and TOML files into a JobConfig: a TOML file becomes flags, tyro parses them
with the command line's (which win), and tyro's multi-line error boxes become the one line the
README promises: `plait: error: OPTION: what is wrong`, exit code 2."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import io
import json
import os
import re
import tomllib
import typing
from pathlib import Path

import tyro

from plait import jsonl
from plait.config import ConfigError, JobConfig

CONFIG_DIR = Path(__file__).parent / "configs"
RULE = set("─-+╭╮╰╯ ")  # a box's borders and rules, drawn in Unicode on a terminal, in ASCII elsewhere


def sections(cls=JobConfig) -> dict[str, type]:
    """The TOML sections of a config: {name: its dataclass}."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if dataclasses.is_dataclass(hints[f.name])}


def resolve_config_path(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.suffix == ".toml" or path.exists():
        if not path.is_file():
            raise ConfigError(f"config: file {name_or_path!r} not found")
        return path
    named = CONFIG_DIR / f"{name_or_path}.toml"
    if not named.is_file():
        allowed = sorted(p.stem for p in CONFIG_DIR.glob("*.toml"))
        raise ConfigError(f"config: {name_or_path!r} is neither a TOML file nor a named config {allowed}")
    return named


def toml_to_args(path: Path) -> list[str]:
    """Turn a TOML file into `--section.key value` flags so one parser validates both sources."""
    try:
        table = tomllib.loads(jsonl.text(path, "config"))
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config: {path} is not valid TOML: {e}") from None
    job_sections = sections()
    args: list[str] = []
    if "phase" in table:  # [[phase]] tables: training.phases, one KEY=VALUE string each (plait/data/phases.py)
        phases = table.pop("phase")
        if not (isinstance(phases, list) and all(isinstance(p, dict) for p in phases)):
            raise ConfigError(f"config {path}: phase is a list of [[phase]] tables (step = 161, mix = \"hq:1\", ...)")
        args += ["--training.phases", *(" ".join(f"{k}={v}" for k, v in p.items()) for p in phases)]
    for section, values in table.items():
        if section not in job_sections or not isinstance(values, dict):
            raise ConfigError(f"config {path}: unknown section [{section}]; allowed: {sorted(job_sections)}")
        keys = {f.name: f for f in dataclasses.fields(job_sections[section])}
        hints = typing.get_type_hints(job_sections[section])
        for key, value in values.items():
            if key not in keys:
                close = difflib.get_close_matches(key, keys, n=1)
                hint = f"did you mean {section}.{close[0]}? " if close else ""
                raise ConfigError(f"config {path}: unknown option {section}.{key}; {hint}allowed: {sorted(keys)}")
            if (expected := toml_type_error(value, hints[key])) is not None:
                raise ConfigError(f"config {path}: {section}.{key} = {json.dumps(value)}: expected {expected}")
            flag = f"--{section}.{key}"
            if isinstance(value, bool):
                args.append(flag if value else f"--{section}.no_{key}")
            elif isinstance(value, list):
                args += [flag, *map(str, value)]
            else:
                args += [flag, str(value)]
    return args


def toml_type_error(value, hint) -> str | None:
    """What `hint` wants, where the TOML value is not of it (the file and key name the mistake,
    not the flag it becomes); None where it is."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return None if value in args else f"one of {', '.join(json.dumps(a) for a in args)}"
    if origin in (tuple, list):
        return None if isinstance(value, list) and all(toml_type_error(v, args[0]) is None for v in value) else \
            f"a list of {toml_type_error(object(), args[0]).removeprefix('a ').removeprefix('an ')}s"
    wanted = {bool: (bool, "true or false"), int: (int, "an integer"), float: ((int, float), "a number"),
              str: (str, "a string")}
    kinds, name = wanted.get(hint, (object, ""))
    ok = isinstance(value, kinds) and (hint is bool or not isinstance(value, bool))
    return None if ok else name


def flags(cls, prefix: str = "") -> list[str]:
    """Every `--section.key` a dataclass (and the dataclasses nested in it) accepts."""
    hints = typing.get_type_hints(cls)
    names = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            names += flags(hints[f.name], f"{prefix}{f.name}.")
        else:
            names.append(f"--{prefix}{f.name}")
    return names


def parse(cls, argv: list[str], prog: str):
    """tyro.cli(cls) on argv; a parse error becomes one ConfigError line naming the option."""
    stderr = io.StringIO()
    columns = os.environ.get("COLUMNS")
    if not {"-h", "--help"} & set(argv):  # rich wraps error boxes at the terminal's width: one message, one line
        os.environ["COLUMNS"] = "1000"
    try:
        with contextlib.redirect_stderr(stderr):
            return tyro.cli(cls, args=argv, prog=prog, use_underscores=True)
    except SystemExit as e:
        if not e.code:
            raise  # --help
        raise ConfigError(one_line(stderr.getvalue(), cls, prog)) from None
    finally:
        if columns is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = columns


def one_line(box: str, cls, prog: str) -> str:
    """The message of a tyro error box (the lines above its first rule), prefixed by the option."""
    lines = [line.strip().strip("│|").strip() for line in box.splitlines()]
    lines = [line for line in lines if line]
    message = []
    for line in lines[1:]:  # the first is the box's title (in its top border, or a line of its own)
        if set(line) <= RULE:
            if message:
                break
            continue  # the rule under a title line
        message.append(line)
    text = " ".join(message) or " ".join(lines).strip() or "invalid command line"
    unknown = re.match(r"Unrecognized options?: ([^\s,]+)", text)
    if unknown and not unknown.group(1).startswith("--"):
        return (f"arguments: unexpected value {unknown.group(1)!r} (a boolean option takes none: --section.key "
                f"sets it, --section.no_key clears it)")
    if unknown:
        name = unknown.group(1)[2:]
        close = difflib.get_close_matches(f"--{name}", flags(cls), n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]}?" if close else ""
        return f"{name}: unknown option --{name}{hint} ({prog} --help lists every option)"
    choice = re.match(r"invalid choice '(.*)' for argument '--([\w.-]+)'\. Expected one of \((.*)\)\.?$", text)
    if choice:  # one line with the closest allowed names, not a list of thirty
        value, name, allowed = choice.group(1), choice.group(2), re.findall(r"'([^']*)'", choice.group(3))
        close = difflib.get_close_matches(value, allowed, n=3, cutoff=0.5)
        hint = f"; did you mean {' or '.join(close)}?" if close else f"; allowed: {', '.join(allowed)}"
        return f"{name}: {value!r} is not one of its {len(allowed)} choices{hint} ({prog} --help lists them)"
    option = re.search(r"--([\w.-]+)", text)
    return f"{option.group(1) if option else 'arguments'}: {text}"


def parse_args(argv: list[str], prog: str = "plait train", cls=JobConfig, defaults: list[str] = ()) -> JobConfig:
    """Parse a train-style command line into `cls` (JobConfig or a command's extension of it):
    the command's `defaults` first, then `--config`'s values, then the flags."""
    config_args: list[str] = []
    for i, arg in enumerate(argv):
        name = arg.split("=", 1)[1] if arg.startswith("--config=") else (argv[i + 1] if arg == "--config" and i + 1 < len(argv) else None)
        if name is not None:
            config_args = toml_to_args(resolve_config_path(name))
    cfg = parse(cls, [*defaults, *config_args, *argv], prog)
    cfg._given = named_options(cls, [*config_args, *argv])  # (see given_options)
    return cfg


def named_options(cls, argv: list[str]) -> frozenset[str]:
    """The `section.key` of every option in `argv` (`--section.no_key` names section.key)."""
    known = {name[2:] for name in flags(cls)}
    names = set()
    for arg in argv:
        if arg.startswith("--"):
            name = arg[2:].split("=", 1)[0].replace("-", "_")
            section, _, key = name.rpartition(".")
            if name not in known and key.startswith("no_"):
                name = f"{section}.{key[3:]}".lstrip(".")
            names.add(name)
    return frozenset(names)


def given_options(cfg) -> frozenset[str]:
    """The options (`section.key`) a command line or its --config file set, as parse_args
    recorded them; every other option is at its default, or at a command's own (plait doctor's),
    which are not the user's choice either. A config built in code has none."""
    return getattr(cfg, "_given", frozenset())
