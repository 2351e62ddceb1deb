"""Float8 training: torchao's recipes on the linear layers of the transformer blocks.

Float8 is a compute mode of the precision table, not a storage format: the master weights stay
fp32 (checkpoints, exports and optimizer state are those of a bf16 run), and each converted
layer casts its input, weight and output gradient to float8 just before its three matmuls
(`_scaled_mm`), with scales per tensor (`tensorwise`) or per row (`rowwise`). Everything else
(attention, norms, embedding, the output layer, the loss) runs in the compute dtype.

The output projection stays in the compute dtype: its logits go straight into the softmax, so
float8's 3-bit mantissa would be an error in every token's loss, and it is one layer of many
(torchao's and torchtitan's recipes leave it out too).

MXFP8 (`mxfp8`, Blackwell's format; `mxfp8_wgrad_hp` keeps the weight gradient's matmul in the
compute dtype) scales each run of 32 elements along a matmul's reduced dimension by a power of
two (e8m0), and covers the experts' grouped matmuls too: torchao's MXFP8 training tensor wraps
each converted weight and turns its matmuls into quantise-then-multiply. Native on sm100+;
elsewhere torchao's emulation casts to float8 and back and multiplies in the compute dtype, the
same numbers, slowly. FSDP2 gathers those weights in the compute dtype (as torchao does): MXFP8
scales are per block of the whole tensor's rows, which a shard does not hold.

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
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Shard
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather  # set_custom_all_gather's interface (no public path)

from plait.config import ConfigError, JobConfig
from plait.models.args import ModelArgs
from plait.models.moe import GroupedExperts
from plait.models.transformer import Transformer

# _scaled_mm multiplies float8 matrices whose dimensions are multiples of 16 (CUDA's kernels need
# it; the CPU kernel accepts any shape, but a layer that could not run float8 on a GPU must not
# run it here either, so a run means the same on both).
MULTIPLE = 16
# MXFP8 scales blocks of 32 elements along every dimension a matmul reduces: a weight's rows and
# columns, and (for the weight gradient) the tokens of a micro-batch.
MX_BLOCK = 32


def microscaling(recipe: str) -> bool:
    return recipe.startswith("mxfp8")


def native_mxfp8(device: torch.device) -> tuple[bool, str]:
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if major >= 10:
            return True, f"sm{major}{minor} has MXFP8 tensor cores"
        return False, f"sm{major}{minor} has no MXFP8 tensor cores (they need sm100+: B200, GB200, GB300)"
    return False, "this CPU has no MXFP8 matmul units: torchao's emulation casts and multiplies in the compute dtype"


def available() -> bool:
    return importlib.util.find_spec("torchao") is not None


def native_float8(device: torch.device) -> tuple[bool, str]:
    """Whether `device` multiplies float8 in hardware, and why (for the start-up line)."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) >= (8, 9):
            return True, f"sm{major}{minor} has float8 tensor cores"
        return False, f"sm{major}{minor} has no float8 tensor cores (they need sm89+: L4, L40, H100, H200, B200)"
    return False, "this CPU has no float8 matmul units: its matmuls dequantise and multiply in float32"


def native(recipe: str, device: torch.device) -> tuple[bool, str]:
    return native_mxfp8(device) if microscaling(recipe) else native_float8(device)


def check_float8(cfg: JobConfig, device: torch.device) -> None:
    """What the options and the device alone tell: the layout runs float8, or one line why not."""
    recipe, p, t = cfg.training.float8, cfg.parallelism, cfg.training
    if recipe == "none":
        return
    if not available():
        raise ConfigError("training.float8: needs torchao, which is not installed: pip install 'plait[float8]' "
                          "(or --training.float8 none)")
    if p.dp_backend == "simple_fsdp":
        raise ConfigError("training.float8: not with parallelism.dp_backend simple_fsdp (its parametrization "
                          "gathers weights in the compute dtype and would silently skip float8 all-gather); "
                          "allowed: fsdp2, ddp")
    if microscaling(recipe) and t.mixed_precision_mode == "autocast":
        raise ConfigError(f"training.float8: {recipe} needs training.mixed_precision_mode param (under autocast the "
                          "weights reach torchao's MXFP8 matmul in fp32 beside inputs in bf16); allowed: param")
    if device.type == "cuda" and not microscaling(recipe) and not native_float8(device)[0]:
        raise ConfigError(f"training.float8: {native_float8(device)[1]}; allowed here: none")


