"""Mixed precision, decided in one place from one table, for every layout.

The precision a user asks for is the precision every layout runs, or the run refuses to start
and says which combination works instead. Nothing falls back silently (the bug this module
exists for: a trainer whose bf16 setting only reached FSDP runs, so DDP trained in fp32).

| dp_backend | mode     | parameters cast by                         | gradients reduced by                  |
|------------|----------|--------------------------------------------|---------------------------------------|
| fsdp2      | param    | fully_shard MixedPrecisionPolicy(param)    | fully_shard reduce_dtype              |
| fsdp2      | autocast | torch.autocast around forward + loss       | fully_shard reduce_dtype              |
| ddp        | param    | refused: DDP cannot cast at module borders | -                                     |
| ddp        | autocast | torch.autocast around forward + loss       | all-reduce (+ bf16 compression hook)  |
| simple_fsdp| param    | redistribute(forward_dtype=compute)        | redistribute(backward_dtype=reduce)   |
| simple_fsdp| autocast | torch.autocast around forward + loss       | redistribute(backward_dtype=reduce)   |
| one device | param    | each unit's cast on entry (`CastUnit`)     | nothing to reduce: fp32 .grad         |
| one device | autocast | torch.autocast around forward + loss       | nothing to reduce: fp32 .grad         |

"One device" is fsdp2 on a world of one rank with fp32 gradients (`Precision.one_device`): there
fully_shard would shard and reduce nothing, only copy every parameter into its all-gather buffer
and out, and every gradient likewise, each step (13% of a bf16 step on `small`). Its numbers are
fully_shard's at degree 1, to the bit: the same casts, gradients accumulated in fp32.

`training.float8` (tensorwise, rowwise, or MXFP8's mxfp8 and mxfp8_wgrad_hp) is one more column:
the blocks' linear layers (MXFP8: and the experts) multiply in float8 (torchao, `plait/float8.py`)
and everything else as the row says; fsdp2 and ddp run it (MXFP8: with mode param), simple_fsdp
refuses it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor.parallel import loss_parallel

from plait.config import ConfigError, JobConfig, replica_groups, world_size
from plait.float8 import check_float8
from plait.hardware import native_bf16, pick_device

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Precision:
    compute: torch.dtype  # dtype of matmuls
    reduce: torch.dtype  # dtype gradients travel and are reduced in
    mode: str  # "param" or "autocast"
    backend: str  # data-parallel implementation
    emulated: bool = False  # bf16 asked for on hardware without bf16 matmul units: it runs, slowly
    chosen_by: str = ""  # how `auto` picked the compute dtype, for the start-up line
    float8: str = "none"  # float8 recipe of the blocks' linear layers, or none
    world: int = 1  # ranks of the job (in every replica group)
    offload: bool = False  # fully_shard keeps the fp32 shards in host memory (`training.offload`)

    @property
    def one_device(self) -> bool:
        """No fully_shard (the table's "one device" rows): one rank, fsdp2, gradients kept in fp32.
        A reduce dtype other than fp32 keeps fully_shard, whose degree-1 reduction rounds them as asked.
        So does MXFP8: its weights are torchao's wrapper tensors, and a fresh compute-dtype copy of one
        as a leaf each step (what `CastUnit` makes) is never freed (torch 2.13, torchao 0.18: 0.17 GiB a
        step on `small`); fully_shard reuses one unsharded parameter. And so does offloading: fully_shard
        moves the parameters to the host."""
        return self.world == 1 and self.backend == "fsdp2" and self.reduce == torch.float32 and \
            not self.float8.startswith("mxfp8") and not self.offload

    @property
    def autocast(self) -> bool:
        return self.mode == "autocast" and self.compute != torch.float32

    def fsdp_policy(self) -> MixedPrecisionPolicy:
        """fully_shard's policy: casts parameters only in `param` mode; reduces in `reduce`.

        Forward inputs are not cast: activations are already in the compute dtype (they come
        out of bf16 layers), and casting would also round the fp32 RoPE table each block
        receives to bf16, a loss of precision no other backend has.
        """
        return MixedPrecisionPolicy(param_dtype=self.compute if self.mode == "param" else None,
                                    reduce_dtype=self.reduce, cast_forward_inputs=False)

    def offload_policy(self) -> OffloadPolicy:
        # (pinned host memory, which lets the copies overlap compute, needs an accelerator: a CPU, where
        # training refuses offloading, builds it unpinned for tests/test_init.py)
        return CPUOffloadPolicy(pin_memory=torch.accelerator.is_available()) if self.offload else OffloadPolicy()

    def mechanism(self) -> str:
        """One line for the start-up log: what enforces the dtypes in this run."""
        if self.backend == "ddp":
            cast = "torch.autocast(forward+loss)"
            hook = "bf16 compression comm hook" if self.reduce == torch.bfloat16 else "fp32 all-reduce"
            return f"DistributedDataParallel + {cast} + {hook}"
        if self.backend == "simple_fsdp":
            cast = "torch.autocast(forward+loss)" if self.mode == "autocast" else f"forward_dtype={_name(self.compute)}"
            return f"SimpleFSDP redistribute({cast}, backward_dtype={_name(self.reduce)})"
        if self.one_device:
            cast = "torch.autocast(forward+loss)" if self.autocast else \
                f"each block's (and the embedding's, norm's and output's) parameters cast to {_name(self.compute)} on " \
                "entry" if self.compute != torch.float32 else "no casts"
            return f"one device, no fully_shard (nothing to shard or reduce): {cast}, fp32 gradients"
        cast = "torch.autocast(forward+loss)" if self.mode == "autocast" else "fully_shard param_dtype cast"
        offload = " + CPUOffloadPolicy (fp32 shards, gradients, AdamW on the host)" * self.offload
        return f"fully_shard MixedPrecisionPolicy(param={_name(self.fsdp_policy().param_dtype)}, " \
               f"reduce={_name(self.reduce)}){offload} + {cast}"

    def describe(self) -> str:
        why = f" ({self.chosen_by})" if self.chosen_by else " (emulated: no bf16 matmul units here)" * self.emulated
        float8 = f" (blocks' linear layers: float8 {self.float8})" * (self.float8 != "none")
        return f"precision: compute {_name(self.compute)}{float8}{why}, reduce {_name(self.reduce)}, mode {self.mode} via {self.mechanism()}"


def _name(dtype: torch.dtype | None) -> str:
    return "float32" if dtype in (None, torch.float32) else str(dtype).removeprefix("torch.")


def resolve(cfg: JobConfig) -> Precision:
    """The table above as code: the run's precision, or a ConfigError naming what works instead.

    `auto` computes in bf16 where the device multiplies bf16 in hardware and in fp32 elsewhere;
    an explicit bfloat16 runs bf16 everywhere (what is asked is what runs), flagged as emulated
    where it is."""
    t, backend = cfg.training, cfg.parallelism.dp_backend
    if t.mixed_precision_param == "float16":
        raise ConfigError("training.mixed_precision_param: float16 needs dynamic loss scaling, which plait does "
                          "not implement; allowed: bfloat16 (same range as float32, no scaling needed), float32")
    device = pick_device(t.device)
    check_float8(cfg, device)
    native, why = native_bf16(device)
    compute = ("bfloat16" if native else "float32") if t.mixed_precision_param == "auto" else t.mixed_precision_param
    precision = Precision(DTYPES[compute], DTYPES[t.mixed_precision_reduce], t.mixed_precision_mode, backend,
                          emulated=compute == "bfloat16" and not native,
                          chosen_by=f"auto: {why}" if t.mixed_precision_param == "auto" else "", float8=t.float8,
                          world=world_size() * replica_groups(cfg), offload=t.offload != "none")
    if backend == "ddp" and precision.mode == "param" and precision.compute != torch.float32:
        raise ConfigError("training.mixed_precision_mode: param is not possible with parallelism.dp_backend ddp "
                          "(DistributedDataParallel cannot cast parameters at module boundaries); use "
                          "--training.mixed_precision_mode autocast, or --parallelism.dp_backend fsdp2 "
                          "(DDP as fully_shard on a replicate mesh)")
    return precision


class TrainContexts:
    """Separate contexts for forward (+loss) and backward.

    Loss parallelism (under TP) wraps both. Autocast wraps only the forward pass and the loss: backward ops already run in the dtype
    autocast chose for their forward, and autocast around backward is unsupported by PyTorch.
    The current phase is exposed for probes and profiler ranges.
    """

    def __init__(self, precision: Precision, device_type: str, compiled_autograd: bool = False,
                 loss_parallel: bool = False):
        self.precision, self.device_type, self.compiled_autograd = precision, device_type, compiled_autograd
        self.loss_parallel = loss_parallel
        self.phase = "step"  # between phases: the loss and grad-norm reductions

    @contextlib.contextmanager
    def _phase(self, name: str):
        # Restore the enclosing phase ("step" between phases), so phases may nest.
        outer, self.phase = self.phase, name
        try:
            with torch.profiler.record_function(name), contextlib.ExitStack() as stack:
                if self.loss_parallel and name in ("forward", "backward"):
                    # Cross-entropy on vocabulary-sharded logits; its backward needs the context too.
                    stack.enter_context(loss_parallel())
                yield
        finally:
            self.phase = outer

    @contextlib.contextmanager
    def forward(self):
        with self._phase("forward"), torch.autocast(self.device_type, self.precision.compute,
                                                    enabled=self.precision.autocast):
            yield

    @contextlib.contextmanager
    def backward(self):
        with self._phase("backward"), contextlib.ExitStack() as stack:
            if self.compiled_autograd:
                from torch._dynamo import compiled_autograd

                stack.enter_context(compiled_autograd._enable(torch.compile))
            yield

    def optimizer(self):
        return self._phase("optimizer")
