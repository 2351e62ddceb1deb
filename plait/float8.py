"""Float8 training: torchao's recipes on the linear layers of the transformer blocks.

Float8 is a compute mode of the precision table, not a storage format: the master weights stay
fp32 (checkpoints, exports and optimizer state are those of a bf16 run), and each converted
layer casts its input, weight and output gradient to float8 just before its three matmuls
(`_scaled_mm`), with scales per tensor (`tensorwise`) or per row (`rowwise`). Everything else
(attention, norms, embedding, the output layer, the loss) runs in the compute dtype.

The output projection stays in the compute dtype: its logits go straight into the softmax, so
float8's 3-bit mantissa would be an error in every token's loss, and it is one layer of many
(torchao's and torchtitan's recipes leave it out too).

Under FSDP2 with `tensorwise`, parameters are all-gathered as float8 (one byte per element
instead of bf16's two): each shard is cast with the scale of the whole tensor (one all-reduce
of its amax) before the all-gather. gloo has no float8 type, so the float8 buffers travel as
uint8 views of the same bytes (`ByteAllGather`); the numbers are unchanged.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import logging
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather  # set_custom_all_gather's interface (no public path)

from plait.config import ConfigError, JobConfig
from plait.models.flavors import ModelArgs
from plait.models.transformer import Transformer

# _scaled_mm multiplies float8 matrices whose dimensions are multiples of 16 (CUDA's kernels need
# it; the CPU kernel accepts any shape, but a layer that could not run float8 on a GPU must not
# run it here either, so a run means the same on both).
MULTIPLE = 16


def available() -> bool:
    return importlib.util.find_spec("torchao") is not None


def native_float8(device: torch.device) -> tuple[bool, str]:
    """Whether `device` multiplies float8 in hardware, and why (for the start-up line)."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) >= (8, 9):
            return True, f"sm{major}{minor} has float8 tensor cores"
        return False, f"sm{major}{minor} has no float8 tensor cores (they need sm89+: L4, L40, H100, H200, B200)"
    return False, "this CPU has no float8 matmul units: torch's CPU _scaled_mm dequantises and multiplies in float32"


def check_float8(cfg: JobConfig, device: torch.device) -> None:
    """What the options and the device alone tell: the layout runs float8, or one line why not."""
    recipe, p = cfg.training.float8, cfg.parallelism
    if recipe == "none":
        return
    if not available():
        raise ConfigError("training.float8: needs torchao, which is not installed: pip install 'plait[float8]' "
                          "(or --training.float8 none)")
    if p.dp_backend == "simple_fsdp":
        raise ConfigError("training.float8: not with parallelism.dp_backend simple_fsdp (its parametrization "
                          "gathers weights in the compute dtype and would silently skip float8 all-gather); "
                          "allowed: fsdp2, ddp")
    if device.type == "cuda" and not native_float8(device)[0]:
        raise ConfigError(f"training.float8: {native_float8(device)[1]}; allowed here: none")


