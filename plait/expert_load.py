"""The trainer's side of the losses a model adds to the gradient itself: mixture-of-experts
layers' (the auxiliary loss's scale, each step's expert load gathered from every rank: logged,
and what a sigmoid router's bias balances) and multi-token prediction's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from plait.models.moe import moe_layers
from plait.models.args import ModelArgs


class ExpertLoad:
    """Per step: the auxiliary loss (mean over MoE layers, micro-batches and data-parallel ranks,
    without its coefficient) and the fewest and most tokens any expert of any layer got in the
    global batch (balanced: tokens x top_k / n_experts each). A model without experts logs none."""

    def __init__(self, model: nn.Module, args: ModelArgs, forwards: int, coefficient: float, bias_rate: float,
                 group: dist.ProcessGroup, pp_group: dist.ProcessGroup | None, sequence_coefficient: float = 0.0):
        self.layers = moe_layers(model)  # this rank's (a pipeline stage holds some of them)
        if args.router != "softmax":  # a sigmoid router's loss is DeepSeek-V3's sequence-wise one, or none
            coefficient = sequence_coefficient
        self.enabled, self.aux = bool(args.n_experts), args.router == "softmax" or coefficient > 0
        # every MoE layer the coefficient's mean is over: multi-token prediction's block is one where
        # the model's blocks are (its routing is balanced as theirs, and aux_loss logs its records too)
        n_moe = sum(map(args.sparse, range(args.n_layers + args.mtp_layers)))
        # `group`: the data-parallel ranks x cp; cp ranks hold parts of one loss (plait/models/moe.py: aux_loss)
        self.bias_rate, self.group, self.pp_group = bias_rate, group, pp_group
        self.coefficient, self.n_moe = coefficient, n_moe
        self.set_forwards(forwards)

    def set_forwards(self, forwards: int) -> None:
        """Each micro-batch's share of the loss in a step of `forwards` micro-batches."""
        for layer in self.layers:
            # loss + coefficient x (the layers' mean), each micro-batch's share; the gradient average
            # divides by the cp ranks too, whose parts of the loss add up rather than average
            layer.aux_scale = self.coefficient * layer.sequence_ranks / (self.n_moe * forwards)

    @torch.no_grad()
    def step(self, move_biases: bool = True) -> dict:
        """Read (and reset) the step's counts from every rank; move sigmoid routers' biases (not in
        a step whose update is skipped)."""
        if not self.enabled:
            return {}
        device = self.layers[0].router.gate.weight.device if self.layers else torch.device("cpu")
        per_layer = [(torch.stack([c for c, _ in m.records]).sum(0), sum(a for _, a in m.records if a is not None))
                     for m in self.layers]
        loads = torch.stack([load for load, _ in per_layer]) if per_layer else torch.zeros(0, 1, device=device)
        # The aux loss's terms, and the layer forwards they are terms of, counted where they ran: a
        # cp rank's record is its part of one. Not from degrees a rank would read off its own layers:
        # under pipelining a stage may hold none (its blocks dense), and it logs too (rank 0).
        forwards = sum(len(m.records) / m.sequence_ranks for m in self.layers)
        aux = torch.stack([torch.as_tensor(sum(a for _, a in per_layer), dtype=torch.float32, device=device),
                           torch.tensor(forwards, dtype=torch.float32, device=device)])
        dist.all_reduce(loads, group=self.group)
        dist.all_reduce(aux, group=self.group)
        for layer, load in zip(self.layers, loads):
            if layer.router.bias is not None and move_biases:  # under the mean load: chosen more; over it: less
                layer.router.bias += self.bias_rate * torch.sign(load.float().mean() - load.float())
            layer.records.clear()
        big = torch.iinfo(torch.int64).max
        extremes = torch.stack([loads.min() if loads.numel() else torch.tensor(big, device=device),
                                -(loads.max() if loads.numel() else torch.tensor(0, device=device))])
        if self.pp_group is not None:
            dist.all_reduce(aux, group=self.pp_group)
            dist.all_reduce(extremes, op=dist.ReduceOp.MIN, group=self.pp_group)
        # the mean over MoE layers x micro-batches x data-parallel ranks (every rank's forwards, summed)
        return {**({"aux_loss": aux[0].item() / round(aux[1].item())} if self.aux else {}),
                "expert_load_min": int(extremes[0]), "expert_load_max": int(-extremes[1])}


class RecordedLoss:
    """A loss the model records at each training forward (0-d tensors in `records`; None: none
    on this rank), per step as metric `name`: the mean over micro-batches and data-parallel x cp
    ranks (each a mean over its own positions). Under a pipeline only the last stage records; the
    other ranks add nothing over `pp_group` and log what it measured."""

    def __init__(self, name: str, records: list | None, enabled: bool, device: torch.device,
                 group: dist.ProcessGroup, pp_group: dist.ProcessGroup | None = None, set_forwards=None):
        self.name, self.records, self.enabled = name, records, enabled
        self.device, self.group, self.pp_group = device, group, pp_group
        self.set_forwards = set_forwards or (lambda forwards: None)  # (a loss the model scales per micro-batch)

    @torch.no_grad()
    def step(self) -> dict:
        if not self.enabled:
            return {}
        records = self.records if self.records is not None else []
        total = torch.tensor([0.0, float(len(records))], device=self.device)
        if records:  # (under loss parallelism each a replicated DTensor)
            total[0] = torch.stack([r.full_tensor() if isinstance(r, DTensor) else r for r in records]).sum()
        dist.all_reduce(total, group=self.group)
        if self.pp_group is not None:
            dist.all_reduce(total, group=self.pp_group)
        records.clear()
        return {self.name: total[0].item() / total[1].item()}


def further_tokens(model: nn.Module | None, args: ModelArgs, forwards: int, weight: float, device: torch.device,
                   group: dist.ProcessGroup, pp_group: dist.ProcessGroup | None = None) -> RecordedLoss:
    """Multi-token prediction's side: its loss's weight, each micro-batch's share (the model adds
    it to the gradient: Transformer.predict_further), and per step its value `mtp_loss`. Under a
    pipeline `model` is the last stage's (None on the other ranks)."""
    model = getattr(model, "module", model)  # (classic DDP's wrapper)

    def set_forwards(forwards: int) -> None:
        if model is not None:
            model.mtp_scale = weight / forwards

    set_forwards(forwards)
    return RecordedLoss("mtp_loss", model.mtp_records if model is not None else None, args.mtp_layers > 0, device,
                        group, pp_group, set_forwards)


def z_loss(model: nn.Module | None, coefficient: float, device: torch.device, group: dist.ProcessGroup,
           pp_group: dist.ProcessGroup | None = None) -> RecordedLoss:
    """z-loss's term per step (`z_loss`, with its coefficient: what it adds to the loss), from the
    output layer's records (plait/models/loss.py). `model`: the last stage's under a pipeline."""
    model = getattr(model, "module", model)
    return RecordedLoss("z_loss", model.loss.z_records if model is not None else None, coefficient > 0, device,
                        group, pp_group)
