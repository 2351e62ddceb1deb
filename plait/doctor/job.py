"""A short job in the layout the user names, against the same job on one device; and the
checkpoint folder's file system under a real DCP save and load of a state shaped as the job's."""

from __future__ import annotations

import contextlib
import copy
import io
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from plait.checks import check_options
from plait.config import JobConfig, Parallelism
from plait.data import build_tokenizer
from plait.doctor.machine import gather, peers_differ
from plait.doctor.network import agree
from plait.doctor.report import FAIL, PASS, WARN, Check, rank_list
from plait.hardware import pick_device
from plait.job_model import job_model
from plait.models.masking import attention_kernel
from plait.models.transformer import Transformer
from plait.parallel.stages import microbatches
from plait.precision import resolve
from plait.train import run

# The parity matrix's widest bounds over 6 steps of its tiny models (tests/test_parity.py):
# fp32 1e-5 (OLMo 2's post-norms), bf16 5e-3 (a tied model under TP2), float8 1e-3.
BOUND = {torch.float32: 1e-5, torch.bfloat16: 5e-3}
FLOAT8_BOUND = 1e-3
GiB = 1 << 30


def job_config(cfg: JobConfig, world: int) -> JobConfig:
    """The user's job as the doctor runs it: its own checkpoint folder is the storage check's,
    never the job's (which would resume from it, or write there); no files of its own."""
    job = copy.deepcopy(cfg)
    job.checkpoint.folder, job.metrics.jsonl, job.metrics.tensorboard, job.metrics.plot = "", "", "", ""
    job.metrics.wandb_project, job.metrics.wandb_run_name, job.metrics.wandb_offline = "", "", False
    job.profiling.enable, job.debug.dtype_probe = False, ""
    return check_options(job, world)


def reference_config(job: JobConfig) -> JobConfig:
    """The same job on one device: the same model, precision, data and global batch in the same
    sequences per forward (micro-batches accumulated where the job spreads them over ranks or
    pipeline stages), and the same attention kernel; no layout left but one device's."""
    one = copy.deepcopy(job)
    one.training.micro_batch_size //= microbatches(job) if job.parallelism.pp > 1 else 1
    # A fresh section: every degree 1 and every layout's own option at its default (an option added
    # later too), fsdp2 being one device's path without fully_shard (plait/precision.py).
    one.parallelism = Parallelism()
    # A classic-DDP option; an eager backward is also the one the compiled one is judged against.
    one.compile.autograd = False
    # `auto` picks its kernel from the layout (sdpa under pp or cp): the reference keeps the job's.
    one.model.attention = attention_kernel(job)
    return check_options(one, 1)


@contextlib.contextmanager
def quiet():
    """The job's own start-up and step lines stay out of the doctor's table."""
    with contextlib.redirect_stdout(io.StringIO()):
        yield


def run_alone(reference: JobConfig) -> list[dict] | str:
    """The reference job in this process as a world of one, before the doctor's process group
    exists (plait.train reads the world from torchrun's variables): each rank computes it, so
    the ranks' answers also check each other. Returns its rows, or why it could not run."""
    hidden = {name: os.environ.pop(name) for name in ("RANK", "WORLD_SIZE") if name in os.environ}
    try:
        with quiet():
            return run(copy.deepcopy(reference))
    except (RuntimeError, ValueError) as e:  # out of memory on one device, say
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # what the failed job held, for the job on the world
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0]}"
    finally:
        os.environ.update(hidden)


def bound(job: JobConfig) -> float:
    compute = resolve(copy.deepcopy(job)).compute
    return max(BOUND.get(compute, BOUND[torch.bfloat16]), FLOAT8_BOUND if job.training.float8 != "none" else 0.0)


