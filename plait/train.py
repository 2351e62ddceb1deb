"""The training job: set-up in a safe order, then the step loop.

Order matters for failure behaviour: options, data and tokenizer are checked before the
process group exists, so bad input fails on every rank without a collective that could hang.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import traceback
from dataclasses import asdict
from datetime import timedelta

import torch
import torch.distributed as dist

from plait import collectives, float8, hf, host_memory, parallel, storage
from plait.checkpoint.checkpointer import Checkpointer
from plait.checkpoint.manifest import (check_compatible, check_optimizer_kept, check_owner, job_identity,
                                      latest_complete)
from plait.checks import check_options
from plait.compile_report import CompileReport
from plait.config import ConfigError, JobConfig, dp_degree, replica_groups, world_size
from plait.storage import job_folder
from plait.data import BatchLoader, eos_id, eval_batches, open_data
from plait.data.batch_schedule import batch_schedule
from plait.evals import Evaluation, Groups, TaskSuite, check_holds_eval_steps, eval_steps_held, open_loss_sets
from plait.hardware import linear_shapes, peak_flops, pick_device
from plait.job_model import job_model
from plait.metrics import summary
from plait.metrics.logger import MetricsLogger, Utilisation, peak_memory_gib
from plait.metrics.wandb_log import wandb_sinks
from plait.models.masking import attention_kernel
from plait.models.transformer import flops_per_token, linear_weight_shapes
from plait.optim import optimizers
from plait.optim.schedule import factor
from plait.parallel import BatchLayout
from plait.parallel.data_parallel import check_offload
from plait.parallel.expert_parallel import check_experts
from plait.parallel.stages import microbatches
from plait.parallel.context_parallel import check_heads
from plait.parallel.replica_groups import ReplicaGroups, check_lighthouse, own_paths
from plait.parallel.tensor_parallel import check_divisibility
from plait.precision import TrainContexts, resolve
from plait.preemption import Preempted, Preemption
from plait.proof.probe import DtypeProbe
from plait.proof.trace import StepProfiler
from plait.ema import WeightAverage
from plait.stability import SpikeWatch
from plait.stragglers import SlowRanks
from plait.start_folder import start_folder
from plait.start_report import print_start_report
from plait.step import TrainingError, TrainStep


class CollectiveTimeout(TrainingError):
    """A collective did not complete within comm.timeout_seconds: a peer is hung or dead. `then`:
    what to do once the error is said (wait for the other ranks' dumps of their collectives)."""

    then = None


def init_distributed(cfg: JobConfig, device: torch.device) -> None:
    """One process group for every run, world size 1 included, so every layout runs the same code."""
    timeout = timedelta(seconds=cfg.comm.timeout_seconds)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        # (offloaded, the gradient norm and its clipping meet host tensors: gloo carries those)
        backend = "cuda:nccl,cpu:gloo" if cfg.training.offload != "none" else "nccl"
    else:
        backend = "gloo"
    if "RANK" in os.environ:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group(backend, store=attempt_store(rank, world, timeout), rank=rank, world_size=world,
                                timeout=timeout, device_id=device if device.type == "cuda" else None)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


def attempt_store(rank: int, world: int, timeout: timedelta) -> dist.Store:
    """torchrun's store (its agent's, or one rank 0 hosts), under a prefix of the restart attempt.

    After `--max-restarts` brings a job back, its agent's store still holds the previous
    attempt's keys: a restarted rank could read a dead peer's address from them and fail in
    gloo's connectFullMesh, or wait on a barrier count that is already past. The prefix gives
    every attempt keys of its own."""
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=rank == 0 and not agent_store, timeout=timeout)
    return dist.PrefixStore(f"plait/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def set_threads(cfg: JobConfig) -> None:
    """Split the cores between local ranks: oversubscribed ranks slow each other down, and the
    thread count changes floating-point summation order, so it is pinned per run."""
    threads = cfg.training.threads or max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    torch.set_num_threads(threads)


def build_optimizer(model: torch.nn.Module, cfg: JobConfig):
    optimizer = optimizers.build_optimizer(model, cfg)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor(cfg))


def save_probe(probe: DtypeProbe, path: str, every_rank: bool) -> None:
    """Rank 0 writes the probe's records, each with its rank: its own, or with `every_rank`
    (pipeline stages run different parts of the model) every rank's."""
    rank = dist.get_rank()
    records = [{**r, "rank": rank} for r in probe.records()]
    gathered = [None] * dist.get_world_size() if rank == 0 else None
    if every_rank:
        dist.gather_object(records, gathered, dst=0)
    if rank == 0:
        probe.save(path, [r for ranks in (gathered if every_rank else [records]) for r in ranks])


