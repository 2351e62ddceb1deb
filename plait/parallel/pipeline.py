"""Pipeline parallelism: the model cut into stages along its blocks, run by a schedule of
`torch.distributed.pipelining`, on the outermost mesh dimension `pp`.

A stage is the plain model with the other stages' blocks deleted, and without the embedding
(all but the first stage) or the final norm and output layer (all but the last), so every
parameter keeps the whole model's name: checkpoints, seed checkpoints and the Hugging Face
export move between pipelined and plain layouts unchanged. On each stage TP and FSDP2 apply as
to a whole model, and the weights are the same `(seed, name)` init as everywhere.

Gradient scaling is exactly that of accumulation: the schedule splits the local batch into m
micro-batches, each micro-batch's loss is divided by m inside the loss function, and the
schedule itself never rescales (`scale_grads=False`: its own division by m after every step
would turn any further accumulation into a moving average). Accumulation is the pipeline's own
micro-batching, so `training.micro_batch_size` stays the whole local batch. Which blocks each
stage holds, and the options' checks, are in `plait.parallel.stages` (no pipelining import:
every start-up checks them, and importing `torch.distributed.pipelining` costs 0.6 s).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                          ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble)
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from plait.config import JobConfig
from plait.models.args import ModelArgs
from plait.models.transformer import Transformer, row_log_likelihoods
from plait.models.moe import moe_layers
from plait.parallel import parallelize
from plait.parallel.stages import MULTI_STAGE, microbatches, split_blocks, stage_indices, stages_per_rank
from plait.precision import Precision, TrainContexts

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B,
             "interleaved_zb": ScheduleInterleavedZeroBubble, "zbv": ScheduleZBVZeroBubble}
def stage_model(args: ModelArgs, blocks: range, first: bool, last: bool) -> Transformer:
    """The plain model on the meta device with only one stage's parts, named as in the whole.
    Multi-token prediction runs on the last stage, which embeds token t+1 with a copy of the
    embedding: the same init, its gradient summed with the first stage's (`Pipeline`)."""
    with torch.device("meta"):
        model = Transformer(args)
    for i in range(args.n_layers):
        if i not in blocks:
            del model.layers[str(i)]
    if not first and not (last and args.mtp_layers):
        model.tok_embeddings = None
    if not last:
        model.norm = model.output = None
        model.mtp = nn.ModuleDict()
    return model


class Stage(PipelineStage):
    """A PipelineStage that runs its forward and backward in plait's phase contexts, as outside
    pipelining: autocast (in autocast mode) around each stage's forward only, never around the
    schedule's step, which runs backward too; the phase the probe and the profiler ranges record.

    Its forwards are the schedule's micro-batches (`forward_one_chunk`) and one more: torch
    forwards the stage outside the chunks to infer the shapes the stages send each other, at a
    process's first step (a resumed run's too) and again at the first step after each validation
    (switching between `eval` and `step` makes it infer anew), the later stages on uninitialised
    inputs. Mixtures of experts record that pass's routing as any forward's (plait/models/moe.py): the
    step would count it in its expert loads and auxiliary loss, and move sigmoid routers' biases
    by it (and z-loss's and MTP's terms would count it). So what they recorded in a run before the
    stage's first chunk is dropped there: shape
    inference is all a stage can run before it, whenever torch decides to run it. (Rather than a
    switch MoE.forward reads, which a compiled block guards on and would recompile for; shapes
    given to PipelineStage up front, which under TP are DTensor metadata torch infers best itself;
    or an override of torch's private inference methods, which a rename would silently bypass.)"""

    def __init__(self, *args, contexts: TrainContexts, **kwargs):
        super().__init__(*args, **kwargs)
        self.contexts = contexts
        self.experts = moe_layers(self.submod)
        # what forwards record (MoE layers' routing, multi-token prediction's and z-loss's terms)
        self.recorded = [*(moe.records for moe in self.experts), self.submod.mtp_records, self.submod.loss.z_records]
        self.recorded_before_run: list[int] | None = None  # each list's length when a run began

    def begin_run(self) -> None:
        self.recorded_before_run = [len(records) for records in self.recorded]

    def forward_one_chunk(self, *args, **kwargs):
        if self.recorded_before_run is not None:  # the run's first chunk: anything since is shape inference's
            for records, kept in zip(self.recorded, self.recorded_before_run):
                del records[kept:]
            self.recorded_before_run = None
        with self.contexts.forward():
            return super().forward_one_chunk(*args, **kwargs)

    def backward_one_chunk(self, *args, **kwargs):
        with self.contexts.backward():
            return super().backward_one_chunk(*args, **kwargs)

    def backward_weight_one_chunk(self, *args, **kwargs):
        with self.contexts.backward():
            return super().backward_weight_one_chunk(*args, **kwargs)

    def perform_reduce_grad(self, *args, **kwargs):
        # The data-parallel gradient reduction, after a stage's last backward chunk.
        with self.contexts.backward():
            return super().perform_reduce_grad(*args, **kwargs)