def training_checks(job: JobConfig, alone: list[dict] | str, every_fact: list[dict], layout: str,
                    predicted: float | None) -> list[Check]:
    """Run the job on the doctor's process group; its losses against rank 0's reference, the
    references against each other (bitwise: one device model runs one computation), and its
    speed beside what `plait plan` predicts from this doctor's calibration."""
    answers = gather(alone if isinstance(alone, str) else [(r["loss"].hex(), r["grad_norm"].hex()) for r in alone])
    failed = [rank for rank, a in enumerate(answers) if isinstance(a, str)]
    differ = peers_differ(every_fact, [str(a) for a in answers]) if not failed else []
    text = (f"{rank_list(failed)} could not run it alone ({answers[failed[0]]})" if failed else
            f"{rank_list(differ)} disagreed with the same device model" if differ else
            f"{len(alone)} steps alone on each rank: the same bits on every rank")
    checks = [Check("corruption: training steps", text, "bitwise equal across ranks of one device model",
                    FAIL if differ else WARN if failed else PASS, differ or failed)]
    try:
        with quiet():
            rows = run(copy.deepcopy(job))
        error = ""
    except RuntimeError as e:  # a non-finite loss, say: every rank stops on the same verdict
        rows, error = [], str(e).strip().splitlines()[0]
    if dist.get_rank() != 0:
        return checks
    limit = bound(job)
    if error:
        checks.append(Check("training: losses", f"the job failed: {error}", f"<= {limit:g} from one device", FAIL))
        return checks
    if isinstance(alone, str):
        checks.append(Check("training: losses", f"no one-device reference ({alone})", f"<= {limit:g} from one device",
                            WARN))
    else:
        gap = max(abs(a["loss"] - b["loss"]) for a, b in zip(rows, alone))
        text = f"max |loss - one device's| {gap:.2g} over {len(rows)} steps ({layout})"
        checks.append(Check("training: losses", text,
                            f"<= {limit:g}", PASS if gap <= limit else FAIL, [],
                            {"losses": [r["loss"] for r in rows], "one_device": [r["loss"] for r in alone]}))
    later = rows[1:] or rows  # the first step compiles, warms caches
    speed = statistics.median(r["tokens_per_sec"] for r in later)
    mfu = statistics.median(r["mfu"] for r in later)
    gpu = pick_device(job.training.device).type == "cuda"
    checks.append(Check("training: throughput", throughput_text(speed, mfu, len(rows), predicted, gpu), "reported",
                        PASS, [], {"tokens_per_sec": speed, "mfu": mfu, "predicted_tokens_per_sec": predicted}))
    return checks


HOST_BOUND_MFU = 0.05  # below it a GPU mostly waits for its host to queue the step's operators


def throughput_text(speed: float, mfu: float, steps: int, predicted: float | None, gpu: bool) -> str:
    """The measured speed, plan's prediction beside it, and why the two part on a GPU the job
    cannot keep busy (the doctor's debug job on an H200: MFU 0.1%, plan 4-7x too fast)."""
    text = f"{speed:,.0f} tokens/s, MFU {mfu:.1%} (median of steps 2-{steps})"
    if predicted:
        text += f"; plait plan predicts {predicted:,.0f} ({predicted / speed:.2f}x)"
        if gpu and mfu < HOST_BOUND_MFU:
            text += (": a job this small leaves the GPU waiting on the host, whose work per parameter plan does "
                     "not count; give the doctor your own job's --model.flavor")
    return text


def job_state(job: JobConfig, mesh: DeviceMesh, device: torch.device) -> dict[str, DTensor]:
    """A state the size and shape of the job's checkpoint: each parameter and AdamW's two moments
    in fp32, split on dim 0 over the ranks as FSDP2 splits them, filled with random values (this
    rank's own) so that what is read back can be compared with what was written."""
    args = job_model(job, build_tokenizer(job.data).get_vocab_size())
    with torch.device("meta"):
        shapes = {name: p.shape for name, p in Transformer(args).named_parameters()}
    n, rank = mesh.size(), mesh.get_local_rank()
    generator = torch.Generator(device).manual_seed(rank)
    state = {}
    for name, shape in shapes.items():
        chunk = -(-shape[0] // n)
        rows = max(0, min(shape[0], (rank + 1) * chunk) - rank * chunk)
        stride = torch.empty(shape, device="meta").stride()
        for kind in ("model", "exp_avg", "exp_avg_sq"):
            local = torch.randn((rows, *shape[1:]), generator=generator, device=device)
            state[f"{kind}.{name}"] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=shape,
                                                         stride=stride)
    return state