def check_tokens(cfg: JobConfig, tokens: int) -> None:
    """mxfp8 quantises the weight gradient's inputs along the tokens of a micro-batch on a rank."""
    if cfg.training.float8 == "mxfp8" and tokens % MX_BLOCK:
        raise ConfigError(f"training.float8: mxfp8's weight gradients reduce over a micro-batch's {tokens} tokens per "
                          f"rank, not a multiple of {MX_BLOCK}: change training.seq_len or micro_batch_size; allowed: "
                          "mxfp8_wgrad_hp (weight gradients in the compute dtype), none")


@functools.cache
def rank_shapes(args: ModelArgs, tp: int) -> dict[str, tuple[nn.Linear, int, int]]:
    """Every linear layer -> (the module, its weight's rows and columns on a rank): under TP,
    column-wise layers split their outputs, row-wise ones their inputs."""
    with torch.device("meta"):
        model = Transformer(args)
    shapes = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            rows, cols = module.out_features, module.in_features
            in_block = name.startswith("layers.") or ".block." in name  # (multi-token prediction's block too)
            if tp > 1 and in_block and ".shared" not in name:  # (shared experts and their gate: whole, as experts)
                rows, cols = (rows, cols // tp) if name.endswith(("wo", "w2")) else (rows // tp, cols)
            shapes[name] = module, rows, cols
    return shapes


@functools.cache  # (plan asks for every layout it searches; the answer is the shapes')
def layer_plan(args: ModelArgs, tp: int, recipe: str = "tensorwise") -> dict[str, str]:
    """Every linear layer of the model -> "" if it runs float8, else why not (the shapes that
    count are each rank's)."""
    multiple = MX_BLOCK if microscaling(recipe) else MULTIPLE
    plan = {}
    for name, (module, rows, cols) in rank_shapes(args, tp).items():
        in_block = name.startswith("layers.") or ".block." in name
        if not name.startswith(("layers.", "mtp.")):
            plan[name] = "the output layer stays in the compute dtype (its logits feed the softmax directly)"
        elif tp > 1 and not in_block:
            plan[name] = "multi-token prediction's projection under TP (a replicated weight) stays in the compute dtype"
        elif name.endswith("router.gate"):
            plan[name] = "a router scores in float32 (a rounded score flips near-tied choices of experts)"
        elif tp > 1 and args.kv_lora_rank and ".attention." in name:
            plan[name] = "latent attention under TP has its own plan (latents whole on each rank), not float8's"
        elif microscaling(recipe) and module.bias is not None:
            plan[name] = "torchao 0.18's MXFP8 linear would drop its bias"
        elif rows % multiple or cols % multiple:
            plan[name] = (f"its {'per-rank ' * (tp > 1)}weight {rows}x{cols} is not a multiple of {multiple} in both "
                          "dimensions")
        else:
            plan[name] = ""
    return plan


def quantised_bytes(args: ModelArgs, cfg: JobConfig, tokens: int) -> int:
    """MXFP8's copies of the largest converted matmul, alive at once in its backward (plan's
    buffers): the output gradient cast along both axes, the weight and the input along the other
    (the forward's casts are freed by then), one byte per element and one e8m0 scale per 32."""
    p = cfg.parallelism
    if not microscaling(cfg.training.float8):
        return 0
    plan, shapes = layer_plan(args, p.tp, cfg.training.float8), rank_shapes(args, p.tp)
    sizes = [tokens * (2 * rows + cols) + rows * cols for name, (_, rows, cols) in shapes.items() if not plan[name]]
    if args.n_experts and not any(expert_plan(args, cfg.training.float8, torch.device("cpu"), torch.bfloat16).values()):
        routed, experts = tokens * args.top_k, args.n_experts // p.ep  # (bf16 on a GPU: what plan assumes)
        sizes.append(routed * (2 * args.dim + args.moe_hidden) + experts * args.dim * args.moe_hidden)
    return max(sizes, default=0) * (MX_BLOCK + 1) // MX_BLOCK


def compute_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def expert_plan(args: ModelArgs, recipe: str, device: torch.device, compute: torch.dtype) -> dict[str, str]:
    """Every mixture-of-experts layer's grouped experts -> "" if their matmuls run `recipe`, else why not."""
    if not args.n_experts:
        return {}
    kind, multiple = ("MXFP8", MX_BLOCK) if microscaling(recipe) else ("float8", MULTIPLE)
    if kind == "float8" and not (device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)):
        why = "torchao's float8 grouped matmul needs CUDA sm90+ (its scales are triton kernels)"
    elif compute != torch.bfloat16:
        why = f"torchao's {kind} grouped matmul multiplies in bfloat16 only (compute dtype: {compute_name(compute)})"
    elif args.dim % multiple or args.moe_hidden % multiple:
        why = f"their weights {args.moe_hidden}x{args.dim} are not a multiple of {multiple} in both dimensions"
    else:
        why = ""
    with torch.device("meta"):
        model = Transformer(args)
    return {name: why for name, module in model.named_modules() if isinstance(module, GroupedExperts)}


