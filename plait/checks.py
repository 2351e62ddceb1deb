"""The start-up checks of a job's options: `validate` (what the options alone tell: choices,
degrees, batch arithmetic, files), then those that need a module's knowledge (the precision
table, the pipeline's schedules, context parallelism, the attention kernel), each living in its
module. Every rank runs them before any process group exists; `plait train --nproc` runs
them once before it launches, so a mistake prints one line instead of one per rank."""

from __future__ import annotations

import math
import os

from plait import storage
from plait.checkpoint.manifest import checkpoint_in
from plait.config import ConfigError, JobConfig, dp_degree
from plait.data.batch_schedule import check_growth
from plait.data.mixture import check_mix
from plait.data.shards import is_tokenized
from plait.models.masking import check_attention
from plait.optim.optimizers import check_optimizer
from plait.parallel.context_parallel import check_context_parallel
from plait.parallel.data_parallel import check_offload
from plait.parallel.replica_groups import check_fault_tolerance
from plait.parallel.expert_parallel import check_expert_options
from plait.parallel.stages import check_pipeline, microbatches
from plait.float8 import check_tokens
from plait.precision import resolve
from plait.start_folder import job_tokenizer, start_folder
from plait.optim.schedule import check_schedule
from plait.metrics.wandb_log import check_wandb


# Upper limits past anything a run trains (2^24 tokens a sequence, 2^24 sequences a batch): a value
# beyond is a typo, and would overflow a tensor's size or search a plan without end.
LIMITS = {"steps": 1 << 40, "global_batch_size": 1 << 24, "seq_len": 1 << 24}


def check_sizes(cfg: JobConfig) -> None:
    for name, most in LIMITS.items():
        if not 1 <= getattr(cfg.training, name) <= most:
            raise ConfigError(f"training.{name}: must be from 1 to {most:,}, got {getattr(cfg.training, name)}")


