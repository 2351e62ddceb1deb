"""Per-step metrics: MFU against a known or measured peak, memory, console/JSONL/TensorBoard."""

from __future__ import annotations

import hashlib
import json
import resource
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from plait import storage
from plait.cache import cache_dir
from plait.hardware import Peak
from plait.jsonl import lines as jsonl_lines
from plait.metrics import summary as run_summary


class Utilisation:
    """MFU: the model's training FLOPs per second over the peak of the devices it ran on.

    The peak (plait.hardware) is a data sheet's or the fastest of the model's own linear layers
    (forward and backward), so a step can only reach it if every op ran at that speed: an MFU
    above 1 means the peak was measured at a bad moment (other processes on the cores). Then MFU is not reported (None) rather than
    wrong, and the cached peak is removed so the next run measures it again.
    """

    def __init__(self, flops_per_token: float, peak: Peak, devices: int):
        self.flops_per_token, self.peak, self.devices = flops_per_token, peak, devices
        self.trusted = peak.flops > 0

    def mfu(self, step: int, tokens_per_sec: float, flops_per_token: float | None = None) -> float | None:
        """`flops_per_token`: this step's, where its sequences are shorter (a sequence warm-up)."""
        if not self.trusted:
            return None
        value = (flops_per_token or self.flops_per_token) * tokens_per_sec / (self.peak.flops * self.devices)
        if value > 1:
            self.trusted = False
            print(f"plait: warning: step {step} ran at {100 * value:.0f}% of the {self.peak}: that peak was measured "
                  "too low, so MFU is not reported for this run, and the next run measures it again", flush=True)
            if self.peak.cache:
                self.peak.cache.unlink(missing_ok=True)
            return None
        return value


