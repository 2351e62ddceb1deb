"""The start-up checks of a job's options: config.py's (what the options alone tell), then those
that need a module's knowledge (the precision table, the pipeline's schedules, context parallelism, the attention kernel), each living in
its module. Every rank runs them before any process group exists; `plait train --nproc` runs
them once before it launches, so a mistake prints one line instead of one per rank."""

from __future__ import annotations

from plait.config import JobConfig, validate
from plait.masking import check_attention
from plait.optim import check_optimizer
from plait.parallel.context_parallel import check_context_parallel
from plait.parallel.expert_parallel import check_expert_options
from plait.parallel.pipeline import check_pipeline
from plait.precision import resolve
from plait.schedule import check_schedule


def check_options(cfg: JobConfig, world: int) -> JobConfig:
    """Every option against the others and the device, for `world` ranks; fills in the derived
    defaults (micro_batch_size, dp_shard, ...) as `config.validate` does. ConfigError if wrong."""
    validate(cfg, world)
    check_schedule(cfg)
    check_optimizer(cfg)
    check_context_parallel(cfg)
    check_expert_options(cfg)
    resolve(cfg)
    check_attention(cfg)
    if cfg.parallelism.pp > 1:
        check_pipeline(cfg)
    return cfg
