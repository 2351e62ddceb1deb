"""Reading the JSON and JSONL files plait is given, as data from disk: a path that is not a
regular file (a folder, a dangling link, a link to /dev/zero), a file larger than any such file
is, bytes that are not UTF-8 or not JSON: each one line naming the option, never a traceback or a
read without end.

In JSONL a line ends at "\n" only. str.splitlines() also ends lines at U+2028, U+2029, U+0085 and
other characters that a JSON string may hold as they are (json.dumps(..., ensure_ascii=False)
writes them so): a valid file would read as broken lines. Below everything else in plait but
config.py's ConfigError."""

from __future__ import annotations

import json
from pathlib import Path

from plait.config import ConfigError

LIMIT = 1 << 30  # bytes: configs, manifests, indexes and tokenizers are far smaller (Llama 3's tokenizer: 9 MB)


def checked_file(path: Path, option: str) -> Path:
    """`path`, if it is a regular file (through links) of at most LIMIT bytes."""
    if not path.is_file():
        what = "a link to nothing" if path.is_symlink() and not path.exists() else \
            "not a regular file" if path.exists() else "missing"
        raise ConfigError(f"{option}: {path} is {what}")
    if path.stat().st_size > LIMIT:
        raise ConfigError(f"{option}: {path} holds {path.stat().st_size} bytes, more than any file of its kind "
                          f"({LIMIT})")
    return path


def text(path: Path, option: str) -> str:
    try:
        return checked_file(path, option).read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{option}: {path} is not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise ConfigError(f"{option}: {path} is unreadable: {e.strerror}") from None


def document(path: Path, option: str):
    """The JSON value `path` holds."""
    try:
        return json.loads(text(path, option))
    except ValueError as e:
        raise ConfigError(f"{option}: {path} is not JSON: {e}") from None


def object_or_none(path: Path) -> dict | None:
    """The JSON object `path` holds; None where it holds none (missing, damaged, a link to a device):
    for files plait writes itself, whose absence or damage means a save that never completed."""
    try:
        value = document(path, str(path))
    except ConfigError:
        return None
    return value if isinstance(value, dict) else None


def lines(path: Path, option: str, hint: str = "") -> list[tuple[int, str]]:
    """(line number, line) of each line of `path` that is not blank; `hint` follows a refusal."""
    try:
        return [(n, line) for n, line in enumerate(text(path, option).split("\n"), 1) if line.strip()]
    except ConfigError as e:
        raise ConfigError(f"{e}{hint}") from None


def rows(path: Path) -> list:
    """Every value of a JSONL file plait wrote itself (metrics.jsonl and the like)."""
    return [json.loads(line) for _, line in lines(path, str(path))]


def is_int(value) -> bool:
    """A JSON integer (true and false are not)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
