"""Reading JSONL files: one JSON value a line, and a line ends at "\n" only. str.splitlines()
also ends lines at U+2028, U+2029, U+0085 and other characters that a JSON string may hold as
they are (json.dumps(..., ensure_ascii=False) writes them so): a valid file would read as broken
lines. Below everything else in plait: it imports nothing of it."""

from __future__ import annotations

import json
from pathlib import Path


def lines(path: Path) -> list[tuple[int, str]]:
    """(line number, line) of each line of `path` that is not blank."""
    return [(n, line) for n, line in enumerate(path.read_text(encoding="utf-8").split("\n"), 1) if line.strip()]


def rows(path: Path) -> list:
    """Every value of a JSONL file plait wrote itself (metrics.jsonl and the like)."""
    return [json.loads(line) for _, line in lines(path)]
