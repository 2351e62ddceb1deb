"""One optimizer step of the training loop, and what it does when a step goes wrong: a loss
spike (plait/stability.py: warned of, its update skipped, or the weights rolled back to the last
checkpoint's) or a non-finite loss or gradient
(plait/nonfinite.py: the step run again to name where it started, then the run stops).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from plait import float8, parallel
from plait.checkpoint.checkpointer import Checkpointer
from plait.config import JobConfig, grad_accumulation_steps
from plait.storage import job_folder
from plait.data import BatchLoader
from plait.expert_load import ExpertLoad, further_tokens, z_loss
from plait.metrics.logger import state_memory_gib
from plait.nonfinite import find_origin, report
from plait.optim.clipping import clip_and_norm
from plait.parallel import BatchLayout
from plait.parallel.replica_groups import ReplicaGroups
from plait.parallel.stages import microbatches
from plait.precision import TrainContexts
from plait.preemption import Preemption
from plait.stability import SpikeWatch, spike_line


class TrainingError(RuntimeError):
    """The run cannot continue (a non-finite loss or gradient); weights were not updated."""


def accumulate(model: torch.nn.Module, batches: list, contexts: TrainContexts, layout: BatchLayout,
               watch=None) -> torch.Tensor:
    """Forward and backward of every micro-batch, gradients scaled by 1/len(batches); returns
    the sum of the micro-batch losses. `watch` (plait/nonfinite.py) is told each micro-batch."""
    loss_sum = torch.zeros((), device=batches[0][0].device)
    for i, batch in enumerate(batches):
        if watch is not None:
            watch.micro_batch = i
        inputs, labels, attention = layout(*batch)
        # Reduce gradients once per step, after the last micro-batch, not after each one.
        # The context spans forward too: DDP decides in forward whether backward reduces.
        with parallel.gradient_sync(model, i == len(batches) - 1):
            with contexts.forward():
                loss = model(inputs, labels=labels, **attention)
            with contexts.backward():
                (loss / len(batches)).backward()
        # Under loss parallelism the loss is a replicated DTensor: every TP rank has it.
        loss_sum += loss.detach().to_local() if isinstance(loss, DTensor) else loss.detach()
    return loss_sum


class TrainStep:
    """One optimizer step: forward and backward of the step's batches, the loss averaged over every
    rank and group, the gradients clipped, then (where the replica groups commit, and the step is
    not a spike skipped or rolled back) the update."""

    def __init__(self, cfg: JobConfig, args, model: torch.nn.Module, pipeline, optimizer, scheduler,
                 loader: BatchLoader, layout: BatchLayout, contexts: TrainContexts, loss_mesh, replicas: ReplicaGroups,
                 checkpointer: Checkpointer, preemption: Preemption, spikes: SpikeWatch, device: torch.device):
        self.cfg, self.model, self.pipeline, self.optimizer, self.scheduler = cfg, model, pipeline, optimizer, scheduler
        self.loader, self.layout, self.contexts, self.loss_mesh = loader, layout, contexts, loss_mesh
        self.replicas, self.checkpointer, self.preemption, self.device = replicas, checkpointer, preemption, device
        self.spikes = spikes
        t, stages = cfg.training, pipeline.group if pipeline else None
        forwards = microbatches(cfg) if pipeline else grad_accumulation_steps(cfg)
        self.expert_load = ExpertLoad(model, args, forwards, t.moe_aux_loss_coef, t.moe_bias_rate,
                                      loss_mesh.get_group(), stages, t.moe_sequence_aux_coef)
        self.further = further_tokens(pipeline.predictor if pipeline else model, args, forwards, t.mtp_loss_weight,
                                      device, loss_mesh.get_group(), stages)
        self.z_loss = z_loss(pipeline.last if pipeline else model, t.z_loss, device, loss_mesh.get_group(), stages)
        self.forwards = forwards  # (a batch ramp changes it: plait/data/batch_schedule.py)
        self.state_gib = None  # AdamW's state, once it exists (after the first update)

    def __call__(self, step: int) -> tuple[dict, dict] | None:
        """The step's metrics (loss, grad_norm, lr; a spike's thresholds) and its experts'; None
        where a replica group failed during it (no update: the same batches come again)."""
        position = self.loader.state_dict()
        batches = [(inputs.to(self.device), labels.to(self.device)) for inputs, labels in self.loader.next_batches()]
        if not self.pipeline and len(batches) != self.forwards:
            self.forwards = len(batches)
            self.expert_load.set_forwards(self.forwards)
            self.further.set_forwards(self.forwards)
        loss_value = self.loss(batches)
        self.preemption.agree()
        grad_norm = self.clip()
        if not (math.isfinite(loss_value) and math.isfinite(grad_norm)):
            self.stop_at(step, batches, loss_value, grad_norm)
        lr = self.scheduler.get_last_lr()[0]
        if not self.replicas.commit():
            self.optimizer.zero_grad(set_to_none=True)
            self.loader.load_state_dict(position)
            return None
        values = {"loss": loss_value, "grad_norm": grad_norm}
        over = self.spikes.judge(values)
        policy = self.cfg.training.spike_policy if over else None
        updates = policy in (None, "warn")
        with self.contexts.optimizer():
            self.checkpointer.wait_for_staging()
            if updates:
                self.optimizer.step()
                if self.checkpointer.ema is not None:
                    self.checkpointer.ema.update()
                if self.state_gib is None:  # once: AdamW's state exists now, and gradients until zero_grad
                    self.state_gib = state_memory_gib(self.model, self.optimizer)
            self.optimizer.zero_grad(set_to_none=True)
            rolled_back = self.checkpointer.roll_back() if policy == "rollback" else None
            float8.precompute_scales(self.model, self.cfg)
        if over and dist.get_rank() == 0:
            print(spike_line(step, over, values, policy, rolled_back), flush=True)
        self.scheduler.step()
        spike = {f"{name}_spike_threshold": limit for name, limit in over.items()} | \
            ({} if updates else {"skipped": 1}) | \
            ({"rolled_back_to": int(rolled_back.name.removeprefix("step-"))} if rolled_back else {})
        return ({**values, "lr": lr, **spike},
                self.expert_load.step(move_biases=updates) | self.further.step() | self.z_loss.step())

    def clip(self) -> float:
        pipeline = self.pipeline
        return clip_and_norm(self.model, self.cfg.training.max_norm,
                             *((pipeline.group, pipeline.counted_elsewhere) if pipeline else ()))

    def loss(self, batches: list, watch=None) -> float:
        """Forward and backward of the step's batches; the loss, averaged over every rank and group."""
        if self.pipeline:  # one local batch: accumulation is the pipeline's micro-batching
            loss_sum = self.pipeline.step(*self.layout(*batches[0]))
            dist.all_reduce(loss_sum, group=self.pipeline.group)  # from the last stage to every rank
        else:
            loss_sum = accumulate(self.model, batches, self.contexts, self.layout, watch)
        dist.all_reduce(loss_sum, group=self.loss_mesh.get_group())
        self.replicas.average(loss_sum)
        return loss_sum.item() / (len(batches) * self.loss_mesh.size())  # (a pipeline's one local batch: its mean)

    def stop_at(self, step: int, batches: list, loss_value: float, grad_norm: float) -> None:
        """A non-finite loss or norm: the step again from the same weights, under hooks that name
        where it started (printed by rank 0, written beside the checkpoints or the metrics), then stop."""
        self.optimizer.zero_grad(set_to_none=True)
        rows = 0 if self.pipeline else len(batches[0][0])  # (a pipeline's micro-batches are its schedule's)
        findings = find_origin(self.model, lambda watch: self.loss(batches, watch), len(batches),
                               rows or sum(len(b[0]) for b in batches),
                               lambda row: self.loader.describe_row(row, self.layout.eos))
        line, _ = report(step, findings, job_folder(self.cfg))
        if dist.get_rank() == 0:
            print(line, flush=True)
        raise TrainingError(f"step {step}: loss {loss_value}, grad_norm {grad_norm} is not finite; "
                            f"stopped before the optimizer step, weights are from step {step - 1}")