def check_options(cfg: JobConfig, world: int) -> JobConfig:
    """Every option against the others and the device, for `world` ranks; fills in the derived
    defaults (micro_batch_size, dp_shard, ...) as `validate` does. ConfigError if wrong."""
    check_fault_tolerance(cfg)  # (first: validate divides the batch by the groups)
    validate(cfg, world)
    check_growth(cfg)
    check_schedule(cfg)
    check_optimizer(cfg)
    check_context_parallel(cfg)
    check_expert_options(cfg)
    check_offload(cfg)
    resolve(cfg)
    check_attention(cfg)
    check_wandb(cfg)
    if cfg.parallelism.pp > 1:
        check_pipeline(cfg)
    p, t = cfg.parallelism, cfg.training
    sequences = t.micro_batch_size // (microbatches(cfg) if p.pp > 1 else 1)
    check_tokens(cfg, sequences * t.seq_len // p.cp)  # (the tokens of one micro-batch's matmuls on a rank)
    return cfg


def check_model(cfg: JobConfig) -> None:
    """The options against the job's model (TP's and CP's head splits, experts for ep, layers
    float8 can run), from options and files alone: what the launcher checks before it starts a
    rank, so a job that every rank would refuse is one line instead of a rank per line."""
    from plait import float8
    from plait.hardware import pick_device
    from plait.job_model import model_shape
    from plait.parallel.context_parallel import check_heads
    from plait.parallel.expert_parallel import check_experts
    from plait.parallel.tensor_parallel import check_divisibility

    args = model_shape(cfg)
    check_divisibility(args, cfg)
    check_heads(args, cfg)
    check_experts(args, cfg)
    float8.check_layers(args, cfg, pick_device(cfg.training.device), resolve(cfg).compute)


def validate(cfg: JobConfig, world: int) -> JobConfig:
    """Check what the options alone can tell, without a process group; fill in derived defaults.
    (`check_options` runs this, then the checks that need a module's knowledge.)

    Runs identically on every rank, so every rank raises the same error before any collective.
    """
    p, t = cfg.parallelism, cfg.training
    if cfg.checkpoint.load:  # a job folder means its newest checkpoint, whose model the run is (plait/job_model.py)
        launcher = "RANK" not in os.environ and world > 1  # (its ranks say it; once is enough)
        load = storage.location(cfg.checkpoint.load, "checkpoint.load")
        cfg.checkpoint.load = str(checkpoint_in(load, "checkpoint.load", say=not launcher))
    if cfg.model.flavor == "auto" and start_folder(cfg) is None:
        cfg.model.flavor = "debug"
    cfg.data.tokenizer = job_tokenizer(cfg)
    for name in ("dp_replicate", "tp", "pp", "cp", "ep"):
        if getattr(p, name) < 1:
            raise ConfigError(f"parallelism.{name}: must be >= 1, got {getattr(p, name)}")
    if cfg.model.max_seq_len < 0:
        raise ConfigError(f"model.max_seq_len: must be >= 0 (0 = the flavor's), got {cfg.model.max_seq_len}")
    if cfg.model.mtp_layers not in (-1, 0, 1):
        raise ConfigError(f"model.mtp_layers: {cfg.model.mtp_layers}; allowed: -1 (the flavor's or the folder's), 0 "
                          "or 1 (DeepSeek-V3's one module)")
    if cfg.model.sliding_window < 0:
        raise ConfigError(f"model.sliding_window: must be >= 0 (0 = the flavor's), got {cfg.model.sliding_window}")
    if cfg.model.full_layers and not cfg.model.sliding_window:
        raise ConfigError("model.full_layers: names the blocks a model.sliding_window leaves out; set "
                          "model.sliding_window too")
    if cfg.model.n_layers < 0:
        raise ConfigError(f"model.n_layers: must be >= 0 (0 = the flavor's), got {cfg.model.n_layers}")
    if cfg.activation_checkpoint.every < 1:
        raise ConfigError(f"activation_checkpoint.every: must be >= 1, got {cfg.activation_checkpoint.every}")
    if cfg.activation_checkpoint.mode == "full" and p.dp_backend == "simple_fsdp" and cfg.compile.enable:
        raise ConfigError("activation_checkpoint.mode: full under simple_fsdp with compile.enable fails in torch 2.13's "
                          "partitioner (it tries to save the device mesh); allowed there: none or selective (what "
                          "SimpleFSDP's resharding does anyway), or full without compile.enable")
    others = p.dp_replicate * p.cp * p.tp * p.pp
    if p.dp_shard == -1:
        if world % others:
            raise ConfigError(f"parallelism: dp_replicate*cp*tp*pp = {others} does not divide the world size {world}")
        p.dp_shard = world // others
    elif p.dp_shard < 1:
        raise ConfigError(f"parallelism.dp_shard: must be -1 or >= 1, got {p.dp_shard}")
    if others * p.dp_shard != world:
        raise ConfigError(
            f"parallelism: dp_replicate({p.dp_replicate}) x dp_shard({p.dp_shard}) x cp({p.cp}) x tp({p.tp}) x "
            f"pp({p.pp}) = {others * p.dp_shard} must equal the world size {world}")
    if p.dp_backend == "ddp" and p.dp_shard != 1:
        raise ConfigError(f"parallelism.dp_backend: ddp replicates, it cannot shard (dp_shard={p.dp_shard}); "
                          "use dp_replicate alone, or dp_backend fsdp2 for FSDP2/HSDP")
    if p.dp_backend == "ddp" and p.tp > 1:
        raise ConfigError("parallelism.dp_backend: ddp cannot wrap tensor-parallel (DTensor) parameters; "
                          "use dp_backend fsdp2, where DDP+TP is fully_shard on the replicate dimension x tp")
    if cfg.compile.autograd and p.dp_backend != "ddp":
        raise ConfigError("compile.autograd: compiled autograd silently stops FSDP2's gradient reduction after step 0 "
                          "(torch 2.13); allowed only with --parallelism.dp_backend ddp")
    if cfg.compile.report and not cfg.compile.enable:
        raise ConfigError("compile.report: reports what torch.compile did; set compile.enable too")
    if cfg.debug.dtype_probe and cfg.compile.enable:
        raise ConfigError("debug.dtype_probe: the probe records eager ops, and torch.compile cannot trace under it; "
                          "drop --compile.enable to probe")
    if cfg.training.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("training.device: cuda was asked for but no CUDA device is available; allowed: auto, cpu")
    check_sizes(cfg)
    for name in ("lr", "max_norm", "weight_decay"):
        if not math.isfinite(getattr(t, name)):  # NaN passes every comparison below
            raise ConfigError(f"training.{name}: must be a finite number, got {getattr(t, name)}")
    for name in ("moe_aux_loss_coef", "moe_sequence_aux_coef", "mtp_loss_weight", "moe_bias_rate", "z_loss"):
        if not (math.isfinite(getattr(t, name)) and getattr(t, name) >= 0):
            raise ConfigError(f"training.{name}: must be a finite number >= 0, got {getattr(t, name)}")
    if not 0 <= t.ema < 1:
        raise ConfigError(f"training.ema: {t.ema}; allowed: a decay in [0, 1), e.g. 0.999 (0 = no average)")
    if t.ema and cfg.fault_tolerance.enable:
        raise ConfigError("training.ema: not with fault_tolerance.enable (a healing replica group receives the "
                          "weights, not their average)")
    if not (math.isfinite(t.spike_threshold) and t.spike_threshold > 0):
        raise ConfigError(f"training.spike_threshold: must be a finite number > 0, got {t.spike_threshold}")
    if t.spike_policy == "rollback" and not (cfg.checkpoint.folder and cfg.checkpoint.interval):
        raise ConfigError("training.spike_policy: rollback reloads the last checkpoint; set checkpoint.folder and "
                          "checkpoint.interval too (or use warn or skip)")
    if t.spike_policy == "rollback" and cfg.fault_tolerance.enable:
        raise ConfigError("training.spike_policy: rollback is not built for replica groups (fault_tolerance.enable); "
                          "allowed there: warn, skip")
    if t.z_loss and not t.loss_chunk and p.tp > 1 and p.loss_parallel:
        raise ConfigError("training.z_loss: not computed on the vocabulary-sharded logits of loss_chunk 0 under tp > 1 "
                          "with loss_parallel; use the chunked loss (training.loss_chunk > 0, the default)")
    if t.warmup_steps < 0 or t.max_norm < 0 or t.lr <= 0 or t.threads < 0 or t.loss_chunk < 0:
        raise ConfigError("training: lr must be > 0; warmup_steps, max_norm, threads and loss_chunk must be >= 0")
    dp = dp_degree(cfg)
    if t.micro_batch_size == 0:
        if t.global_batch_size % dp:
            raise ConfigError(f"training.global_batch_size: {t.global_batch_size} is not divisible by the dp degree {dp}")
        t.micro_batch_size = t.global_batch_size // dp
    if t.micro_batch_size < 1 or t.global_batch_size % (t.micro_batch_size * dp):
        raise ConfigError(
            f"training.global_batch_size: {t.global_batch_size} must be a multiple of micro_batch_size"
            f" ({t.micro_batch_size}) x dp degree ({dp})")
    if cfg.metrics.log_interval < 1 or cfg.comm.timeout_seconds < 1:
        raise ConfigError("metrics.log_interval and comm.timeout_seconds: must be >= 1")
    if cfg.metrics.plot and (not cfg.metrics.jsonl or not cfg.metrics.plot.endswith(".png")):
        raise ConfigError(f"metrics.plot: {cfg.metrics.plot!r} must be a .png file, drawn from metrics.jsonl "
                          "(set it too)")
    for name in ("path", "tokenizer", "val_path"):
        value = getattr(cfg.data, name)
        if value and not storage.location(value, f"data.{name}").exists():
            raise ConfigError(f"data.{name}: {value!r} does not exist")
    if cfg.data.mix:
        if cfg.data.path:
            raise ConfigError("data.mix: give data.path or data.mix, not both")
        check_mix(cfg.data.mix, cfg.data.tokenizer)
    if t.eval_interval < 0 or t.eval_steps < 1:
        raise ConfigError(f"training.eval_interval must be >= 0 and eval_steps >= 1, got {t.eval_interval}, "
                          f"{t.eval_steps}")
    if t.eval_interval == 0 and cfg.data.val_path:  # auto: about ten evaluations (and the last step's)
        t.eval_interval = math.ceil(t.steps / 10)
    if t.eval_interval and not cfg.data.val_path:
        raise ConfigError("training.eval_interval: set data.val_path too (what should the validation loss be measured on?)")
    e = cfg.eval
    if e.interval < 0 or e.limit < 0 or e.num_fewshot < 0:
        raise ConfigError(f"eval.interval, eval.limit, eval.num_fewshot: must be >= 0, got {e.interval}, {e.limit}, "
                          f"{e.num_fewshot}")
    if e.loss_sets and not e.interval:
        raise ConfigError("eval.loss_sets: set eval.interval too (how often should their losses be measured?)")
    c = cfg.checkpoint
    if cfg.max_restarts < 0:
        raise ConfigError(f"max_restarts: must be >= 0, got {cfg.max_restarts}")
    if cfg.max_restarts and not (c.folder and c.interval) and not cfg.fault_tolerance.enable:
        raise ConfigError("max_restarts: set checkpoint.folder and checkpoint.interval too (a restarted job resumes "
                          "from its newest checkpoint; without one it would start over)")
    if c.interval < 0 or c.keep_latest_k < 0:
        raise ConfigError("checkpoint.interval and checkpoint.keep_latest_k: must be >= 0")
    if c.interval and not c.folder:
        raise ConfigError("checkpoint.interval: set checkpoint.folder too (where should checkpoints go?)")
    if c.load and not storage.location(c.load, "checkpoint.load").is_dir():
        raise ConfigError(f"checkpoint.load: {c.load!r} is not a folder")
    for option, place in (("checkpoint.folder", c.folder), ("checkpoint.load", c.load), ("data.path", cfg.data.path),
                          ("data.val_path", cfg.data.val_path), ("metrics.jsonl", cfg.metrics.jsonl),
                          ("metrics.plot", cfg.metrics.plot)):
        storage.check_reachable(place, option)
        if option.startswith("data") and storage.is_url(place) and not is_tokenized(place):
            raise ConfigError(f"{option}: {place} is no tokenized folder; under a URL plait reads tokenized folders "
                              f"(plait tokenize --data.path RAW --out {place}), raw text from a local path")
    prof = cfg.profiling
    if prof.steps < 1:
        raise ConfigError(f"profiling.steps: must be >= 1, got {prof.steps}")
    if prof.enable and not prof.folder:
        raise ConfigError("profiling.folder: must be a non-empty path when profiling.enable is set")
    if prof.start_step < 0:
        raise ConfigError(f"profiling.start_step: must be >= 0, got {prof.start_step}")
    last_profiled = (prof.start_step or 2) + prof.steps - 1
    if prof.enable and t.steps < last_profiled:
        raise ConfigError(f"profiling.steps: profiling {prof.steps} steps from step {prof.start_step or 2} "
                          f"needs training.steps >= {last_profiled}, got {t.steps}")
    return cfg
