"""config.json's RoPE fields as transformers reads them: rope_theta with rope_scaling (the classic
layout) or rope_parameters (transformers 5's), and in the families whose sliding and full layers
rotate apart (OLMo 3), rope_parameters by layer type; and those fields written back.
"""

from __future__ import annotations

from plait.config import ConfigError
from plait.hf.defaults import ROPE_SCALING
from plait.hf.fields import Fields, family_fields
from plait.jsonl import is_number
from plait.models.args import ModelArgs

ROPE_FIELDS = {"linear": ("factor",),
               "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
               "yarn": ("factor", "original_max_position_embeddings")}
# Fields a scaling type may set and otherwise defaults (plait/models/rope.py has the defaults);
# mscale_all_dim under any type: DeepSeek-V3's softmax scale (`softmax_scale`) takes it from each.
ROPE_OPTIONAL = {"linear": ("mscale_all_dim",), "llama3": ("mscale_all_dim",),
                 "yarn": ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate")}
ROPE_OBJECT = "an object (rope_type and its fields) or null"


# The families whose attention rotates only part of each head, and the share their config class
# gives where config.json says none (GLM-4.5's sets 0.5, the Qwen hybrids' 0.25).
PARTIAL_ROTARY = {"glm4_moe": 0.5, "qwen3_next": 0.25, "qwen3_5_text": 0.25, "qwen3_5_moe_text": 0.25}


def rotary_fraction(config: dict, family: str, where: str) -> float:
    """partial_rotary_factor as transformers reads it: the RoPE object's (rope_scaling, else
    rope_parameters), else the top-level one (which the config class moves into it), else the family's."""
    fields = family_fields(config, family, where)
    name = "rope_scaling" if fields.table("rope_scaling", ROPE_OBJECT) else "rope_parameters"
    rope = Fields(fields.table(name, ROPE_OBJECT) or {}, where, name=name)
    for holder in (rope, fields):
        if holder.has("partial_rotary_factor"):
            factor = holder.typed("partial_rotary_factor", lambda v: is_number(v) and 0 < v <= 1,
                                  "a number in (0, 1]")
            return float(factor)
    return PARTIAL_ROTARY.get(family, 1.0)


def rope_settings(config: dict, family: str, where: str, label: str = "") -> tuple[float, dict | None]:
    """(rope_theta, scaling) as transformers reads them; scaling None, or {"rope_type", its fields}.
    The scaling is rope_scaling's, else rope_parameters' (transformers 5's layout), else, both null or
    left out, the family's default; rope_theta is that object's, else the top-level one, else the family's.
    (`label`: the object's name in refusals, where it is one of rope_parameters' by layer type.)"""
    fields = family_fields(config, family, where)
    name = "rope_scaling" if fields.table("rope_scaling", ROPE_OBJECT) else "rope_parameters"
    scaling = fields.table(name, ROPE_OBJECT)
    if scaling is None:
        scaling, name = dict(ROPE_SCALING.get(family, {})), "rope_scaling"
    rope = Fields(scaling, where, nullable={f for kind in ROPE_OPTIONAL.values() for f in kind},
                  name=label or name)
    theta = rope.number("rope_theta") if rope.has("rope_theta") else fields.number("rope_theta")
    kind = rope.text("rope_type" if rope.has("rope_type") else "type") or "default"
    for holder in (rope, fields) if family not in PARTIAL_ROTARY else ():  # (`rotary_fraction` reads it there)
        if holder.has("partial_rotary_factor") and holder.number("partial_rotary_factor") != 1.0:
            raise ConfigError(f"{where}: partial_rotary_factor {holder.config['partial_rotary_factor']}: {family}'s "
                              "model rotates every pair of a head; allowed: 1.0")
    if kind == "default":
        return theta, None
    if kind not in ROPE_FIELDS:
        rope.refuse("rope_type" if rope.has("rope_type") else "type", f"default, {', '.join(ROPE_FIELDS)} (the RoPE "
                    "scalings plait implements)")
    missing = [f for f in ROPE_FIELDS[kind] if not rope.has(f)]
    if missing:
        raise ConfigError(f"{where}: RoPE scaling '{kind}' lacks {', '.join(missing)}")
    numbers = {f: rope.typed(f, is_number, "a number") for f in (*ROPE_FIELDS[kind], *ROPE_OPTIONAL.get(kind, ()))
               if f != "truncate"}
    # A null optional field is left out, as transformers reads it; but truncate, which it reads as
    # .get("truncate", True): null is false.
    optional = {"truncate": bool(rope.flag("truncate"))} if kind == "yarn" and rope.has("truncate") else {}
    return theta, {"rope_type": kind, **{f: v for f, v in numbers.items() if v is not None}, **optional}


# The families whose rope_parameters hold an object per layer type (transformers 5 writes no other
# layout for them): where their config class takes the sliding layers' base when their object has
# none (a field of config.json, and its default). (OLMo 3's class hands a top-level rope_theta to
# the full layers alone: the sliding ones keep 5e5.)
LAYERED = {"olmo3": (None, 500000.0), "gemma3_text": ("rope_local_base_freq", 10000.0)}
LAYER_TYPES = "an object of full_attention and sliding_attention objects, or null"


def layered_rope_settings(config: dict, family: str, where: str) -> tuple[tuple[float, dict | None], ...]:
    """The full and the sliding layers' (rope_theta, scaling), as the family's config class reads
    them: rope_parameters' full_attention object with rope_scaling written over it, its base, else the
    top-level rope_theta, else the family's; its sliding_attention object, its base, else LAYERED's."""
    fields = family_fields(config, family, where)
    layered = fields.table("rope_parameters", LAYER_TYPES) or {}
    if not set(layered) <= {"full_attention", "sliding_attention"}:
        fields.refuse("rope_parameters", LAYER_TYPES, f" (transformers' layout for {family})")
    by_type = Fields(layered, where, name="rope_parameters")
    full = (by_type.table("full_attention", ROPE_OBJECT) or {}) | (fields.table("rope_scaling", ROPE_OBJECT) or {})
    sliding = by_type.table("sliding_attention", ROPE_OBJECT) or {}
    # transformers' YaRN reads `truncate` from rope_parameters itself, which in this layout holds
    # none: every layer type's ramp is truncated, whatever its object says
    full, sliding = ({k: v for k, v in rope.items() if k != "truncate"} for rope in (full, sliding))
    rest = {k: v for k, v in config.items() if k not in ("rope_scaling", "rope_parameters", "rope_theta")}
    top = {"rope_theta": config["rope_theta"]} if "rope_theta" in config else {}
    local_field, local_base = LAYERED[family]
    if local_field and fields.has(local_field):
        local_base = fields.number(local_field)
    return (rope_settings(rest | top | {"rope_parameters": full}, family, where, "rope_parameters.full_attention"),
            rope_settings(rest | {"rope_theta": local_base, "rope_parameters": sliding}, family, where,
                          "rope_parameters.sliding_attention"))


def rope_fields(args: ModelArgs) -> dict:
    """config.json's RoPE fields for `args`, in the classic layout (transformers 4 and 5 read it),
    or by layer type where the family rotates its sliding layers apart."""
    if args.family in LAYERED:
        local = (args.local_rope_theta, args.local_rope_scaling) if args.local_rope_theta else \
            (args.rope_theta, args.rope_scaling)
        if any((scaling or {}).get("truncate") is False for scaling in (args.rope_scaling, local[1])):
            raise ConfigError(f"checkpoint: a {args.family} config.json's YaRN is truncated in every block "
                              "(transformers reads no truncate by layer type); this model's is not")
        by_type = {"full_attention": rope_object(args.rope_theta, args.rope_scaling),
                   "sliding_attention": rope_object(*local)}
        return {"rope_theta": args.rope_theta, "rope_scaling": None, "rope_parameters": by_type}
    if args.local_rope_theta:
        raise ConfigError(f"checkpoint: a {args.family} config.json has one RoPE for every block; this model's sliding "
                          f"blocks rotate by their own (export it as {', '.join(LAYERED)})")
    # (null would read as the family's default scaling: gpt-oss's YaRN)
    return {"rope_theta": args.rope_theta,
            "rope_scaling": args.rope_scaling or ({"rope_type": "default"} if args.family in ROPE_SCALING else None)}


def rope_object(theta: float, scaling: dict | None) -> dict:
    return {"rope_type": "default", **(scaling or {}), "rope_theta": theta}