def shared_folder(given: str, group, device: torch.device) -> tuple[Path, bool]:
    """A new folder under the checkpoint folder (or a temporary one), the same on every rank of
    `group`; whether it is temporary."""
    name = [None]
    if dist.get_rank(group) == 0:
        root = Path(given) if given else Path(tempfile.mkdtemp(prefix="plait-doctor-"))
        root.mkdir(parents=True, exist_ok=True)
        name = [str(root / f"plait-doctor-{int(time.time())}-{os.getpid()}")]
    dist.broadcast_object_list(name, group=group, group_src=0)
    return Path(name[0]), not given


def storage_checks(job: JobConfig, given: str, group, device: torch.device) -> list[Check]:
    """DCP save then load of the job's state in `given` (or a temporary folder: then within each
    node, `group`): write and read speed, the bits read back, and room for checkpoints."""
    group = None if given else group
    mesh = DeviceMesh.from_group(group or dist.group.WORLD, device.type)
    state = job_state(job, mesh, device)
    size = sum(t.numel() * 4 for t in state.values())  # the whole state, every rank's shard
    folder, temporary = shared_folder(given, group, device)
    where = f"{folder.parent}" + (" (temporary: no --checkpoint.folder given)" if temporary else "")
    failed, cause = [], ""
    try:
        dist.barrier(group=group)
        begin = time.perf_counter()
        dcp.save(state, checkpoint_id=str(folder), process_group=group)
        saved = agree(time.perf_counter() - begin, dist.ReduceOp.MAX, group, device)
    except CheckpointException as e:  # raised on every rank of `group`, naming the ranks whose writes failed
        failed = [dist.get_global_rank(group, r) if group else r for r in sorted(e.failures)]
        first = next(iter(e.failures.values()))
        cause = str(first[0] if isinstance(first, tuple) else first).strip().splitlines()[0]
    verdicts = gather((failed, cause))  # a node's failure is every node's verdict: they go on together
    if failed := sorted({rank for ranks, _ in verdicts for rank in ranks}):
        cause = next(c for _, c in verdicts if c)
        checks = [Check("storage: write", f"the save failed on {rank_list(failed)} ({cause})",
                        "a DCP save of the job's state completes", FAIL, failed),
                  free_space_check(folder.parent, size, group, device)]
        remove(folder.parent if temporary else folder, group)
        return checks
    checks = [Check("storage: write", f"{size / saved / 1e9:.3g} GB/s: {size / GiB:.3g} GiB in {saved:.2f} s by "
                    f"{dist.get_world_size(group)} ranks (DCP), {where}", "a DCP save of the job's state completes",
                    PASS, [], {"bytes": size, "seconds": saved})]
    copy_back = {name: DTensor.from_local(torch.empty_like(t.to_local()), mesh, [Shard(0)], run_check=False,
                                          shape=t.shape, stride=t.stride()) for name, t in state.items()}
    dist.barrier(group=group)
    begin = time.perf_counter()
    dcp.load(copy_back, checkpoint_id=str(folder), process_group=group)
    loaded = agree(time.perf_counter() - begin, dist.ReduceOp.MAX, group, device)
    differ = [name for name in state if not torch.equal(state[name].to_local(), copy_back[name].to_local())]
    bad = [rank for rank, names in enumerate(gather(differ)) if names]
    text = f"{size / loaded / 1e9:.3g} GB/s: {size / GiB:.3g} GiB in {loaded:.2f} s" + (
        f"; {rank_list(bad)} read back other bits than they wrote" if bad else ", read back bitwise")
    checks.append(Check("storage: read", text, "what was written reads back bitwise", FAIL if bad else PASS, bad,
                        {"bytes": size, "seconds": loaded}))
    checks.append(free_space_check(folder.parent, size, group, device))
    remove(folder.parent if temporary else folder, group)
    return checks


def remove(folder: Path, group) -> None:
    dist.barrier(group=group)
    if dist.get_rank(group) == 0:
        shutil.rmtree(folder, ignore_errors=True)


def free_space_check(root: Path, size: int, group, device: torch.device) -> Check:
    """Room for two checkpoints: a save writes the next one beside the last complete one."""
    free = agree(shutil.disk_usage(root).free, dist.ReduceOp.MIN, group, device)
    result = FAIL if free < size else WARN if free < 2 * size else PASS
    return Check("storage: free space", f"{free / GiB:,.1f} GiB free, one checkpoint {size / GiB:.3g} GiB",
                 ">= 2 checkpoints (FAIL under 1)", result, [], {"free_bytes": free, "checkpoint_bytes": size})