def check_layers(args: ModelArgs, cfg: JobConfig, device: torch.device, compute: torch.dtype) -> None:
    """Refuse a float8 run in which no matmul would run float8 (it would silently be bf16), and
    compiled experts in torchao's weight wrapper (torch 2.13's AOTAutograd fails on the MoE
    block's compiled pieces: "expected a MXFP8TrainingWeightWrapperTensor tangent")."""
    if cfg.training.float8 == "none":
        return
    experts = expert_plan(args, cfg.training.float8, device, compute)
    plan = {**layer_plan(args, cfg.parallelism.tp, cfg.training.float8), **experts}
    if not any(why == "" for why in plan.values()):
        reasons = sorted({why for why in plan.values()})
        raise ConfigError(f"training.float8: no linear layer of this model can run float8 ({'; '.join(reasons)}); "
                          f"allowed: none")
    if cfg.compile.enable and experts and not any(experts.values()):
        raise ConfigError(f"compile.enable: not with the experts' grouped matmuls in {cfg.training.float8} (torch "
                          "2.13 cannot compile the MoE block around torchao's weight wrapper); allowed: "
                          "--compile.no_enable, or a float8 recipe that leaves the experts in the compute dtype")


def summary(args: ModelArgs, cfg: JobConfig, device: torch.device, compute: torch.dtype) -> str:
    """The start-up line: which layers run float8, which do not and why, native or emulated."""
    recipe = cfg.training.float8
    plan, experts = layer_plan(args, cfg.parallelism.tp, recipe), expert_plan(args, recipe, device, compute)
    converted = sum(why == "" for why in plan.values())
    kinds: dict[str, list[str]] = {}
    for name, why in plan.items():
        if why:
            kinds.setdefault(why, []).append(name)
    excluded = "; ".join(f"{len(names)} not ({', '.join(names[:3])}{', ...' * (len(names) > 3)}: {why})"
                         for why, names in kinds.items())
    native_here, why = native(recipe, device)
    p = cfg.parallelism
    gather = "" if p.dp_shard * p.cp == 1 or p.dp_backend != "fsdp2" else \
        " | float8 all-gather of parameters" if fsdp_all_gather(cfg) else \
        " | parameters all-gathered in the compute dtype (float8 all-gather takes tensorwise scales)"
    kind = "MXFP8" if microscaling(recipe) else "float8"
    why_not = next((why for why in experts.values() if why), "")
    grouped = "" if not experts else \
        f" | the experts' grouped matmuls stay in the compute dtype ({why_not})" if why_not else \
        f" | the experts' grouped matmuls of {len(experts)} layers run {kind}{' rowwise' * (kind == 'float8')}"
    return (f"float8 {recipe}: {converted} of {len(plan)} linear layers run {kind} matmuls"
            f"{'; ' + excluded if excluded else ''}{gather}{grouped} | {'native' if native_here else 'emulated'}: "
            f"{why}")


