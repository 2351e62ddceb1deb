"""`plait doctor`: whether this machine or cluster is fit to train, in minutes.

Each rank runs, in order: a short job alone (the reference), then, on the job's process group,
its hardware and versions, its matmul speed, silent data corruption (exact and cross-rank
matmuls, the reference's bits), the collectives and every pair's latency, the job in the
layout asked for (against the reference), and a DCP save and load in the checkpoint folder.
Rank 0 prints one table; the exit code is 1 when a check fails.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from plait.arguments import parse_args
from plait.config import ConfigError, JobConfig, world_size
from plait.doctor import job as job_checks
from plait.doctor import machine, network
from plait.doctor.report import FAIL, table, worst, write_json
from plait.hardware import pick_device
from plait.train import init_distributed, set_threads

# A short job unless the command line (or its --config) says otherwise.
DEFAULTS = ["--training.steps", "6", "--training.warmup_steps", "2"]


@dataclass
class DoctorConfig(JobConfig):
    json: str = ""
    """also write the checks and the numbers behind them to this JSON file"""
    budget_seconds: float = 0.0
    """time for the measured checks (matmul speed, collectives): more time measures larger sizes and more repeats;
    0 = 12 s on CPUs, 150 s on GPUs (the whole doctor takes about twice that)"""


def parse(argv: list[str]) -> DoctorConfig:
    cfg = parse_args(argv, "plait doctor", DoctorConfig, DEFAULTS)
    if cfg.budget_seconds < 0:
        raise ConfigError(f"budget_seconds: must be >= 0 (0 = the device's default), got {cfg.budget_seconds}")
    return cfg


def layout(job: JobConfig) -> str:
    p = job.parallelism
    degrees = [f"{name} {getattr(p, name)}" for name in ("pp", "dp_replicate", "dp_shard", "cp", "tp")
               if getattr(p, name) > 1]
    experts = f", ep {p.ep} (of dp_shard x cp)" if p.ep > 1 else ""  # ep borrows ranks: no factor of the world
    return f"{p.dp_backend}: " + (" x ".join(degrees) or "one rank") + experts


def run(cfg: DoctorConfig) -> int:
    """This rank's part of the doctor; the exit code (the same on every rank)."""
    start, world = time.perf_counter(), world_size()
    job = job_checks.job_config(cfg, world)  # a bad option fails here, before any process group
    reference = job_checks.reference_config(job)
    device = pick_device(job.training.device)
    budget = cfg.budget_seconds or (150.0 if device.type == "cuda" else 12.0)
    set_threads(job)
    seconds = {}
    begin = time.perf_counter()
    alone = job_checks.run_alone(reference)
    seconds["reference job"] = time.perf_counter() - begin
    init_distributed(job, device)
    try:
        every_fact = machine.gather(machine.facts(device))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        node = network.node_group(local_world) if world > 1 else None
        areas = [("hardware", lambda: machine.hardware_checks(every_fact)),
                 ("compute", lambda: machine.compute_checks(device, budget * 0.3)),
                 ("corruption", lambda: machine.corruption_checks(device, every_fact)),
                 ("network", lambda: network.collective_checks(device, budget * 0.7, node) +
                  [network.latency_check(device)] if world > 1 else []),
                 ("calibration", lambda: calibrate(job, checks, every_fact, device, local_world, calibration)),
                 ("training", lambda: job_checks.training_checks(job, alone, every_fact, layout(job),
                                                                 predicted(job, calibration, local_world))),
                 ("storage", lambda: job_checks.storage_checks(job, cfg.checkpoint.folder, node, device))]
        checks, calibration = [], {}
        for area, measure in areas:
            begin = time.perf_counter()
            checks += measure()
            seconds[area] = time.perf_counter() - begin
        verdict = torch.tensor([int(worst(checks) == FAIL)], device=device)
        dist.broadcast(verdict, src=0)  # rank 0 alone holds the training rows
        if dist.get_rank() == 0:
            report(cfg, job, checks, every_fact, local_world, seconds, time.perf_counter() - start, calibration)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return int(verdict.item())


