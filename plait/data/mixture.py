"""A data mixture's sources, read from data.mix."""

from __future__ import annotations

import math
from pathlib import Path

from plait.config import ConfigError


def mix_sources(spec: str) -> list[tuple[str, float]]:
    """data.mix "PATH:WEIGHT,PATH:WEIGHT" -> [(path, weight)]; weights >= 0 with a positive sum."""
    sources = []
    for part in spec.split(","):
        path, _, weight = part.strip().rpartition(":")
        try:
            value = float(weight)
        except ValueError:
            value = math.nan
        if not path or not math.isfinite(value) or value < 0:
            raise ConfigError(f"data.mix: {part.strip()!r} is not PATH:WEIGHT with a finite weight >= 0 "
                              '(e.g. data.mix = "web:0.7,code:0.3")')
        if not Path(path).exists():
            raise ConfigError(f"data.mix: {path!r} does not exist")
        sources.append((path, value))
    if sum(w for _, w in sources) <= 0:
        raise ConfigError(f"data.mix: the weights of {spec!r} sum to 0; at least one must be > 0")
    return sources
