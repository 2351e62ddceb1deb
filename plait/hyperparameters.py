"""What a run from a Hugging Face folder trains with, said at start-up (and on what data).

plait's defaults are the debug job's (a 1.4M-parameter model on the bundled corpus: lr 2e-3, 10
warmup steps, 60 steps of 16 sequences of 128 tokens): right for trying plait, rarely for a real
model, which they would train on without a word. A run that starts from a Hugging Face folder says
the hyper-parameters it uses and, in one line, which of them the user left at those defaults.
"""

from __future__ import annotations

from plait.arguments import given_options
from plait.config import JobConfig
from plait.start_folder import hf_folder

# The options whose defaults were picked for the debug job; the others' (the schedule's shape,
# weight decay, clipping, AdamW's betas) are the usual ones at any size.
DEBUG_CHOICES = ("lr", "warmup_steps", "steps", "seq_len", "global_batch_size")


def schedule(cfg: JobConfig) -> str:
    """The lr schedule in words: 'lr 0.002 (10 warmup steps, then cosine to 0.1x)'."""
    t = cfg.training
    shape = {"cosine": f"cosine to {t.min_lr_ratio:g}x", "constant": "constant",
             "wsd": f"constant, then a {t.decay_shape} decay over the last {t.decay_fraction:g} of the steps to "
                    f"{t.min_lr_ratio:g}x"}[t.lr_schedule]
    return f"lr {t.lr:g} ({t.warmup_steps} warmup steps, then {shape})"


def describe(cfg: JobConfig) -> str:
    t = cfg.training
    return (f"plait: hyper-parameters: {cfg.optimizer.name} {schedule(cfg)}, {t.steps} steps, global batch {t.global_batch_size} sequences (micro {t.micro_batch_size}) "
            f"of seq_len {t.seq_len}, weight_decay {t.weight_decay:g}, max_norm {t.max_norm:g}")


def hf_start_lines(cfg: JobConfig) -> list[str]:
    """For a run from a Hugging Face folder: its hyper-parameters, and a warning naming those the
    user did not set (given_options); nothing for any other run."""
    if hf_folder(cfg) is None:
        return []
    left = left_at_debug_defaults(cfg, DEBUG_CHOICES)
    bundled = [] if cfg.data.path or cfg.data.mix else [
        f"plait: warning: no data.path: {cfg.checkpoint.load} trains on the bundled corpus (Python's documentation, "
        "for trying plait), not on data of its own; give --data.path (a tokenized folder or text)"]
    return [describe(cfg), *([debug_defaults_warning(left, cfg.checkpoint.load)] if left else []), *bundled]


def left_at_debug_defaults(cfg: JobConfig, names: tuple[str, ...]) -> list[str]:
    """`training.NAME value` for each of `names` the user did not set (given_options)."""
    given = given_options(cfg)
    return [f"training.{name} {getattr(cfg.training, name):g}" for name in names if f"training.{name}" not in given]


def debug_defaults_warning(left: list[str], model: str, then: str = "set them for this model (plait train --help)") -> str:
    return (f"plait: warning: left at the debug job's defaults (picked for a 1.4M-parameter model on the bundled "
            f"corpus, not for {model}): {', '.join(left)}; {then}")
