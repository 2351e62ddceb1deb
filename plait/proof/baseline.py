"""The plainest PyTorch training loops of plait's model shape: the yardsticks for plait's overhead.

`plait bench` runs them as its `raw_pytorch`, `transformers` and `raw_fsdp2` rows, each in a
process of its own like every other row. No plait machinery in the loop: random token batches of
the shape plait trains on, AdamW with plait's hyper-parameters and gradient clipping
(`clip_grad_norm_`), and bf16 the standard PyTorch way. Host memory is kept as plait keeps it
(`--host_memory`), so a row's ratio to plait's measures plait's code, not glibc's defaults.

- One process: plait's `Transformer(model_args(flavor, vocab))`, or with `--model transformers`
  transformers' model of the same config.json (`LlamaForCausalLM` for the Llama flavors), the
  whole batch in one forward, `torch.autocast` around forward + loss with fp32 parameters.
- Under torchrun (WORLD_SIZE > 1): plait's model with `fully_shard` on each block and on the
  model, `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)` for bf16 (as torchtitan
  does), each rank forwarding batch_size / world sequences.

`--compile` compiles each block (`module.compile()`), as plait's `--compile.enable` compiles
each block's forward. Prints one JSON line per step (rank 0) with the keys of plait's metrics
rows that the bench reads.

    python -m plait.proof.baseline --flavor small --dtype bfloat16 --steps 6
    torchrun --nproc-per-node 2 -m plait.proof.baseline --flavor small --dtype bfloat16
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
import tyro
from torch import nn

from plait import host_memory
from plait.config import Data, Training
from plait.data import build_tokenizer, eos_id
from plait.flavor_names import Flavor
from plait.hardware import linear_shapes, peak_flops
from plait.models.masking import document_ids, positions_in_documents
from plait.metrics.logger import Utilisation, peak_memory_gib, state_memory_gib
from plait.models.transformer import Transformer, flops_per_token, linear_weight_shapes
from plait.models.flavors import model_args


@dataclass
class BaselineConfig:
    flavor: Flavor = "debug"
    steps: int = 6
    seq_len: int = 256
    batch_size: int = 8
    """sequences per step (over all ranks)"""
    dtype: Literal["float32", "bfloat16"] = "bfloat16"
    """bfloat16: autocast around forward + loss on one process, fully_shard's param_dtype under torchrun;
    parameters, gradients and AdamW stay fp32"""
    threads: int = 0
    """CPU threads per rank; 0 = the cores / local ranks, as plait takes"""
    attention_mask: Literal["causal", "document"] = "causal"
    """as plait's model.attention_mask: document passes the model each token's positions and mask (plait's model only)"""
    model: Literal["plait", "transformers"] = "plait"
    """plait's Transformer, or transformers' model of the flavor's config.json (one process, causal mask)"""
    compile: bool = False
    """compile each block (transformers': each decoder layer)"""
    host_memory: Literal["auto", "retain", "release"] = "auto"
    """as plait's training.host_memory (auto = retain on a CPU), so that the loops and plait differ by
    plait's code alone: with glibc's default, debug's bf16 loop ran 26% slower here (its logits
    mapped afresh each step)"""


def transformers_model(args) -> nn.Module:
    """transformers' model of plait's `args`, from the config.json plait's exporter writes: the
    same shapes, built and initialised by transformers, attention through SDPA as plait's."""
    import transformers

    from plait.hf.config import hf_config

    config = hf_config(args, torch.float32, None, None)
    config = transformers.AutoConfig.for_model(config.pop("model_type"), **config)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def build(cfg: BaselineConfig, args, device: torch.device, world: int) -> tuple[nn.Module, list[nn.Module]]:
    """The model on `device` and its blocks."""
    if cfg.model == "transformers":
        with torch.device(device):
            model = transformers_model(args)
        return model, list(model.model.layers)
    with torch.device(device):
        model = Transformer(args)
    blocks = list(model.layers.values())
    if world > 1:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=getattr(torch, cfg.dtype), reduce_dtype=torch.float32)
        for i, block in enumerate(blocks):
            fully_shard(block, mp_policy=policy, reshard_after_forward=i < len(blocks) - 1)
        fully_shard(model, mp_policy=policy)
    return model, blocks


def train(cfg: BaselineConfig) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if cfg.model == "transformers" and (world > 1 or cfg.attention_mask != "causal"):
        raise SystemExit("baseline: --model transformers runs one process with the causal mask")
    if world > 1:
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    host_memory.configure(cfg.host_memory, device)
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(cfg.threads or max(1, (os.cpu_count() or 1) // local_ranks))
    torch.manual_seed(0)  # one initial model, whose shards the ranks keep
    # The vocabulary of plait's default tokenizer (the bench's rows use the default data), so the
    # embedding and output layer have plait's shapes; the tokens themselves are random.
    tokenizer = build_tokenizer(Data())
    args = model_args(cfg.flavor, tokenizer.get_vocab_size())
    model, blocks = build(cfg, args, device, world)
    if cfg.compile:
        for block in blocks:
            block.compile()
    hp = Training()
    optimizer = torch.optim.AdamW(
        [{"params": [p for p in model.parameters() if p.ndim >= 2], "weight_decay": hp.weight_decay},
         {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0}],
        lr=hp.lr, betas=(0.9, 0.95), eps=1e-8)  # no schedule: it changes the numbers, not the cost
    dtype = getattr(torch, cfg.dtype)
    autocast = world == 1 and dtype != torch.float32  # under fully_shard its policy casts
    per_rank = cfg.batch_size // world
    tokens_per_step = cfg.batch_size * cfg.seq_len
    peak = peak_flops(device, dtype, linear_shapes(linear_weight_shapes(args), per_rank * cfg.seq_len))
    utilisation = Utilisation(flops_per_token(args, cfg.seq_len), peak, devices=world)
    state_gib = None
    eos = eos_id(tokenizer)
    tokens = torch.Generator().manual_seed(1 + int(os.environ.get("RANK", "0")))  # each rank its own batches
    for step in range(1, cfg.steps + 1):
        start = time.perf_counter()
        batch = torch.randint(args.vocab_size, (per_rank, cfg.seq_len + 1), generator=tokens).to(device)
        inputs, labels, attention = batch[:, :-1], batch[:, 1:], {}
        if cfg.attention_mask == "document":
            documents = document_ids(inputs, eos)
            attention = {"positions": positions_in_documents(documents), "mask": documents}
        with torch.autocast(device.type, dtype=dtype, enabled=autocast):
            logits = model(inputs).logits if cfg.model == "transformers" else model(inputs, **attention)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), hp.max_norm).item()
        optimizer.step()
        if state_gib is None:  # gradients exist until zero_grad: counted as plait counts them
            state_gib = state_memory_gib(model, optimizer)
        optimizer.zero_grad(set_to_none=True)
        if world > 1:
            dist.all_reduce(loss)  # the step's loss over the ranks, as plait reports it
        loss_value = loss.item() / world
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        tokens_per_sec = tokens_per_step / (time.perf_counter() - start)
        if int(os.environ.get("RANK", "0")) == 0:
            print(json.dumps({"step": step, "loss": loss_value, "grad_norm": grad_norm, "tokens_per_sec": tokens_per_sec,
                              "mfu": utilisation.mfu(step, tokens_per_sec), "memory_gib": peak_memory_gib(device),
                              "state_gib": state_gib}), flush=True)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    train(tyro.cli(BaselineConfig, args=sys.argv[1:], prog="python -m plait.proof.baseline", use_underscores=True))
