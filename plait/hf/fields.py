"""config.json's fields, typed, as transformers reads them: the one reader every family's config
goes through. A field left out is the family's default (plait/hf/defaults.py). A field set to null
is None where the family's transformers config class takes null (NULLABLE: the caller derives it or
turns it off, as that class does), and refused elsewhere: transformers' config classes refuse it
there, or its model fails on it. A value of the wrong type is refused. Each refusal is one line that
names the field and what it may be: a folder's config is data from disk, never a traceback.
"""

from __future__ import annotations

import json

from plait.config import ConfigError
from plait.hf.defaults import DEFAULTS, NULLABLE, READ
from plait.jsonl import is_int, is_number


class Fields:
    """The fields of `config` (config.json, or one of its objects, `name` then naming it in refusals):
    their defaults `defaults`, the fields whose null means unset `nullable`, and where `known` is
    given, the only fields with a default (a field read past it would take no family's default)."""

    def __init__(self, config: dict, where: str, defaults: dict | None = None, nullable=(), name: str = "",
                 known: tuple[str, ...] | None = None):
        self.config, self.where, self.defaults, self.nullable = config, where, defaults or {}, set(nullable)
        self.prefix, self.known = f"{name}." if name else "", known

    def has(self, field: str) -> bool:
        return field in self.config

    def refuse(self, field: str, allowed: str, why: str = ""):
        value = json.dumps(self.config.get(field))
        raise ConfigError(f"{self.where} sets {self.prefix}{field} {value}{why}; allowed: {allowed}")

    def typed(self, field: str, fits, allowed: str, required: bool = False):
        """`field`'s value if `fits` it; left out, the default (or 'lacks', where `required`);
        null, None where nullable; anything else refused."""
        if field not in self.config:
            if required:
                raise ConfigError(f"{self.where} lacks {self.prefix}{field}")
            assert self.known is None or field in self.known, field
            return self.defaults.get(field)
        value = self.config[field]
        if value is None and field in self.nullable:
            return None
        if value is None or not fits(value):
            self.refuse(field, allowed)
        return value

    def integer(self, field: str, minimum: int = 1, required: bool = False) -> int | None:
        # (a size past 2^40 is no model any machine holds: refused, not handed to torch to overflow)
        return self.typed(field, lambda v: is_int(v) and minimum <= v < 1 << 40, f"an integer >= {minimum} (and < 2^40)",
                          required)

    def number(self, field: str, required: bool = False) -> float | None:
        value = self.typed(field, is_number, "a number", required)
        return None if value is None else float(value)

    def flag(self, field: str) -> bool | None:
        return self.typed(field, lambda v: isinstance(v, bool), "true or false")

    def text(self, field: str, allowed: str = "a string") -> str | None:
        return self.typed(field, lambda v: isinstance(v, str), allowed)

    def table(self, field: str, allowed: str = "an object or null") -> dict | None:
        """A JSON object; null: None, as left out (no default)."""
        if self.config.get(field) is None:
            return None
        return self.typed(field, lambda v: isinstance(v, dict), allowed)

    def integers(self, field: str, length: int | None = None) -> list[int] | None:
        """A list of integers (of `length` of them, where given)."""
        return self.typed(field, lambda v: isinstance(v, list) and len(v) == (length or len(v)) and
                          all(map(is_int, v)), f"a list of {length} integers" if length else "a list of integers")

    def texts(self, field: str, length: int) -> list[str] | None:
        return self.typed(field, lambda v: isinstance(v, list) and len(v) == length and
                          all(isinstance(x, str) for x in v), f"a list of {length} strings")


def family_fields(config: dict, family: str, where: str) -> Fields:
    """config.json's fields for `family`: its transformers defaults, and its nulls that mean unset."""
    return Fields(config, where, DEFAULTS[family], NULLABLE[family], known=READ)
