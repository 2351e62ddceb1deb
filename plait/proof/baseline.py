"""The plainest PyTorch training loop of plait's model: the yardstick for plait's overhead.

`plait bench` runs it as its `raw_pytorch` row, in a process of its own like every other row.
One device, no process group, no plait machinery in the loop: the same
`Transformer(model_args(flavor, vocab))`, random token batches of the shape plait's
single-device row trains on (the whole global batch in one micro-batch: dp 1, no accumulation),
AdamW with plait's hyper-parameters and gradient clipping, and bf16 the standard PyTorch way,
`torch.autocast` around forward + loss with fp32 parameters. Prints one JSON line per step with
the keys of plait's metrics rows that the bench reads.

    python -m plait.proof.baseline --flavor small --dtype bfloat16 --steps 6
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Literal

import torch
import tyro

from plait.config import Data, Flavor, Training
from plait.data import build_tokenizer, eos_id
from plait.hardware import linear_shapes, peak_flops
from plait.masking import allowed, document_ids, positions_in_documents
from plait.metrics import Utilisation, peak_memory_gib, state_memory_gib
from plait.model import Transformer, cross_entropy, flops_per_token, linear_weight_shapes, model_args


@dataclass
class BaselineConfig:
    flavor: Flavor = "debug"
    steps: int = 6
    seq_len: int = 256
    batch_size: int = 8
    """sequences per step, all in one forward"""
    dtype: Literal["float32", "bfloat16"] = "bfloat16"
    """bfloat16: torch.autocast around forward + loss; parameters, gradients and AdamW stay fp32"""
    threads: int = 0
    """CPU threads; 0 = every core, as plait's single-device row takes"""
    attention_mask: Literal["causal", "document"] = "causal"
    """as plait's model.attention_mask: document passes the model each token's positions and mask"""


def train(cfg: BaselineConfig) -> None:
    torch.set_num_threads(cfg.threads or os.cpu_count() or 1)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # The vocabulary of plait's default tokenizer (the bench's rows use the default data), so the
    # embedding and output layer have plait's shapes; the tokens themselves are random.
    tokenizer = build_tokenizer(Data())
    args = model_args(cfg.flavor, tokenizer.get_vocab_size())
    with torch.device(device):
        model = Transformer(args)
    hp = Training()
    optimizer = torch.optim.AdamW(
        [{"params": [p for p in model.parameters() if p.ndim >= 2], "weight_decay": hp.weight_decay},
         {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0}],
        lr=hp.lr, betas=(0.9, 0.95), eps=1e-8)  # no schedule: it changes the numbers, not the cost
    dtype = getattr(torch, cfg.dtype)
    tokens_per_step = cfg.batch_size * cfg.seq_len
    peak = peak_flops(device, dtype, linear_shapes(linear_weight_shapes(args), tokens_per_step))
    utilisation = Utilisation(flops_per_token(args, cfg.seq_len), peak, devices=1)
    state_gib = None
    eos = eos_id(tokenizer)
    for step in range(1, cfg.steps + 1):
        start = time.perf_counter()
        batch = torch.randint(args.vocab_size, (cfg.batch_size, cfg.seq_len + 1)).to(device)
        inputs, labels, attention = batch[:, :-1], batch[:, 1:], {}
        if cfg.attention_mask == "document":
            documents = document_ids(inputs, eos)
            attention = {"positions": positions_in_documents(documents),
                         "mask": allowed(documents, torch.arange(cfg.seq_len, device=device))}
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = cross_entropy(model(inputs, **attention), labels)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), hp.max_norm).item()
        optimizer.step()
        if state_gib is None:  # gradients exist until zero_grad: counted as plait counts them
            state_gib = state_memory_gib(model, optimizer)
        optimizer.zero_grad(set_to_none=True)
        loss_value = loss.item()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        tokens_per_sec = tokens_per_step / (time.perf_counter() - start)
        print(json.dumps({"step": step, "loss": loss_value, "grad_norm": grad_norm, "tokens_per_sec": tokens_per_sec,
                          "mfu": utilisation.mfu(step, tokens_per_sec), "memory_gib": peak_memory_gib(device),
                          "state_gib": state_gib}), flush=True)


if __name__ == "__main__":
    train(tyro.cli(BaselineConfig, args=sys.argv[1:], prog="python -m plait.proof.baseline", use_underscores=True))