def layer_plan(args: ModelArgs, tp: int) -> dict[str, str]:
    """Every linear layer of the model -> "" if it runs float8, else why not. Under TP the shapes
    that count are each rank's (column-wise layers split their outputs, row-wise their inputs)."""
    with torch.device("meta"):
        model = Transformer(args)
    plan = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        rows, cols = module.out_features, module.in_features
        in_block = name.startswith("layers.") or ".block." in name  # (multi-token prediction's block too)
        if tp > 1 and in_block and ".shared." not in name:  # (shared experts: whole, as experts)
            rows, cols = (rows, cols // tp) if name.endswith(("wo", "w2")) else (rows // tp, cols)
        if not name.startswith(("layers.", "mtp.")):
            plan[name] = "the output layer stays in the compute dtype (its logits feed the softmax directly)"
        elif tp > 1 and not in_block:
            plan[name] = "multi-token prediction's projection under TP (a replicated weight) stays in the compute dtype"
        elif name.endswith("router.gate"):
            plan[name] = "a router scores in float32 (a rounded score flips near-tied choices of experts)"
        elif tp > 1 and args.kv_lora_rank and ".attention." in name:
            plan[name] = "latent attention under TP has its own plan (latents whole on each rank), not float8's"
        elif rows % MULTIPLE or cols % MULTIPLE:
            plan[name] = f"its {'per-rank ' * (tp > 1)}weight {rows}x{cols} is not a multiple of {MULTIPLE} in both dimensions"
        else:
            plan[name] = ""
    return plan


def check_layers(args: ModelArgs, cfg: JobConfig) -> None:
    """Refuse a float8 run in which no linear layer would run float8: it would silently be bf16."""
    if cfg.training.float8 == "none":
        return
    plan = layer_plan(args, cfg.parallelism.tp)
    if not any(why == "" for why in plan.values()):
        reasons = sorted({why for why in plan.values()})
        raise ConfigError(f"training.float8: no linear layer of this model can run float8 ({'; '.join(reasons)}); "
                          f"allowed: none")


def summary(args: ModelArgs, cfg: JobConfig, device: torch.device) -> str:
    """The start-up line: which layers run float8, which do not and why, native or emulated."""
    plan = layer_plan(args, cfg.parallelism.tp)
    converted = sum(why == "" for why in plan.values())
    kinds: dict[str, list[str]] = {}
    for name, why in plan.items():
        if why:
            kinds.setdefault(why, []).append(name)
    excluded = "; ".join(f"{len(names)} not ({', '.join(names[:3])}{', ...' * (len(names) > 3)}: {why})"
                         for why, names in kinds.items())
    native, why = native_float8(device)
    p = cfg.parallelism
    gather = "" if p.dp_shard * p.cp == 1 or p.dp_backend != "fsdp2" else \
        " | float8 all-gather of parameters" if fsdp_all_gather(cfg) else \
        " | parameters all-gathered in the compute dtype (float8 all-gather takes tensorwise scales)"
    experts = " | experts' grouped matmuls stay in the compute dtype (torch 2.13's float8 grouped matmul has no " \
              "CPU kernel)" if args.n_experts else ""
    return (f"float8 {cfg.training.float8}: {converted} of {len(plan)} linear layers run float8 matmuls"
            f"{'; ' + excluded if excluded else ''}{gather}{experts} | {'native' if native else 'emulated'}: {why}")


def fsdp_all_gather(cfg: JobConfig) -> bool:
    """Whether FSDP2 all-gathers the float8 weights themselves: tensorwise only, as in torchao (the
    row-wise recipe casts each weight along both axes, one per matmul, and a shard holds whole
    rows but not whole columns)."""
    p = cfg.parallelism
    return cfg.training.float8 == "tensorwise" and p.dp_backend == "fsdp2" and p.dp_shard * p.cp > 1


def _torchao_float8():
    """torchao.float8, imported quietly: on a CPU build its CUDA kernels "fail to load" (float8
    training does not use them) and it registers an enum torch 2.13 no longer needs registered."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        import torchao.float8

        return torchao.float8
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


@functools.cache
def _recipe(recipe: str, all_gather: bool):
    config = _torchao_float8().Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(config, enable_fsdp_float8_all_gather=True) if all_gather else config


def precompute_scales(model: nn.Module, cfg: JobConfig) -> None:
    """Under float8 all-gather, every converted weight's scale for the gathers to come, from its
    fp32 shards in one all-reduce (torchao's precompute): without it each gather all-reduces its
    own weight's amax first (`small`, FSDP2: 198 collectives a step, now 38; 37 without float8). Run
    after each optimizer step (the weights' only change) and once before the first."""
    if fsdp_all_gather(cfg):
        _torchao_float8().fsdp_utils.precompute_float8_dynamic_scale_for_fsdp(model)


def convert(model: nn.Module, cfg: JobConfig) -> None:
    """Swap the eligible linear layers of `model` (on the meta device, before any other plan) for
    torchao's Float8Linear, whose weights stay fp32 parameters under the same names."""
    eligible = {name for name, why in layer_plan(model.args, cfg.parallelism.tp).items() if why == ""}
    # A pipeline stage holds some blocks only; the names are those of the whole model.
    _torchao_float8().convert_to_float8_training(model, config=_recipe(cfg.training.float8, fsdp_all_gather(cfg)),
                               module_filter_fn=lambda module, name: name in eligible)


class ByteAllGather(AllGather):
    """FSDP2's all-gather, with float8 buffers sent as uint8 views of the same bytes (gloo has no
    float8 type; NCCL does, and moves the same bytes either way)."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False):
        if output_tensor.element_size() == 1 and output_tensor.is_floating_point():
            output_tensor, input_tensor = output_tensor.view(torch.uint8), input_tensor.view(torch.uint8)
        return dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


def slowdown(dtype: torch.dtype, shape: tuple[int, int, int], rounds: int = 3) -> float:
    """How many times slower a linear layer's training step (forward, input and weight gradient)
    runs in float8 than in `dtype` at (tokens, in, out) on the CPU: the start-up warning's number
    where float8 is emulated. Best of `rounds` each, after one warm-up call, on at most 256 tokens
    (a second or two even where `dtype` is an emulated bf16)."""
    tokens, inp, out = shape
    tokens = min(tokens, 256)
    x = torch.randn(tokens, inp, dtype=dtype, requires_grad=True)
    plain = nn.Sequential(nn.Linear(inp, out, bias=False, dtype=dtype))
    converted = nn.Sequential(nn.Linear(inp, out, bias=False, dtype=dtype))
    _torchao_float8().convert_to_float8_training(converted, config=_recipe("tensorwise", False))
    best = []
    for layer in (plain, converted):
        times = []
        for _ in range(rounds + 1):
            start = time.perf_counter()
            layer(x).sum().backward()
            times.append(time.perf_counter() - start)
        best.append(min(times[1:]))
    return best[1] / best[0]


def master_weights(state: dict) -> dict:
    """`state` with torchao's float8 weight wrappers (FSDP2's float8 all-gather) replaced by the
    fp32 tensors they wrap, sharing their storage: a checkpoint holds the master weights as any
    run's do (so a float8 run resumes under bf16 and back), never a pickled torchao class."""
    from torch.distributed.tensor import DTensor
    from torch.utils._pytree import tree_map

    wrapper = _torchao_float8().fsdp_utils.WeightWithDynamicFloat8CastTensor

    def unwrap(t):
        if isinstance(t, DTensor) and isinstance(t._local_tensor, wrapper):
            return DTensor.from_local(t._local_tensor._tensor, t.device_mesh, t.placements, run_check=False,
                                      shape=t.shape, stride=t.stride())
        return t._tensor if isinstance(t, wrapper) else t

    return tree_map(unwrap, state)
