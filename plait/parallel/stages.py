"""Pipeline stages without running them: how many per rank, micro-batches per step, which
blocks each stage holds, and every pipeline option checked against the others. Apart from
`plait.parallel.pipeline` (the schedules) so that checking options, planning and a run without
pp never import `torch.distributed.pipelining` (0.6 s at every start-up)."""

from __future__ import annotations

from plait.config import ConfigError, JobConfig, dp_degree
from plait.start_folder import start_folder
from plait.models.flavors import FLAVORS

MULTI_STAGE = ("interleaved_1f1b", "interleaved_zb", "zbv")


def stages_per_rank(cfg: JobConfig) -> int:
    p = cfg.parallelism
    return p.pp_stages_per_rank or (2 if p.pp_schedule in MULTI_STAGE else 1)


def microbatches(cfg: JobConfig) -> int:
    return cfg.parallelism.pp_microbatches or cfg.parallelism.pp * stages_per_rank(cfg)


def check_pipeline(cfg: JobConfig) -> None:
    """Every pipeline option against the others, before any process group: one line each."""
    p, t = cfg.parallelism, cfg.training
    per_rank, m = stages_per_rank(cfg), microbatches(cfg)
    stages = p.pp * per_rank
    if p.dp_backend != "fsdp2":
        raise ConfigError(f"parallelism.dp_backend: {p.dp_backend} cannot run under pipeline parallelism (the schedule "
                          "holds gradient reduction back to a stage's last micro-batch for fully_shard modules only, "
                          "so every micro-batch would reduce); allowed with pp > 1: fsdp2 (DDP, FSDP2, HSDP)")
    if p.pp_schedule == "zbv" and cfg.eval.interval:
        raise ConfigError("eval.interval: torch 2.13's zbv schedule runs backward actions in its forward-only eval and "
                          "fails, so it cannot evaluate; allowed with evaluations: gpipe, 1f1b, interleaved_1f1b, "
                          "interleaved_zb")
    if p.pp_schedule == "zbv" and t.eval_interval:
        # (named by data.val_path: with it, eval_interval is on whether the user set it or not)
        raise ConfigError("data.val_path: torch 2.13's zbv schedule runs backward actions in its forward-only eval and "
                          "fails, so it cannot validate; allowed with validation: gpipe, 1f1b, interleaved_1f1b, "
                          "interleaved_zb (or drop data.val_path)")
    if p.pp_schedule in ("gpipe", "1f1b") and per_rank != 1:
        raise ConfigError(f"parallelism.pp_stages_per_rank: {p.pp_schedule} runs one stage per rank, got {per_rank}; "
                          "allowed: 1, or a schedule of several (interleaved_1f1b, interleaved_zb, zbv)")
    if p.pp_schedule == "zbv" and per_rank != 2:
        raise ConfigError(f"parallelism.pp_stages_per_rank: zbv places exactly 2 stages per rank (a V), got {per_rank}")
    if p.pp_schedule.startswith("interleaved") and per_rank < 2:
        raise ConfigError(f"parallelism.pp_stages_per_rank: {p.pp_schedule} interleaves several stages per rank, "
                          f"got {per_rank}; allowed: 2 or more")
    if p.pp_schedule == "zbv" and cfg.compile.enable:
        raise ConfigError("compile.enable: zbv splits backward into input and weight gradients, which torch.compile "
                          "cannot (torch 2.13); allowed: another pp_schedule, or no compile")
    local = t.global_batch_size // dp_degree(cfg)
    if t.micro_batch_size != local:
        raise ConfigError(f"training.micro_batch_size: under pipeline parallelism the pipeline's micro-batches are the "
                          f"accumulation; allowed: 0 or {local} (global_batch_size / dp), with "
                          "parallelism.pp_microbatches setting the split")
    if m < 1 or local % m:
        raise ConfigError(f"parallelism.pp_microbatches: {m} does not divide the local batch {local} "
                          f"(global_batch_size / dp); allowed: a divisor of {local}")
    if p.pp_schedule in ("1f1b", "zbv") and m < stages:
        raise ConfigError(f"parallelism.pp_microbatches: {p.pp_schedule} needs at least one micro-batch per stage "
                          f"({stages}), got {m}")
    if p.pp_schedule.startswith("interleaved") and m % max(1, m // p.pp):
        raise ConfigError(f"parallelism.pp_microbatches: {p.pp_schedule} runs micro-batches in rounds of pp ({p.pp}); "
                          f"got {m}, allowed: a multiple of {p.pp} or fewer than {2 * p.pp}")
    start = start_folder(cfg)
    if start is not None:  # (imported here: the model's files are read only for a pipeline)
        from plait.job_model import folder_model

        shape = folder_model(start, "checkpoint.load")
    else:
        shape = FLAVORS[cfg.model.flavor]
    if shape.tie_embeddings or cfg.model.tie_embeddings:
        raise ConfigError(f"parallelism.pp: the model ties its output layer to its embedding"
                          f"{f' ({start})' if start else ''}, and the two live on the first and the last stage: "
                          "plait does not pipeline a tied model; allowed: pp 1 (DDP, FSDP2, HSDP, TP, SimpleFSDP)")
    if (cfg.model.mtp_layers if cfg.model.mtp_layers >= 0 else shape.mtp_layers) > 0 and p.pp_schedule == "zbv":
        raise ConfigError("parallelism.pp_schedule: zbv runs the first and the last stage on one rank, where "
                          "multi-token prediction's copy of the embedding (the last stage's) would share the first's "
                          "name; allowed with model.mtp_layers > 0: gpipe, 1f1b, interleaved_1f1b, interleaved_zb")
    split_blocks(cfg.model.n_layers or shape.n_layers, stages, p.pp_split_points)


def split_blocks(n_layers: int, stages: int, split_points: tuple[int, ...] = ()) -> list[range]:
    """The blocks of each stage, contiguous and in order. By default balanced with the
    embedding and the output layer counting as one block each (the first and last stages get
    a block less where that evens the work); `split_points` gives each stage's first block."""
    if n_layers < stages:
        raise ConfigError(f"parallelism.pp: {stages} stages need at least {stages} blocks, the model has {n_layers}; "
                          "allowed: fewer stages (pp x pp_stages_per_rank), or more blocks (model.n_layers)")
    if split_points:
        points = list(split_points)
        if len(points) != stages - 1 or points != sorted(set(points)) or points[0] < 1 or points[-1] >= n_layers:
            raise ConfigError(f"parallelism.pp_split_points: {points} is not {stages - 1} increasing block indices "
                              f"in 1..{n_layers - 1} (one per stage after the first)")
    else:
        units, points = n_layers + 2, []
        for k in range(1, stages):
            ideal = int(k * units / stages + 0.5) - 1  # unit u is block u - 1: unit 0 is the embedding
            points.append(min(max(ideal, points[-1] + 1 if points else 1), n_layers - (stages - k)))
    bounds = [0, *points, n_layers]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def stage_indices(pp_rank: int, pp: int, per_rank: int, schedule: str) -> list[int]:
    """The stages a rank runs: round-robin ("loop"), or for zbv a V (rank r: r and 2pp-1-r)."""
    if schedule == "zbv":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(per_rank)]
