"""A dtype probe: which dtypes the matmuls and collectives of a training step really ran in.

It sits below autograd (a TorchDispatchMode), so it sees the ops that execute, including the
backward's and the communication ops of FSDP2 and DDP, not what the code meant to run. Tests
use it to prove the mixed-precision contract; `--debug.dtype_probe FILE` exposes it to users.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

ATEN_KINDS = {"mm": "matmul", "addmm": "matmul", "bmm": "matmul", "baddbmm": "matmul",
              "embedding": "embedding", "_log_softmax": "loss", "nll_loss_forward": "loss"}
ATTENTION_PREFIX = "_scaled_dot_product"


def op_kind(func) -> str | None:
    namespace, name = func.namespace, func._opname
    if namespace in ("c10d", "_c10d_functional"):
        return "collective"
    if namespace != "aten":
        return None
    if name.startswith(ATTENTION_PREFIX) and "backward" not in name:
        return "attention"
    return ATEN_KINDS.get(name)


class DtypeProbe(TorchDispatchMode):
    """Counts (phase, kind, op, input dtypes) for matmuls, attention, embedding, loss and collectives."""

    def __init__(self, contexts):
        super().__init__()
        self.contexts = contexts
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind = op_kind(func)
        if kind:
            dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in tree_leaves((args, kwargs))
                             if isinstance(t, torch.Tensor) and t.is_floating_point()})
            self.counts[(self.contexts.phase, kind, func._opname, ",".join(dtypes))] += 1
        return func(*args, **(kwargs or {}))

    def records(self) -> list[dict]:
        return [{"phase": phase, "kind": kind, "op": op, "dtypes": dtypes, "count": count}
                for (phase, kind, op, dtypes), count in sorted(self.counts.items())]

    def save(self, path: str, records: list[dict] | None = None) -> None:
        """Write `records` (default: this process's) as JSON."""
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.records() if records is None else records, indent=1))