def peak_memory_gib(device: torch.device) -> float:
    """Peak accelerator memory allocated, or on CPU the process's peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def state_memory_gib(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> float:
    """GiB of parameters, gradients and optimizer state this rank holds, counting a DTensor's
    local shard only: exact where peak memory (activations, gathered parameters, allocator or
    RSS slack) blurs what sharding saves. Call it between the optimizer step and zero_grad,
    while gradients exist. Communication buffers (DDP's buckets, FSDP2's gather buffers) are
    workspace, not state, and are not counted."""
    tensors = [t for p in model.parameters() for t in (p, p.grad) if t is not None]
    tensors += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    with torch.no_grad():
        local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in local) / 2**30


class MetricsLogger:
    """Rank 0's sinks: a console line every `log_interval` steps (and at the first, the last and
    every evaluation), JSONL and TensorBoard every step. A line's tok/s and MFU are the means
    since the line before (one step's figure swings with what else the machine does), its ETA
    the remaining steps at that pace.

    A resumed run first drops the JSONL rows and TensorBoard events after the step it resumed
    from (the steps a crash lost, which it trains again), so each step is there exactly once.
    A JSONL (and plot) under a URL is written to a local copy in the cache and uploaded whole with
    every console line and at the end (an object store has no append); an upload that fails is
    said once per line and tried again at the next.
    """

    def __init__(self, jsonl: str, tensorboard: str, log_interval: int, resumed_step: int = 0, plot: str = "",
                 sinks: list = (), steps: int = 0):
        self.log_interval, self.plot = log_interval, plot
        self.sinks = list(sinks)  # more places rows go (plait.metrics.wandb_log.WandbRun): log, finish, close
        self.jsonl, self.remote = None, None
        if jsonl:
            path = storage.location(jsonl, "metrics.jsonl")
            if storage.is_remote(path):
                self.remote = path
                path = cache_dir() / f"metrics-{hashlib.sha256(jsonl.encode()).hexdigest()[:16]}" / path.name
            source = self.remote or path
            path.parent.mkdir(parents=True, exist_ok=True)
            kept = [line for _, line in (jsonl_lines(source, "metrics.jsonl") if source.exists() else [])
                    if json.loads(line)["step"] <= resumed_step]
            storage.write_atomically(path, "".join(line + "\n" for line in kept))
            self.jsonl = open(path, "a")
        self.writer = None
        if tensorboard:  # (imported here: tensorboard's import costs every other run ~0.2 s of start-up)
            from torch.utils.tensorboard import SummaryWriter

            from plait.metrics.tensorboard_events import drop_events_after

            drop_events_after(tensorboard, resumed_step)
            # purge_step: a TensorBoard already showing the folder forgets the steps dropped from it
            self.writer = SummaryWriter(tensorboard, purge_step=resumed_step + 1)
        self.steps = steps  # the run's last step: always printed, and what the ETA counts down to
        self.since_line = []  # (step_time, mfu, tokens) of the steps since the last printed line

    def log(self, row: dict) -> None:
        step = row["step"]
        tokens_per_step = row["tokens_per_sec"] * row["step_time"]  # (a growing run's steps differ: docs/growth.md)
        self.since_line.append((row["step_time"], row["mfu"], tokens_per_step))
        printed = step % self.log_interval == 0 or step in (1, self.steps) or "eval_time" in row
        if printed:
            tokens_per_sec, mean_mfu = run_summary.mean_speed(self.since_line)
            mfu = "  n/a " if mean_mfu is None else f"{100 * mean_mfu:5.2f}%"
            eta = round(max(0, self.steps - step) * tokens_per_step / tokens_per_sec)
            self.since_line = []
            val = f" | val_loss {row['val_loss']:.4f}" if "val_loss" in row else ""
            print(f"step {step:5d} | loss {row['loss']:.4f}{val} | grad_norm {row['grad_norm']:.3f} | lr {row['lr']:.2e}"
                  f" | {tokens_per_sec:8.0f} tok/s | mfu {mfu} | mem {row['memory_gib']:.2f} GiB"
                  + (f" | eta {eta // 3600}:{eta // 60 % 60:02d}:{eta % 60:02d}" if self.steps else ""), flush=True)
            if scores := run_summary.eval_scores(row):
                print(f"eval {step:5d} | {scores} | {row['eval_time']:.1f} s", flush=True)
        if self.jsonl:
            self.jsonl.write(json.dumps(row) + "\n")
            self.jsonl.flush()
            if printed:
                self.publish()
        if self.writer:
            for key, value in row.items():
                if key != "step" and value is not None:
                    self.writer.add_scalar(key, value, step)
        for sink in self.sinks:
            sink.log(row)

    def finish(self, summary: dict) -> None:
        """The end-of-run summary (plait.metrics.summary): printed, and written where the metrics go:
        `<jsonl name>.summary.json` next to the JSONL (whose rows stay one per step) and a text
        entry in TensorBoard. Every sink that reports the end of a run takes it from here."""
        for line in run_summary.lines(summary):
            print(line, flush=True)
        if self.jsonl:
            path = (self.remote or Path(self.jsonl.name)).with_suffix(".summary.json")
            self.publish(path, json.dumps(summary, indent=1) + "\n")
        if self.writer:
            self.writer.add_text("summary", "\n\n".join(run_summary.lines(summary)), summary["step"])
        for sink in self.sinks:
            sink.finish(summary)

    def publish(self, path=None, data: str | bytes | None = None) -> None:
        """`data` into `path` (by default the local JSONL into the URL it stands for, if any)."""
        path = path or self.remote
        if path is None:
            return
        data = data if data is not None else Path(self.jsonl.name).read_bytes()
        if not storage.is_remote(path):
            storage.write_atomically(path, data)
            return
        try:
            storage.write_atomically(path, data)
        except Exception as e:  # (a store down costs the upload, never the run: the local copy keeps the rows)
            print(f"plait: writing {path} failed ({storage.first_line(e)}); {Path(self.jsonl.name)} holds the "
                  "metrics (the JSONL is tried again at the next line)", flush=True)

    def close(self) -> None:
        if self.jsonl:
            self.jsonl.close()
            self.publish()
            if self.plot:  # also after a failure or a signal: the curves up to where the run stopped
                from plait.metrics.plot import plot_runs

                plot = storage.location(self.plot, "metrics.plot")
                local = Path(self.jsonl.name).with_suffix(".png") if storage.is_remote(plot) else plot
                plot_runs([Path(self.jsonl.name)], local)
                if local != plot:
                    self.publish(plot, local.read_bytes())
        if self.writer:
            self.writer.close()
        for sink in self.sinks:
            sink.close()