def embedding_pairs(mesh: DeviceMesh, last_stage: int):
    """The group of this rank and the rank that holds the other end of the pipeline (the first
    stage and the last, whose pp rank is `last_stage` mod pp) at the same place in the other
    dimensions; None on the ranks between. Every rank creates every pair's group, in one order."""
    pp = mesh["pp"].size()
    ends = mesh.mesh.reshape(pp, -1)[[0, last_stage % pp]].T.tolist()
    mine = None
    for pair in ends:
        group = dist.new_group(pair)
        if dist.get_rank() in pair:
            mine = group
    return mine


class StageParts(nn.Module):
    """This rank's stages as one module under the whole model's parameter names (the
    embedding, `layers.N`, norm, output), for the optimizer, clipping, checkpoints and init.
    The stage modules themselves are held in a plain list, so no name gains a prefix."""

    def __init__(self, parts: list[Transformer]):
        super().__init__()
        self.parts = parts
        self.layers = nn.ModuleDict()
        for part in parts:
            self.layers.update(part.layers)
            for name in ("tok_embeddings", "norm", "output"):
                if getattr(part, name) is not None:
                    setattr(self, name, getattr(part, name))
            if len(part.mtp):  # (the last stage's)
                self.mtp = part.mtp

    def reset_buffers(self) -> None:
        for part in self.parts:
            part.reset_buffers()