def check_checkpoints(cfg: JobConfig, args, identity: dict) -> None:
    """What start-up would load must fit this model, and the folder it saves to must be this
    job's: checked before any process group."""
    check_owner(cfg.checkpoint.folder, identity)
    resume = latest_complete(cfg.checkpoint.folder)
    if resume is not None:
        check_compatible(resume, args, "checkpoint.folder")
        check_optimizer_kept(resume, cfg)
    elif cfg.checkpoint.load:
        folder = storage.location(cfg.checkpoint.load)  # (a job folder's newest checkpoint since check_options)
        if hf.is_hf_folder(folder):
            hf.check(folder, args, "checkpoint.load")
        else:
            check_compatible(folder, args, "checkpoint.load")


def collective_of(error: BaseException) -> str:
    """The torch.distributed call a timed-out error came from, read off its traceback."""
    frames = traceback.extract_tb(error.__traceback__)
    calls = [f.name for f in frames if f.filename.endswith("distributed_c10d.py") and not f.name.startswith("_")]
    return f"the collective {calls[-1]}" if calls else "a collective"


def check_data_sizes(cfg: JobConfig, corpus) -> None:
    """Every source holds a global batch, the validation set its eval_steps: before any process group."""
    t = cfg.training
    BatchLoader(corpus.sources, corpus.weights, t.seq_len, t.global_batch_size, t.micro_batch_size, 0, dp_degree(cfg),
                t.seed)
    if t.eval_interval:
        check_holds_eval_steps(corpus.val, f"data.val_path: {corpus.val.label}", t)


def run(cfg: JobConfig) -> list[dict]:
    """Train according to `cfg`; returns rank 0's per-step metric rows (empty on other ranks)."""
    started = time.perf_counter() - summary.process_age()
    check_options(cfg, world_size())
    if cfg.fault_tolerance.enable:
        check_lighthouse(cfg)
    own_paths(cfg)
    set_threads(cfg)
    if cfg.debug.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    corpus = open_data(cfg.data, start_folder(cfg), cfg.training.phases)
    try:
        args = job_model(cfg, corpus.tokenizer.get_vocab_size())
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if cfg.training.seq_len > args.max_seq_len:
        raise ConfigError(f"training.seq_len: {cfg.training.seq_len} exceeds the model's {args.max_seq_len}")
    check_divisibility(args, cfg)
    check_heads(args, cfg)
    check_experts(args, cfg)
    device = pick_device(cfg.training.device)
    check_offload(cfg, device)
    float8.check_layers(args, cfg, device, resolve(cfg).compute)
    identity = job_identity(cfg, args, corpus.fingerprint)
    check_checkpoints(cfg, args, identity)
    check_data_sizes(cfg, corpus)
    loss_sets = open_loss_sets(cfg, corpus.tokenizer, start_folder(cfg))
    suite = TaskSuite(cfg.eval, cfg.training.seq_len, corpus.tokenizer, eos_id(corpus.tokenizer)) \
        if cfg.eval.interval and cfg.eval.tasks else None

    host_memory.configure(cfg.training.host_memory, device)
    owned = not dist.is_initialized()  # `plait doctor` runs its job on the group it already has
    if owned:
        collectives.record()  # (set up with the process group)
        init_distributed(cfg, device)
    peers_answer = True
    try:
        return _train(cfg, args, corpus, identity, device, started, loss_sets, suite)
    except CollectiveTimeout:
        peers_answer = False
        raise
    finally:
        # A barrier before tearing down avoids gloo aborting at exit while a peer still talks
        # (but would wait for a hung peer until it timed out too, and replace the error).
        if owned and dist.is_initialized():
            if peers_answer:
                dist.barrier()
            dist.destroy_process_group()


def open_batches(cfg: JobConfig, args, corpus, mesh, dp_mesh, loss_mesh, loss_sets: dict, suite: TaskSuite | None):
    """This rank's batch layout (the masks and positions its sequences get), its training batches,
    its evaluations and the groups they reduce over."""
    t, cp = cfg.training, cfg.parallelism.cp
    layout = BatchLayout(cfg.model.attention_mask, attention_kernel(cfg), eos_id(corpus.tokenizer),
                         mesh["cp"].get_local_rank(), cp, cfg.parallelism.cp_kind == "ulysses",
                         args.spans, predicts_further=bool(args.mtp_layers))
    shape = (t.seq_len, t.global_batch_size, t.micro_batch_size, dp_mesh.get_local_rank(), dp_mesh.size())
    # Replica groups split each step's batch as one more data-parallel dimension; each evaluates all of it
    group = cfg.fault_tolerance.replica_id if cfg.fault_tolerance.enable else 0
    schedule = batch_schedule(cfg)
    loader = BatchLoader(corpus.sources, corpus.weights, *shape[:3], group * dp_mesh.size() + dp_mesh.get_local_rank(),
                         replica_groups(cfg) * dp_mesh.size(), t.seed, schedule, corpus.phase_weights(schedule.phases))
    evaluation = Evaluation(cfg, eval_batches(corpus.val, *shape, eval_steps_held(corpus.val, t)) if t.eval_interval
                            else None, {name: eval_batches(source, *shape, eval_steps_held(source, t))
                                        for name, source in loss_sets.items()}, suite)
    groups = Groups(dp_mesh.get_group(), loss_mesh.get_group(), mesh["cp"].get_group() if cp > 1 else None)
    return layout, loader, evaluation, groups


