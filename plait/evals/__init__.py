"""Evaluation during training: validation losses and multiple-choice tasks, on the sharded model.

Everything a score depends on is prepared before any process group exists (task files read and
checked, every request tokenized), so a bad task file fails at start-up in one line. At an
evaluation each data-parallel rank forwards its share of the requests, micro_batch_size rows
at a time (a pipeline runs them through its schedule, context parallelism splits them as it
splits training sequences), and the per-request log-likelihoods are gathered: every
layout scores every request, and the same model gives the same scores in each.
"""

from __future__ import annotations

import math
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from tokenizers import Tokenizer
from torch.distributed.tensor import DTensor

from plait.config import ConfigError, Eval, JobConfig
from plait.data import open_source
from plait.evals.tasks import Request, Task, load_task, requests, scores
from plait.models.transformer import row_log_likelihoods


@dataclass
class Groups:
    """The process groups an evaluation gathers over: data-parallel ranks hold different
    requests, context-parallel ranks parts of the same ones (None: no cp)."""
    dp: dist.ProcessGroup
    loss: dist.ProcessGroup
    cp: dist.ProcessGroup | None


def open_loss_sets(cfg: JobConfig, tokenizer: Tokenizer, hf_start: Path | None) -> dict:
    """eval.loss_sets "NAME:PATH,..." -> {NAME: token source}, each holding the sequences of
    training.eval_steps global batches (checked here, before any process group)."""
    t, spec, sets = cfg.training, cfg.eval.loss_sets, {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, path = part.partition(":")
        if not re.fullmatch(r"[A-Za-z0-9_]+", name) or not path:
            raise ConfigError(f"eval.loss_sets: {part!r} is not NAME:PATH with a NAME of letters, digits and _ "
                              '(e.g. eval.loss_sets = "web:web_val.jsonl,code:code_tokens/")')
        if name in sets:
            raise ConfigError(f"eval.loss_sets: the name {name!r} is given twice")
        if not Path(path).exists():
            raise ConfigError(f"eval.loss_sets: {path!r} ({name}) does not exist")
        sets[name] = open_source(path, cfg.data, tokenizer, f"eval.loss_sets ({name})", hf_start=hf_start)
        check_holds_eval_steps(sets[name], f"eval.loss_sets: {name} ({path})", t)
    return sets


def eval_steps_held(source, t) -> int:
    """The global batches a validation source evaluates: training.eval_steps, or as many as it holds."""
    return min(t.eval_steps, (len(source) - 1) // t.seq_len // t.global_batch_size)


def check_holds_eval_steps(source, what: str, t) -> None:
    """A validation source holds one global batch at least (else one line); one that holds fewer
    than training.eval_steps is evaluated on those it holds, as one line says (rank 0)."""
    sequences = (len(source) - 1) // t.seq_len
    if not (held := eval_steps_held(source, t)):
        raise ConfigError(f"{what} has {sequences} sequences of training.seq_len={t.seq_len}, not even one global batch "
                          f"of {t.global_batch_size}: more validation text, or a smaller training.global_batch_size or "
                          "seq_len")
    if held < t.eval_steps and os.environ.get("RANK", "0") == "0":
        print(f"plait: {what} holds {held} of training.eval_steps {t.eval_steps} global batches ({sequences} sequences "
              f"of {t.seq_len} tokens): each evaluation measures those {held}", flush=True)


class TaskSuite:
    """eval.tasks, tokenized once at start-up into requests of at most training.seq_len inputs."""

    def __init__(self, e: Eval, seq_len: int, tokenizer: Tokenizer, eos: int, options: str = "eval.",
                 window_option: str = "training.seq_len"):
        """`options`: the prefix of the options' names in messages (`plait eval` has none)."""
        if e.limit < 0 or e.num_fewshot < 0:
            raise ConfigError(f"{options}limit, {options}num_fewshot: must be >= 0, got {e.limit}, {e.num_fewshot}")
        self.tasks: list[Task] = [load_task(spec, f"{options}tasks") for spec in dict.fromkeys(e.tasks)]
        if len({task.name for task in self.tasks}) < len(self.tasks):
            raise ConfigError(f"{options}tasks: two tasks share a name {[task.name for task in self.tasks]}: metrics "
                              "are named by the file's stem")
        self.requests = [requests(task, tokenizer, eos, seq_len, e.limit, e.num_fewshot, e.target_delimiter,
                                  e.fewshot_delimiter, options, window_option) for task in self.tasks]
        self.seq_len, self.pad = seq_len, eos

    def evaluate(self, forward, rows: int, device: torch.device, granule: int | None, dp_rank: int = 0, dp: int = 1,
                 group: dist.ProcessGroup | None = None) -> dict[str, float]:
        """Metrics eval_<task>_<score> and eval_acc (the tasks' mean acc)."""
        return self.metrics(self.log_likelihoods(forward, rows, device, granule, dp_rank, dp, group))

    def log_likelihoods(self, forward, rows: int, device: torch.device, granule: int | None, dp_rank: int = 0,
                        dp: int = 1, group: dist.ProcessGroup | None = None) -> list[list[float]]:
        """Each task's requests' log-likelihoods. `forward(inputs, labels)` -> each row's
        log-likelihood of its labelled tokens, on every rank that holds the row.

        The requests go longest first (as lm-evaluation-harness orders them), `rows` to a batch,
        every dp-th batch to this rank; a batch is as long as its longest request rounded up to
        a multiple of `granule` (what the layout's splits of a sequence need), or seq_len where
        `granule` is None (a pipeline: its stages exchange tensors of one shape)."""
        flat = [r for task_requests in self.requests for r in task_requests]
        order = sorted(range(len(flat)), key=lambda i: -len(flat[i].inputs))
        per_step = rows * dp
        steps = math.ceil(len(flat) / per_step)
        local = []
        for step in range(steps):
            share = [flat[i] for i in order[step * per_step + dp_rank * rows:][:rows]]
            longest = max((len(r.inputs) for r in share), default=1)
            length = self.seq_len if granule is None else min(self.seq_len, -(-longest // granule) * granule)
            inputs, labels = self.batch(share, rows, length)
            local.append(forward(inputs.to(device), labels.to(device)).double())
        local = torch.cat(local)
        gathered = [local]
        if dp > 1:
            gathered = [torch.empty_like(local) for _ in range(dp)]
            dist.all_gather(gathered, local, group=group)
        # sorted request j: step j // per_step, rank (j % per_step) // rows, row j % rows of that rank's batch
        in_order = torch.stack(gathered).view(dp, steps, rows).transpose(0, 1).reshape(-1).tolist()
        values = [0.0] * len(flat)
        for j, i in enumerate(order):
            values[i] = in_order[j]
        out, start = [], 0
        for task_requests in self.requests:
            out.append(values[start:start + len(task_requests)])
            start += len(task_requests)
        return out

    def metrics(self, log_likelihoods: list[list[float]]) -> dict[str, float]:
        metrics = {}
        for task, task_requests, values in zip(self.tasks, self.requests, log_likelihoods):
            metrics |= {f"eval_{task.name}_{name}": v for name, v in scores(task, task_requests, values).items()}
        metrics["eval_acc"] = sum(metrics[f"eval_{task.name}_acc"] for task in self.tasks) / len(self.tasks)
        return metrics

    def batch(self, share: list[Request], rows: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[rows, length] inputs padded with the end-of-text token (after a request: it cannot
        see them), and labels that are -100 (ignored) but at each request's choice tokens."""
        inputs = torch.full((rows, length), self.pad, dtype=torch.long)
        labels = torch.full((rows, length), -100, dtype=torch.long)
        for row, request in enumerate(share):
            n, c = len(request.inputs), len(request.targets)
            inputs[row, :n] = torch.tensor(request.inputs)
            labels[row, n - c:n] = torch.tensor(request.targets)
        return inputs, labels


def model_forward(model, pipeline, contexts, layout, groups: Groups):
    """`forward(inputs, labels)` for TaskSuite.evaluate in this run's layout, under the causal
    mask whatever the training's: a request is one text, as `plait eval` scores it (under the
    document mask an end-of-text token in a context would restart attention and RoPE there)."""
    layout = layout.causal()

    def forward(inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        inputs, labels, attention = layout(inputs, labels)
        with torch.no_grad():
            if pipeline:
                sums = pipeline.score(inputs, labels, attention)
                dist.all_reduce(sums, group=pipeline.group)  # from the last stage to every rank
            else:
                with contexts.forward():
                    sums = row_log_likelihoods(model(inputs, labels=labels, per_token=True, **attention))
                if isinstance(sums, DTensor):  # TP's loss parallelism: computed across the vocabulary shards
                    sums = sums.full_tensor()
        if groups.cp is not None:  # each cp rank summed its part of every row
            dist.all_reduce(sums, group=groups.cp)
        return sums

    return forward


def validation_loss(model, pipeline, batches: list, contexts, layout, loss_group) -> float:
    """The mean loss over the validation batches of every dp (x cp) rank, forward only.

    Every micro-batch's loss is gathered and summed exactly (math.fsum: one rounding at the end,
    so no summation order), so every layout that computes the same micro-batch losses reports
    the same number to the bit. A pipeline's micro-batch losses come divided by m, so the exact
    sum of a batch's m is its mean (exactly so for m a power of two)."""
    losses = []
    with torch.no_grad():
        for batch in batches:
            inputs, labels, attention = layout(*batch)
            if pipeline:  # one local batch per validation step, as in training
                loss = pipeline.evaluate(inputs, labels, attention)
                dist.all_reduce(loss, group=pipeline.group)  # from the last stage to every rank
            else:
                with contexts.forward():
                    loss = model(inputs, labels=labels, **attention)
                loss = (loss.to_local() if isinstance(loss, DTensor) else loss).reshape(1)
            losses.append(loss)
    local = torch.cat(losses).float()
    dp = dist.get_world_size(loss_group)
    gathered = [torch.empty_like(local) for _ in range(dp)]
    dist.all_gather(gathered, local, group=loss_group)
    return math.fsum(torch.cat(gathered).tolist()) / (len(batches) * dp)


class Evaluation:
    """A run's evaluations: the validation loss (data.val_path, every training.eval_interval
    steps), the named loss sets and the tasks (every eval.interval steps), and their time."""

    def __init__(self, cfg: JobConfig, val_batches: list | None, loss_sets: dict[str, list], suite: TaskSuite | None):
        self.cfg, self.val_batches, self.loss_sets, self.suite = cfg, val_batches, loss_sets, suite

    def run(self, step: int, model, pipeline, contexts, layout, groups: Groups, rows: int, dp_rank: int, dp: int,
            device: torch.device) -> dict[str, float]:
        """This step's evaluations (none: {}), and eval_time, their seconds."""
        t, e = self.cfg.training, self.cfg.eval
        last = step == t.steps
        metrics, start = {}, time.perf_counter()
        if self.val_batches and (step % t.eval_interval == 0 or last):
            metrics["val_loss"] = validation_loss(model, pipeline, self.val_batches, contexts, layout, groups.loss)
        if e.interval and (step % e.interval == 0 or last):
            for name, batches in self.loss_sets.items():
                metrics[f"val_loss_{name}"] = validation_loss(model, pipeline, batches, contexts, layout, groups.loss)
            if self.suite is not None:
                forward = model_forward(model, pipeline, contexts, layout, groups)
                p = self.cfg.parallelism
                # CP splits a sequence into 2 x cp chunks, sequence parallelism into tp parts
                granule = None if pipeline else math.lcm(8, 2 * p.cp, p.tp)
                metrics |= self.suite.evaluate(forward, rows, device, granule, dp_rank, dp, groups.dp)
        if metrics:
            metrics["eval_time"] = time.perf_counter() - start
        return metrics