class Pipeline:
    """This rank's stages (`module`) and the schedule that runs them."""

    def __init__(self, args: ModelArgs, mesh: DeviceMesh, cfg: JobConfig, precision: Precision,
                 device: torch.device, contexts: TrainContexts):
        p = cfg.parallelism
        self.group, self.device = mesh["pp"].get_group(), device
        self.loss_parallel = p.tp > 1 and p.loss_parallel  # `contexts` must not enter it (no nesting)
        ranges = split_blocks(args.n_layers, p.pp * stages_per_rank(cfg), p.pp_split_points)
        indices = stage_indices(mesh["pp"].get_local_rank(), p.pp, stages_per_rank(cfg), p.pp_schedule)
        parts, stages = [], []
        for index in indices:
            part = stage_model(args, ranges[index], first=index == 0, last=index == len(ranges) - 1)
            parts.append(parallelize(part, mesh, cfg, precision, device, pipelined=True))
            stages.append(Stage(parts[-1], index, len(ranges), device, group=self.group, contexts=contexts))
        self.module, self.stages = StageParts(parts), stages
        self.has_first, self.has_last = 0 in indices, len(ranges) - 1 in indices
        self.last = parts[-1] if self.has_last else None  # (its loss's records: z-loss's, multi-token prediction's)
        self.predictor = self.last if args.mtp_layers else None
        # Multi-token prediction's copy of the embedding on the last stage: its gradient summed
        # with the first stage's in each pair of ranks that hold them, the same in both after; the
        # gradient norm counts it once (`counted_elsewhere`: the copy's).
        self.embedding_group = embedding_pairs(mesh, len(ranges) - 1) if args.mtp_layers else None
        self.counted_elsewhere = {parts[-1].tok_embeddings.weight} if self.predictor and not self.has_first else set()
        m = self.microbatches = microbatches(cfg)
        self.scoring = False  # score(): the schedule's "loss" is each row's log-likelihood

        # The last stage's output is its loss (it has the labels: `_run`), or each token's when scoring.
        def loss_fn(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            if self.scoring:
                sums = row_log_likelihoods(output)
                return sums.full_tensor() if isinstance(sums, DTensor) else sums
            loss = output / m
            # Under loss parallelism a replicated DTensor; the schedule gets its local value (the
            # whole loss on every TP rank), and to_local's backward makes the gradient a DTensor.
            return loss.to_local() if isinstance(loss, DTensor) else loss

        schedule = SCHEDULES[p.pp_schedule]
        self.schedule = schedule(stages if p.pp_schedule in MULTI_STAGE else stages[0], n_microbatches=m,
                                 loss_fn=loss_fn, scale_grads=False)
        self.summary = (f"pipeline {p.pp_schedule}: {len(ranges)} stages of blocks "
                        f"{' | '.join(f'{r.start}-{r.stop - 1}' for r in ranges)} (this rank: stages {indices}), "
                        f"{m} micro-batches of {cfg.training.micro_batch_size // m} sequences per step")

    def step(self, inputs: torch.Tensor, labels: torch.Tensor, attention: dict) -> torch.Tensor:
        """Forward and backward of one local batch in micro-batches: the sum of its micro-batch
        losses (each divided by m, so the batch's mean loss) on the last stage's ranks, else 0.
        `attention`: the model's positions and mask (BatchLayout), which every stage gets."""
        total = torch.zeros((), device=self.device)
        for loss in self._run(self.schedule.step, inputs, labels, attention):
            total += loss.detach()
        if self.embedding_group is not None:  # (the first and the last stage's ranks)
            grad = self.module.tok_embeddings.weight.grad
            dist.all_reduce(grad.to_local() if isinstance(grad, DTensor) else grad, group=self.embedding_group)
        return total

    def evaluate(self, inputs: torch.Tensor, labels: torch.Tensor, attention: dict) -> torch.Tensor:
        """Forward only: the m micro-batch losses, each divided by m, on the last stage's ranks, else zeros."""
        with torch.no_grad():
            losses = self._run(self.schedule.eval, inputs, labels, attention)
        return torch.stack(losses) if losses else torch.zeros(self.microbatches, device=self.device)

    def score(self, inputs: torch.Tensor, labels: torch.Tensor, attention: dict) -> torch.Tensor:
        """Forward only: each row's log-likelihood of its labelled tokens on the last stage's
        ranks, else zeros."""
        self.scoring = True
        try:
            with torch.no_grad():
                sums = self._run(self.schedule.eval, inputs, labels, attention)
        finally:
            self.scoring = False
        return torch.cat(sums) if sums else torch.zeros(len(inputs), dtype=torch.float64, device=self.device)

    def _run(self, run, inputs: torch.Tensor, labels: torch.Tensor, attention: dict) -> list[torch.Tensor]:
        losses: list[torch.Tensor] = []
        # The schedule splits `attention`'s tensors into micro-batches, as it splits the inputs,
        # and hands them to every stage (each stage's blocks attend).
        kwargs = {**attention, "labels": labels, "per_token": self.scoring,
                  **({"target": labels, "losses": losses, "return_outputs": False} if self.has_last else {})}
        # Loss parallelism around the whole step: at the first step the stages also run forward
        # and backward for shape inference, outside the chunk methods that enter the phases.
        for stage in self.stages:
            stage.begin_run()
        with loss_parallel() if self.loss_parallel else contextlib.nullcontext():
            run(*([inputs] if self.has_first else []), **kwargs)
        return losses
