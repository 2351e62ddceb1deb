"""`plait eval`: score a plait checkpoint, a job folder or a Hugging Face folder on eval.tasks.

One process, the whole model, the same tasks, requests and scores as the evaluations during
training (plait/evals), with the window lm-evaluation-harness's HF backend uses by default: the
model's positions (`--max_length` sets another). Each batch is as long as its longest request.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from plait import storage
from plait.arguments import parse
from plait.config import ConfigError, Eval
from plait.data import eos_id
from plait.evals import TaskSuite
from plait.generate import load
from plait.models.transformer import row_log_likelihoods


@dataclass
class EvalArgs:
    checkpoint: str
    """a plait checkpoint, a job folder (its newest complete checkpoint) or a Hugging Face folder"""
    weights: Literal["model", "ema"] = "model"
    """a plait checkpoint's weights, or their moving average (saved by a run with training.ema)"""
    tasks: tuple[str, ...] = ("sample",)
    """multiple-choice tasks: .jsonl files of {"context": str, "choices": [str, ...], "gold": index} per line, or
    a bundled task's name (sample)"""
    limit: int = 0
    """score the first N examples of each task; 0 = all"""
    num_fewshot: int = 0
    """examples with their answers before each question: the task's first N others"""
    target_delimiter: str = " "
    """between a question and its answer"""
    fewshot_delimiter: str = "\n\n"
    """after each few-shot example"""
    max_length: int = 0
    """tokens a request may hold (longer ones keep their last ones); 0 = the model's positions"""
    batch_size: int = 8
    """requests per forward"""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """dtype of the weights and the computation"""
    json: bool = False
    """print the scores as one JSON object instead of a table"""
    samples: str = ""
    """write every scored example to this JSONL file: its task, index, each choice's log-likelihood, gold"""


def main(argv: list[str]) -> int:
    opts = parse(EvalArgs, argv, "plait eval")
    if opts.batch_size < 1 or opts.max_length < 0:
        raise ConfigError(f"batch_size must be >= 1 and max_length >= 0; got {opts.batch_size}, {opts.max_length}")
    if not opts.tasks:
        raise ConfigError("tasks: give at least one task (a .jsonl file or a bundled name: sample)")
    model, tokenizer = load(storage.location(opts.checkpoint, "checkpoint"), opts.weights)
    positions = model.args.max_seq_len  # its RoPE table's length: a longer window fails
    if opts.max_length > positions:
        raise ConfigError(f"max_length: {opts.max_length} is beyond the model's {positions} positions; allowed: "
                          f"1..{positions} (0 = the model's)")
    model.to(getattr(torch, opts.dtype))
    window = opts.max_length or positions
    chosen = Eval(tasks=opts.tasks, limit=opts.limit, num_fewshot=opts.num_fewshot,
                  target_delimiter=opts.target_delimiter, fewshot_delimiter=opts.fewshot_delimiter)
    suite = TaskSuite(chosen, window, tokenizer, eos_id(tokenizer, "checkpoint"), options="",
                      window_option="max_length: the model's positions unless given")
    start = time.perf_counter()

    def forward(inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return row_log_likelihoods(model(inputs, labels=labels, per_token=True))

    log_likelihoods = suite.log_likelihoods(forward, opts.batch_size, torch.device("cpu"), granule=1)
    metrics = suite.metrics(log_likelihoods)
    seconds = time.perf_counter() - start
    if opts.samples:
        write_samples(Path(opts.samples), suite, log_likelihoods)
    if opts.json:
        print(json.dumps({"checkpoint": opts.checkpoint, **metrics, "seconds": seconds}))
        return 0
    print(f"{'task':<24} {'examples':>8} {'acc':>7} {'acc_norm':>9} {'acc_bytes':>10} {'gold_loss':>10}")
    for task, requests in zip(suite.tasks, suite.requests):
        scores = {name: metrics[f"eval_{task.name}_{name}"] for name in ("acc", "acc_norm", "acc_bytes", "gold_loss")}
        examples = len({r.example for r in requests})
        print(f"{task.name:<24} {examples:>8} {scores['acc']:>7.4f} {scores['acc_norm']:>9.4f} "
              f"{scores['acc_bytes']:>10.4f} {scores['gold_loss']:>10.4f}")
    print(f"plait: {sum(map(len, suite.requests))} requests in {seconds:.1f} s ({opts.dtype}, window {window} tokens)")
    return 0


def write_samples(path: Path, suite: TaskSuite, log_likelihoods: list[list[float]]) -> None:
    with open(path, "w") as out:
        for task, requests, values in zip(suite.tasks, suite.requests, log_likelihoods):
            per_example: dict[int, list[float]] = {}
            for request, value in zip(requests, values):
                per_example.setdefault(request.example, []).append(value)
            for index, lls in per_example.items():
                out.write(json.dumps({"task": task.name, "example": index, "log_likelihoods": lls,
                                      "gold": task.examples[index].gold}) + "\n")
