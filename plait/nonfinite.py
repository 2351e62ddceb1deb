"""Where a non-finite value starts. When a step's loss or gradient norm is inf or NaN, the step is
run again from the same weights and batches with a forward hook on every module: the first module
whose output holds a non-finite value is named (hooks run as forwards finish, so the innermost
module that made it comes first), with the micro-batch, the row and where that row was read
(source and token range). Gradients, where forward was finite: backward runs forward's order in
reverse, so of the parameters whose gradient is non-finite, the one whose module finished its
forward last is where backward first made one. Every rank runs it (the step's collectives need
them all); rank 0 writes the report.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _first_tensor(output):
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)):
        return next((t for t in map(_first_tensor, output) if t is not None), None)
    return None


class ForwardWatch:
    """Forward hooks on every module of `model` until closed; `found` the first non-finite output."""

    def __init__(self, model: nn.Module, rows_per_micro_batch: int):
        self.found, self.micro_batch, self.rows = None, 0, rows_per_micro_batch
        self.finished: dict[str, int] = {}  # each module's place in the order forwards first finished
        self.handles = [module.register_forward_hook(self._hook(name.removeprefix("module.") or "(the model)"))
                        for name, module in model.named_modules()]

    def _hook(self, name: str):
        def check(module, args, output):
            self.finished.setdefault(name, len(self.finished))
            t = _first_tensor(output)
            if self.found is not None or t is None or not t.is_floating_point():
                return
            value = _local(t.detach())
            bad = ~torch.isfinite(value)
            if bad.any():
                rows = bad.flatten(1).any(1).nonzero().flatten().tolist() \
                    if bad.dim() > 1 and bad.shape[0] == self.rows else None
                self.found = {"module": name, "micro_batch": self.micro_batch, "rows": rows,
                              "value": "NaN" if torch.isnan(value).any() else "inf"}
        return check

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def gradient_origin(model: nn.Module, finished: dict[str, int]) -> tuple[str | None, int]:
    """The parameter where backward first made a non-finite gradient, and how many parameters'
    gradients are non-finite on this rank. Backward runs forward's order in reverse: of the
    parameters with a non-finite gradient, the one whose module finished its forward last."""
    bad = [name.removeprefix("module.") for name, p in model.named_parameters()
           if p.grad is not None and not torch.isfinite(_local(p.grad)).all()]
    return max(bad, key=lambda name: finished.get(name.rpartition(".")[0], -1), default=None), len(bad)


def find_origin(model: nn.Module, rerun: Callable[[ForwardWatch], None], micro_batches: int, rows: int,
                describe_row: Callable[[int], str]) -> dict:
    """Run the step again under the hooks (`rerun(watch)` sets watch.micro_batch as it goes; `rows`
    per micro-batch, 0 where a row cannot be told); this rank's findings."""
    watch = ForwardWatch(model, rows)
    try:
        rerun(watch)
    finally:
        watch.close()
    found = watch.found
    if found is not None:
        first = found["micro_batch"] * rows
        found["read"] = [describe_row(first + r) for r in (found["rows"] if found["rows"] is not None
                                                            else range(rows))]
    parameter, count = gradient_origin(model, watch.finished)
    return {"rank": dist.get_rank(), "forward": found, "gradient": parameter, "nonfinite_gradients": count,
            "micro_batches": micro_batches}


def report(step: int, findings: dict, folder: Path) -> tuple[str, Path]:
    """Every rank's findings gathered to rank 0: the one line it prints, and the JSON it writes in `folder`."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, findings)
    path = folder / f"nonfinite-step-{step}.json"
    forward = next((f for f in gathered if f["forward"]), None)
    gradient = next((f for f in gathered if f["gradient"]), None)
    if forward:
        at = forward["forward"]
        rows = "row " + ", ".join(map(str, at["rows"])) if at["rows"] is not None else "rows"
        where = (f"the output of {at['module']} ({at['value']}; rank {forward['rank']}, micro-batch "
                 f"{at['micro_batch']}, {rows} read from {'; '.join(at['read'][:3])}"
                 f"{' ...' if len(at['read']) > 3 else ''})")
    else:
        where = "no module's output (forward ran finite again)"
    if not gradient:
        grads = "gradients: all finite on the re-run"
    elif forward:  # backward starts from a non-finite loss: every gradient it reaches follows from forward's
        grads = (f"gradients: non-finite from it ({gradient['nonfinite_gradients']} parameters on rank "
                 f"{gradient['rank']})")
    else:
        grads = (f"gradients: backward made the first non-finite one at {gradient['gradient']} (rank "
                 f"{gradient['rank']}; {gradient['nonfinite_gradients']} parameters non-finite there)")
    if dist.get_rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"step": step, "ranks": gathered}, indent=1))
    return f"plait: step {step}: the first non-finite value: {where}; {grads}; report {path}", path
