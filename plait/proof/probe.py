"""A probe of one training step: which dtypes its matmuls and collectives really ran in, and
how many bytes of activations its forward left alive for backward.

It sits below autograd (a TorchDispatchMode), so it sees the ops that execute, including the
backward's and the communication ops of FSDP2 and DDP, not what the code meant to run. Tests
use it to prove the mixed-precision contract and `plait plan`'s activation memory;
`--debug.dtype_probe FILE` exposes it to users.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

ATEN_KINDS = {"mm": "matmul", "addmm": "matmul", "bmm": "matmul", "baddbmm": "matmul", "_scaled_mm": "matmul",
              "_grouped_mm": "matmul",
              "embedding": "embedding", "_log_softmax": "loss", "nll_loss_forward": "loss", "logsumexp": "loss"}
ATTENTION_PREFIX = "_scaled_dot_product"


def op_kind(func) -> str | None:
    namespace, name = func.namespace, func._opname
    if namespace in ("c10d", "_c10d_functional"):
        return "collective"
    if namespace == "plait":  # (plait/models/expert_matmul.py: the experts' matmuls outside bf16)
        return "matmul"
    if namespace != "aten":
        return None
    if name.startswith(ATTENTION_PREFIX) and "backward" not in name:
        return "attention"
    return ATEN_KINDS.get(name)


def inner_tensors(tree) -> list[torch.Tensor]:
    """The plain tensors that hold the data of the tensors in `tree`: a wrapper subclass (a
    DTensor, torchao's float8 tensors) by its inner tensors (a float8 payload and its fp32 scale),
    not by the dtype it presents."""
    found = []
    for t in tree_leaves(tree):
        if is_traceable_wrapper_subclass(t):
            found += inner_tensors([getattr(t, name) for name in t.__tensor_flatten__()[0]])
        elif isinstance(t, torch.Tensor):
            found.append(t)
    return found


def _storages(tree) -> dict[int, torch.UntypedStorage]:
    """data_ptr -> storage of the tensors in `tree` (a DTensor's local tensor's)."""
    found = {}
    for t in tree_leaves(tree):
        if isinstance(t, torch.Tensor):
            try:
                storage = getattr(t, "_local_tensor", t).untyped_storage()
                if storage.nbytes():
                    found[storage.data_ptr()] = storage
            except RuntimeError:  # a wrapper without storage of its own (e.g. an async collective's)
                continue
    return found


def wrapper_class(tree):
    """The class of a non-DTensor wrapper subclass in `tree`, if any: torchao's float8 tensors (and
    functional collectives' async results, which wait, then run the op on what they hold)."""
    return next((type(t) for t in tree_leaves(tree) if is_traceable_wrapper_subclass(t) and not isinstance(t, DTensor)),
                None)


class SavedActivations:
    """The bytes of storage that forward ops allocated and that are still alive when backward
    begins: what autograd, checkpointing or a pipeline keeps for backward, however it
    keeps it (a saved-tensors hook would miss what checkpoint regions hold, which install their
    own). Parameters are excluded, gathered ones too: they are buffers, not activations."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.alive: dict[int, StorageWeakRef] = {}  # data_ptr -> storage created in a forward
        self.bytes = 0

    def created(self, args, out) -> None:
        inputs = _storages(args)
        for ptr, storage in _storages(out).items():
            if ptr not in inputs:  # views and in-place ops return storages that already existed
                self.alive[ptr] = StorageWeakRef(storage)

    def forget(self, tree) -> None:
        """`tree`'s storages are a collective's buffers, not activations."""
        for ptr in _storages(tree):
            self.alive.pop(ptr, None)

    def measure(self) -> None:
        # (A parameter by its inner tensors: FSDP2's float8 all-gather makes torchao tensors of them.)
        params = {ptr for m in self.model.modules() for p in m._parameters.values() if p is not None
                  for ptr in _storages(inner_tensors(p))}
        self.alive = {ptr: ref for ptr, ref in self.alive.items() if not ref.expired()}
        total = sum(torch.UntypedStorage._new_with_weak_ptr(ref.cdata).nbytes()
                    for ptr, ref in self.alive.items() if ptr not in params)
        self.bytes = total


class DtypeProbe(TorchDispatchMode):
    """Counts (phase, kind, op, input dtypes) for matmuls, attention, embedding, loss and
    collectives, and the activation bytes the step's forwards leave for its first backward."""

    def __init__(self, contexts, model: torch.nn.Module):
        super().__init__()
        self.contexts = contexts
        self.counts: Counter = Counter()
        self.saved = SavedActivations(model)
        self.measured = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if wrapper := wrapper_class((args, kwargs)):
            # Such a tensor's op is the subclass's own code, which runs the real ops (a float8 tensor's
            # casts and `_scaled_mm`): run it with the probe on, so those are what the probe records.
            with self:
                return wrapper.__torch_dispatch__(func, types, args, kwargs or {})
        phase = self.contexts.phase
        kind = op_kind(func)
        if kind:
            # (Under TP a float8 matmul arrives as a DTensor op: recorded by its float8 payload.)
            dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in inner_tensors((args, kwargs))
                             if t.is_floating_point()})
            self.counts[(phase, kind, func._opname, ",".join(dtypes))] += 1
        if phase == "backward" and not self.measured:
            # The step's first backward: every forward before it (one micro-batch, or a pipeline's
            # warm-up forwards) has left its activations, and none has been freed yet. Later
            # micro-batches repeat the first, and a pipeline's steady state holds no more.
            self.saved.measure()
            self.measured = True
        out = func(*args, **(kwargs or {}))
        if func._opname == "_to_copy" and out.dtype.itemsize == 1 and out.is_floating_point():
            # A cast to a float8 format: how float8 and MXFP8 quantise (emulated MXFP8's matmuls then
            # multiply the values cast back, in the compute dtype: the casts are its evidence).
            cast = f"{str(args[0].dtype).removeprefix('torch.')}->{str(out.dtype).removeprefix('torch.')}"
            self.counts[(phase, "quantize", func._opname, cast)] += 1
        if phase == "forward":
            self.saved.created((args, kwargs), out)
        if func._opname == "_allgather_base_":
            # FSDP2's all-gather into its flat buffer: FSDP2 may hold that buffer past the copy-out
            # (until its next all-gather), so whether it is alive when backward begins is timing
            self.saved.forget((args, kwargs))
        return out

    def records(self) -> list[dict]:
        counts = [{"phase": phase, "kind": kind, "op": op, "dtypes": dtypes, "count": count}
                  for (phase, kind, op, dtypes), count in sorted(self.counts.items())]
        saved = {"phase": "forward", "kind": "saved_activations", "op": "", "dtypes": "", "count": 1,
                 "bytes": self.saved.bytes}
        return [*counts, saved]

    def save(self, path: str, records: list[dict] | None = None) -> None:
        """Write `records` (default: this process's) as JSON."""
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.records() if records is None else records, indent=1))