def fsdp_all_gather(cfg: JobConfig) -> bool:
    """Whether FSDP2 all-gathers the float8 weights themselves: tensorwise only, as in torchao (the
    row-wise recipe casts each weight along both axes, one per matmul, and a shard holds whole
    rows but not whole columns)."""
    p = cfg.parallelism
    return cfg.training.float8 == "tensorwise" and p.dp_backend == "fsdp2" and p.dp_shard * p.cp > 1


def _torchao(module: str):
    """A torchao module, imported quietly: on a CPU build its CUDA kernels "fail to load" (float8
    training does not use them) and it registers enums torch 2.13 no longer needs registered."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        return importlib.import_module(module)
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


@functools.cache
def _recipe(recipe: str, all_gather: bool, device_type: str = "cpu", probed: bool = False):
    """torchao's config of `recipe`. Where float8 is emulated, tensorwise matmuls dequantise and
    multiply in fp32 (torchao's `emulate`): CPU _scaled_mm's values within fp32 summation order
    (2.4e-7 relative, tests/test_float8.py), far faster (256 x 768 x 768 forward and backward: 0.58 s
    vs 0.14 s on an AVX2 CPU; a forward 4.7 s vs 4.6 ms on an AMX Xeon). Under debug.dtype_probe
    (`probed`) _scaled_mm runs, as on a GPU, for the probe to record. Rowwise keeps _scaled_mm:
    torchao's emulation of it is 3e-3 apart (its row scales not applied as the kernel applies them)."""
    config = _torchao("torchao.float8").Float8LinearConfig.from_recipe_name(recipe)
    emulate = recipe == "tensorwise" and not probed and not native_float8(torch.device(device_type))[0]
    return dataclasses.replace(config, enable_fsdp_float8_all_gather=all_gather, emulate=emulate)


def precompute_scales(model: nn.Module, cfg: JobConfig) -> None:
    """Under float8 all-gather, every converted weight's scale for the gathers to come, from its
    fp32 shards in one all-reduce (torchao's precompute): without it each gather all-reduces its
    own weight's amax first (`small`, FSDP2: 198 collectives a step, now 38; 37 without float8). Run
    after each optimizer step (the weights' only change) and once before the first."""
    if fsdp_all_gather(cfg):
        _torchao("torchao.float8").fsdp_utils.precompute_float8_dynamic_scale_for_fsdp(model)


def training_config(recipe: str, compute: torch.dtype, device: torch.device):
    """torchao's config for the weights it wraps: MXFP8's recipe (emulated where not native), or
    for float8 recipes the experts' (float8 rowwise grouped matmuls); results in `compute`."""
    config = _torchao("torchao.prototype.moe_training.config")
    if not microscaling(recipe):
        return config.Float8TrainingOpConfig(out_dtype=compute)
    name = "MXFP8_RCEIL_WGRAD_WITH_HP" if recipe == "mxfp8_wgrad_hp" else "MXFP8_RCEIL"
    native_here = native_mxfp8(device)[0]
    # Each expert's tokens padded to whole blocks of 32: the experts' weight gradients reduce over
    # them (a block straddling two experts would not even be one expert's), and a block then
    # starts at each expert's first token in every layout, EP or not.
    return dataclasses.replace(config.MXFP8TrainingOpConfig.from_recipe(config.MXFP8TrainingRecipe[name]),
                               kernel_preference=config.KernelPreference["AUTO" if native_here else "EMULATED"],
                               out_dtype=compute, pad_token_groups_for_grouped_mm=True)


def convert(model: nn.Module, cfg: JobConfig, compute: torch.dtype, device: torch.device) -> None:
    """Convert `model`'s eligible layers (on the meta device, before any other plan): float8
    recipes swap linear layers for torchao's Float8Linear; MXFP8 (and float8 experts) wrap the
    weights in torchao's training tensor. Either way the weights stay fp32 parameters under the
    same names."""
    recipe = cfg.training.float8
    # A pipeline stage holds some blocks only; the names are those of the whole model.
    linear = {name for name, why in layer_plan(model.args, cfg.parallelism.tp, recipe).items() if not why}
    wrapped = {name for name, why in expert_plan(model.args, recipe, device, compute).items() if not why}
    if microscaling(recipe):
        wrapped |= linear
        if cfg.parallelism.tp > 1:
            for name in linear:
                model.get_submodule(name).__class__ = ShardLocalLinear
    else:
        _torchao("torchao.float8").convert_to_float8_training(
            model, config=_recipe(recipe, fsdp_all_gather(cfg), device.type, bool(cfg.debug.dtype_probe)),
            module_filter_fn=lambda module, name: name in linear)
    if wrapped:
        _torchao("torchao.quantization").quantize_(model, training_config(recipe, compute, device),
                                                   filter_fn=lambda module, name: name in wrapped)


class ShardLocalLinear(nn.Linear):
    """An MXFP8 linear layer under TP: its matmul runs on the rank's shards as plain tensors,
    where torchao's MXFP8 weight intercepts it. Given DTensors, DTensor's dispatch would run the
    matmul on the weight it wraps, in the compute dtype: silently (measured: TP2's loss was the
    run's without float8). Column-wise layers (weight Shard(0)) take the whole input and give
    their outputs' shard; row-wise ones (Shard(1)) their inputs' shard and a partial sum, which
    the layer's output layout then reduces, as DTensor's matmul would."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if not isinstance(weight, DTensor):  # (FSDP2 alone: the gathered weight is a plain tensor)
            return super().forward(x)
        column = weight.placements[-1] == Shard(0)
        # (a column-wise layer's input is whole on every rank; each rank's gradient of it is partial)
        y = F.linear(x.to_local(grad_placements=[Partial()] if column else None), weight.to_local())
        return DTensor.from_local(y, weight.device_mesh, [Shard(y.ndim - 1) if column else Partial()],
                                  run_check=False)


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


def slowdown(recipe: str, dtype: torch.dtype, shape: tuple[int, int, int], rounds: int = 3) -> float:
    """How many times slower a linear layer's training step (forward, input and weight gradient)
    runs in `recipe` than in `dtype` at (tokens, in, out) on the CPU: the start-up warning's number
    where float8 is emulated. Best of `rounds` each, after one warm-up call, on at most 256 tokens
    (a second or two even where `dtype` is an emulated bf16)."""
    tokens, inp, out = shape
    tokens = min(tokens, 256)
    x, grad = torch.randn(tokens, inp, dtype=dtype, requires_grad=True), torch.randn(tokens, out, dtype=dtype)
    plain = nn.Sequential(nn.Linear(inp, out, bias=False, dtype=dtype))
    converted = nn.Sequential(nn.Linear(inp, out, bias=False, dtype=dtype))
    if microscaling(recipe):
        _torchao("torchao.quantization").quantize_(converted, training_config(recipe, dtype, torch.device("cpu")),
                                                   filter_fn=lambda module, name: isinstance(module, nn.Linear))
    else:
        _torchao("torchao.float8").convert_to_float8_training(converted, config=_recipe(recipe, False))
    best = []
    for layer in (plain, converted):
        times = []
        for _ in range(rounds + 1):
            start = time.perf_counter()
            layer(x).backward(grad)
            times.append(time.perf_counter() - start)
        best.append(min(times[1:]))
    return best[1] / best[0]


def master_weights(state: dict) -> dict:
    """`state` with torchao's weight wrappers (FSDP2's float8 all-gather, MXFP8's and the float8
    experts' training tensors) replaced by the fp32 tensors they wrap, sharing their storage: a
    checkpoint holds the master weights as any run's do (so a float8 run resumes under bf16 and
    back), never a pickled torchao class."""
    from torch.utils._pytree import tree_map

    inner = {_torchao("torchao.float8").fsdp_utils.WeightWithDynamicFloat8CastTensor: "_tensor",
             _torchao("torchao.prototype.moe_training.tensor").TrainingWeightWrapperBaseTensor: "_data"}

    def plain(t):
        name = next((name for cls, name in inner.items() if isinstance(t, cls)), None)
        return t if name is None else getattr(t, name)

    def unwrap(t):
        if isinstance(t, DTensor) and plain(t._local_tensor) is not t._local_tensor:
            return DTensor.from_local(plain(t._local_tensor), t.device_mesh, t.placements, run_check=False,
                                      shape=t.shape, stride=t.stride())
        return plain(t)

    return tree_map(unwrap, state)
