"""A data mixture's sources, read from data.mix."""

from __future__ import annotations

import math
from pathlib import Path

from plait.config import ConfigError
from plait.data.shards import is_tokenized

RAW_NEEDS_TOKENIZER = "data.mix: raw-text sources need data.tokenizer (or tokenize them first: plait tokenize)"


def mix_sources(spec: str, option: str = "data.mix") -> list[tuple[str, float]]:
    """data.mix "PATH:WEIGHT,PATH:WEIGHT" -> [(path, weight)]; weights >= 0 with a positive sum.
    `option`: what the messages name (a phase's mix is one too)."""
    sources = []
    for part in spec.split(","):
        path, _, weight = part.strip().rpartition(":")
        try:
            value = float(weight)
        except ValueError:
            value = math.nan
        if not path or not math.isfinite(value) or value < 0:
            raise ConfigError(f"{option}: {part.strip()!r} is not PATH:WEIGHT with a finite weight >= 0 "
                              '(e.g. data.mix = "web:0.7,code:0.3")')
        if not Path(path).exists():
            raise ConfigError(f"{option}: {path!r} does not exist")
        sources.append((path, value))
    if sum(w for _, w in sources) <= 0:
        raise ConfigError(f"{option}: the weights of {spec!r} sum to 0; at least one must be > 0")
    return sources


def check_mix(spec: str, tokenizer: str) -> None:
    """The mixture read, and a tokenizer it can use: data.tokenizer or a tokenized source's (raw
    sources cannot each train their own BPE). At start-up: before any rank starts."""
    if not tokenizer and not any(is_tokenized(path) for path, _ in mix_sources(spec)):
        raise ConfigError(RAW_NEEDS_TOKENIZER)