def open_metrics(cfg: JobConfig, args, pipeline, precision, device: torch.device, done: int):
    """The shapes of the model's matmuls per forward, the device's peak at them (MFU's), and rank
    0's metrics sinks."""
    t = cfg.training
    sequences_per_forward = t.micro_batch_size // (microbatches(cfg) if pipeline else 1)
    shapes = linear_shapes(linear_weight_shapes(args), sequences_per_forward * t.seq_len // cfg.parallelism.cp)
    peak = peak_flops(device, precision.compute, shapes)
    utilisation = Utilisation(flops_per_token(args, t.seq_len), peak, dist.get_world_size() * replica_groups(cfg))
    logger = MetricsLogger(cfg.metrics.jsonl, cfg.metrics.tensorboard, cfg.metrics.log_interval, done, cfg.metrics.plot,
                           wandb_sinks(cfg, asdict(args), done), steps=t.steps) if dist.get_rank() == 0 else None
    return shapes, peak, utilisation, logger


def _train(cfg: JobConfig, args, corpus, identity: dict, device: torch.device, started: float, loss_sets: dict,
           suite: TaskSuite | None) -> list[dict]:
    t = cfg.training
    rank = dist.get_rank()
    mesh, dp_mesh, loss_mesh = parallel.build_mesh(cfg, device.type)
    layout, loader, evaluation, groups = open_batches(cfg, args, corpus, mesh, dp_mesh, loss_mesh, loss_sets, suite)

    precision = resolve(cfg)
    pp = cfg.parallelism.pp > 1  # the pipeline enters loss parallelism around its whole schedule
    contexts = TrainContexts(precision, device.type, cfg.compile.autograd,
                             loss_parallel=cfg.parallelism.tp > 1 and cfg.parallelism.loss_parallel and not pp)
    if pp:  # (imported here: torch.distributed.pipelining costs every other run 0.6 s at start-up)
        from plait.parallel.pipeline import Pipeline
    pipeline = Pipeline(args, mesh, cfg, precision, device, contexts) if pp else None
    model = pipeline.module if pipeline else parallel.build_model(args, mesh, cfg, precision, device)
    optimizer, scheduler = build_optimizer(model, cfg)
    spikes = SpikeWatch(t.spike_threshold)  # (its history is saved with each checkpoint)
    ema = WeightAverage(model, t.ema, t.float8 != "none") if t.ema else None
    checkpointer = Checkpointer(cfg, args, model, optimizer, scheduler, loader, identity, corpus.tokenizer,
                                {"spikes": spikes}, ema)
    done = checkpointer.restore()
    replicas = ReplicaGroups(cfg)
    replicas.start(model, {"model": model, "optimizer": optimizer, "scheduler": scheduler, "loader": loader}, done,
                   device)

    shapes, peak, utilisation, logger = open_metrics(cfg, args, pipeline, precision, device, done)
    if rank == 0:
        print_start_report(cfg, args, mesh, replicas, loader, precision, pipeline, peak, shapes, device)
    preemption = Preemption(device)
    recorder = collectives.Recorder(job_folder(cfg))  # (after preemption's handlers: SIGUSR1 is theirs too)
    slow_ranks = SlowRanks(cfg.metrics.log_interval, enabled=not pipeline)
    train_step = TrainStep(cfg, args, model, pipeline, optimizer, scheduler, loader, layout, contexts, loss_mesh,
                           replicas, checkpointer, preemption, spikes, device)
    profiler = StepProfiler(cfg.profiling, done + 1, t.steps, device.type)
    compiled = CompileReport(cfg.compile.report, rank, done + 1) if cfg.compile.report else None
    rows = []
    float8.precompute_scales(model, cfg)  # (the first step's gathers; each step's after its update)
    startup_s, finished = time.perf_counter() - started, False
    if rank == 0:
        print(f"plait: start-up {startup_s:.1f} s (imports, data, model{', checkpoint' * bool(done)}): "
              f"{t.steps - done} of {t.steps} steps to go", flush=True)
    try:
        for step in replicas.steps(done, t.steps):
            start = time.perf_counter() - replicas.waited
            if replicas.healed:
                float8.precompute_scales(model, cfg)
                if rank == 0:
                    print(f"plait: healed from a live replica group: continuing at step {step}", flush=True)
            if compiled:
                compiled.at_step(step)
            probe = DtypeProbe(contexts, model) if step == done + 1 and cfg.debug.dtype_probe else contextlib.nullcontext()
            with probe, profiler.step(step):
                trained = train_step(step)
            if trained is None:  # a group failed during the step: it comes again, on the same batches
                continue
            metrics, experts = trained
            evaluated = evaluation.run(step, model, pipeline, contexts, layout, groups, t.micro_batch_size,
                                       dp_mesh.get_local_rank(), dp_mesh.size(), device)
            slowest = slow_ranks.check(step)
            if isinstance(probe, DtypeProbe):
                save_probe(probe, cfg.debug.dtype_probe, every_rank=pipeline is not None)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            elapsed = time.perf_counter() - start - evaluated.get("eval_time", 0.0)  # a step's time is training's
            if logger:
                row = {"step": step, **metrics, **speed(step, elapsed, loader.schedule, replicas, utilisation, args,
                                                         cfg), "memory_gib": peak_memory_gib(device),
                       "state_gib": train_step.state_gib, "step_time": elapsed,
                       **({"replicas": replicas.taking_part()} if cfg.fault_tolerance.enable else {}), **experts,
                       **evaluated, **slowest}
                logger.log(row)
                rows.append(row)
            checkpointer.maybe_save(step)
            if signum := preemption.agreed_signal():
                raise preempted(signum, step, checkpointer.save_now(step))
        finished = True
    except RuntimeError as e:  # gloo and NCCL raise their timeouts as RuntimeError (DistBackendError)
        error = as_timeout(e, step, cfg)
        if isinstance(error, CollectiveTimeout):
            error.then = recorder.ask_all(f"rank {dist.get_rank()}: collective timeout at step {step}")
        raise error from None
    finally:  # also when the run fails
        recorder.close()
        if compiled:
            compiled.write()
        close_run(cfg, preemption, replicas, checkpointer, logger, rows if finished else None, loader,
                  (startup_s, time.perf_counter() - started))
    return rows


def speed(step: int, elapsed: float, schedule, replicas: ReplicaGroups, utilisation: Utilisation, args,
          cfg: JobConfig) -> dict:
    """A step's tokens/s and MFU (tokens trained, not planned: a dead group's share is not), a
    growing run's batch and length (plait/data/batch_schedule.py), and a phased run's phase (0:
    before the first)."""
    now = schedule.shape(step)
    tokens_per_sec = now.tokens * replicas.taking_part() / replica_groups(cfg) / elapsed
    phase = schedule.phases.at(step) if schedule.phases else None
    return {**({"batch": now.sequences, "seq_len": now.length} if schedule.grows else {}),
            **({"phase": phase.number if phase else 0} if schedule.phases else {}),
            "tokens_per_sec": tokens_per_sec,
            "mfu": utilisation.mfu(step, tokens_per_sec, flops_per_token(args, now.length))}


def close_run(cfg: JobConfig, preemption: Preemption, replicas: ReplicaGroups, checkpointer: Checkpointer,
              logger: MetricsLogger | None, rows: list[dict] | None, loader: BatchLoader, seconds: tuple) -> None:
    """A save in flight completes (and gets its manifest) before the process group goes away
    under it; then a finished run's summary (`rows`; None for a failed run) names it."""
    preemption.close()
    replicas.close()
    checkpointer.close()
    if logger:
        if rows is not None:
            logger.finish(summary.build(rows, loader, *seconds, checkpointer.newest))
        logger.close()


def preempted(signum: int, step: int, folder) -> Preempted:
    """The run stopped by a signal after `step`, and where it saved (`folder`; None: nowhere)."""
    return Preempted(f"{signal.Signals(signum).name} after step {step}: " + (
        f"saved {folder}; run the same command again to resume from it" if folder else
        "nothing saved (no checkpoint.folder): the steps of this run are lost"), signum)


def as_timeout(error: RuntimeError, step: int, cfg: JobConfig) -> BaseException:
    """A collective's timeout as a CollectiveTimeout naming the collective; any other error as it is."""
    if "timed out" not in str(error).lower() and "timeout" not in str(error).lower():
        return error
    return CollectiveTimeout(f"step {step}: {collective_of(error)} did not complete within comm.timeout_seconds="
                             f"{cfg.comm.timeout_seconds}: a rank stopped answering (hung, or dead); every rank that "
                             f"answers dumped its last collectives: `plait why-hung {job_folder(cfg)}` "
                             f"[{str(error).strip().splitlines()[0]}]")