def calibrate(job: JobConfig, checks: list, every_fact: list[dict], device: torch.device, local_world: int,
              out: dict) -> list:
    """What `plait plan --calibration` reads (into `out`): the compute and network numbers measured
    above, and on a CPU the element-wise speed of one block of the job's model, timed on every rank at once."""
    from plait.plan import model_shape
    from plait.plan.calibration import Calibration, doctor_calibration, gloo_links
    from plait.plan.speed import measured_elementwise

    numbers = next(c.values["calibration_per_rank"] for c in checks if c.name == "compute: float32 matmul")
    network = {(c.name.split("(")[1].split(",")[0], c.name.split()[1]): c.values["sizes"]
               for c in checks if c.name.startswith("network: ") and "," in c.name}
    pairs = next((c.values["seconds_per_pair"] for c in checks if c.name == "network: point-to-point latency"), {})
    latency = sorted(pairs.values())[len(pairs) // 2] if pairs else 0.0
    world = len(every_fact)
    out.update(doctor_calibration(every_fact[0]["device"], numbers, network, latency,
                                  max(1, world // local_world), world, every_fact[0]["bf16"]))
    if not network:  # one rank: no link measured, gloo's stated default where a plan needs one
        out["collectives"] = out["inter_node"] = gloo_links()
    if out["asynchronous"]:
        # A GPU runs the small job's block faster than the host queues its operators: its time
        # measures the host, not how fast the device streams activations. There element-wise work
        # is priced at the copy bandwidth (`memory`): llama3_1b on an H200, seq 2048 x 4, predicted
        # 26,785 tokens/s from the block's time, 64,830 from the copy bandwidth; measured 59,043.
        return []
    args, t = model_shape(job), job.training
    for dtype in (torch.float32, torch.bfloat16)[:1 + every_fact[0]["bf16"]]:
        out["elementwise"][str(dtype).removeprefix("torch.")] = measured_elementwise(
            args, t.micro_batch_size * t.seq_len, t.seq_len, device, dtype, Calibration(**out))
    return []


def predicted(job: JobConfig, calibration: dict, local_world: int) -> float | None:
    """`plait plan`'s tokens/s for the doctor's job with the doctor's own calibration (None where
    plan cannot price the job's layout)."""
    from plait.plan import model_shape
    from plait.plan.calibration import Calibration
    from plait.plan.search import predict_job

    try:
        row = predict_job(model_shape(job), job, world_size(), float("inf"), Calibration(**calibration), local_world)
    except (ConfigError, KeyError, ValueError, ZeroDivisionError):
        return None
    return row.tokens_per_second_per_device * world_size()


def report(cfg: DoctorConfig, job: JobConfig, checks, every_fact: list[dict], local_world: int,
           seconds: dict[str, float], total: float, calibration: dict) -> None:
    ranks, nodes = len(every_fact), max(1, len(every_fact) // local_world)
    header = {"ranks": ranks, "nodes": nodes, "device": every_fact[0]["device"], "job": layout(job),
              "flavor": job.model.flavor, "steps": job.training.steps, "seconds": round(total, 1),
              "seconds_per_area": {area: round(s, 2) for area, s in seconds.items()}, "calibration": calibration}
    print(f"plait doctor: {ranks} rank(s) on {nodes} node(s), {every_fact[0]['device']}; job {job.model.flavor}, "
          f"{layout(job)}, {job.training.steps} steps; {total:.0f} s (" +
          ", ".join(f"{area} {s:.1f}" for area, s in seconds.items()) + ")\n")
    print(table(checks))
    failed = [c.name for c in checks if c.result == FAIL]
    print(f"\nplait doctor: {worst(checks)}" + (f" ({', '.join(failed)}): not fit to train" if failed else ""),
          flush=True)
    if cfg.json:
        write_json(cfg.json, header, checks)
