"""Multiple-choice tasks, turned into token requests and scored as lm-evaluation-harness does.

A task is a JSONL file, one example per line: {"context": str, "choices": [str, ...], "gold": i}
(the fields lm-evaluation-harness's multiple_choice tasks resolve to, e.g. HellaSwag's query,
choices and label). Each choice is one request: the log-likelihood of " " + choice after the
context (and after `num_fewshot` solved examples), computed by the model the run trains.

Every rule that decides a score is lm-evaluation-harness 0.4's (its HF backend), so the same
checkpoint scores the same there and here (tests/test_evals.py checks it on an export):
- few-shot: the task's first N other examples (its `first_n` sampler), each as context +
  target_delimiter + gold choice + fewshot_delimiter, before the example's context;
- tokens: trailing spaces of the context move to the continuation; the continuation's tokens
  are those of tokenize(context + continuation) after tokenize(context)'s; the tokenizer adds
  what it adds by default (plait's BPE: nothing); an empty context is the end-of-text token;
- a request longer than the window keeps its last seq_len + 1 tokens (left truncation);
- acc: the choice with the highest summed log-likelihood; acc_norm: divided by the choice's
  length in characters; acc_bytes: in UTF-8 bytes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from plait import jsonl
from plait.config import ConfigError

BUNDLED = {"sample": Path(__file__).with_name("sample.jsonl")}


@dataclass(frozen=True)
class Example:
    context: str
    choices: tuple[str, ...]
    gold: int


@dataclass(frozen=True)
class Task:
    name: str
    examples: list[Example]


@dataclass(frozen=True)
class Request:
    """One choice of one example as the model sees it: the window's input tokens, and the
    tokens of the choice, which are the last len(targets) targets of that window."""
    example: int
    choice: int
    inputs: list[int]
    targets: list[int]


def load_task(spec: str, option: str = "eval.tasks") -> Task:
    """A bundled task by name, or a JSONL file; every line checked, a bad one named in one line."""
    path = BUNDLED.get(spec, Path(spec))
    if spec not in BUNDLED and (path.suffix != ".jsonl" or not path.is_file()):
        raise ConfigError(f"{option}: {spec!r} is neither a .jsonl file nor a bundled task {sorted(BUNDLED)}")
    numbered = jsonl.lines(path, option, ": is it a task file?")
    examples = [_example(line, f"{option}: {path}:{n}") for n, line in numbered]
    if not examples:
        raise ConfigError(f"{option}: {path} holds no example")
    return Task(spec if spec in BUNDLED else path.stem, examples)


def _example(line: str, where: str) -> Example:
    try:
        row = json.loads(line)
    except ValueError as e:
        raise ConfigError(f"{where} is not valid JSON: {e}") from None
    if not isinstance(row, dict):
        raise ConfigError(f"{where} is not a JSON object with context, choices and gold")
    missing = [key for key in ("context", "choices", "gold") if key not in row]
    if missing:
        raise ConfigError(f"{where} has no {' or '.join(missing)} (each line: "
                          '{"context": str, "choices": [str, ...], "gold": index})')
    context, choices, gold = row["context"], row["choices"], row["gold"]
    if not isinstance(context, str):
        raise ConfigError(f"{where}: context is {type(context).__name__}, not a string")
    if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) for c in choices):
        raise ConfigError(f"{where}: choices must be a list of at least 2 strings")
    if empty := [i for i, c in enumerate(choices) if not c.strip()]:
        raise ConfigError(f"{where}: choice {empty[0]} is empty (its log-likelihood would be 0, the best possible)")
    if isinstance(gold, bool) or not isinstance(gold, int) or not 0 <= gold < len(choices):
        raise ConfigError(f"{where}: gold {gold!r} is not an index into its {len(choices)} choices (0..{len(choices) - 1})")
    return Example(context, tuple(choices), gold)


def prompt(task: Task, index: int, num_fewshot: int, target_delimiter: str, fewshot_delimiter: str) -> str:
    """The context an example is scored after: its first `num_fewshot` other examples solved, then its own."""
    example = task.examples[index]
    shots = [e for e in task.examples if e != example][:num_fewshot]
    solved = "".join(e.context + target_delimiter + e.choices[e.gold] + fewshot_delimiter for e in shots)
    return solved + example.context


def encode_pair(tokenizer: Tokenizer, context: str, continuation: str, prefix: int) -> tuple[list[int], list[int]]:
    """(context tokens, continuation tokens) by lm-evaluation-harness's rule (module docstring)."""
    if not context:
        return [prefix], tokenizer.encode(continuation, add_special_tokens=False).ids
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation).ids
    head = len(tokenizer.encode(context).ids)
    return whole[:head], whole[head:]


def requests(task: Task, tokenizer: Tokenizer, prefix: int, window: int, limit: int, num_fewshot: int,
             target_delimiter: str, fewshot_delimiter: str, options: str = "eval.",
             window_option: str = "training.seq_len") -> list[Request]:
    """Every choice of the task's first `limit` examples (0: all) as a request of at most `window`
    inputs; `options`: the prefix of the options' names in messages."""
    if num_fewshot >= len(task.examples):
        raise ConfigError(f"{options}num_fewshot: {num_fewshot} needs more examples than task {task.name}'s "
                          f"{len(task.examples)}; allowed: 0..{len(task.examples) - 1}")
    out = []
    for i in range(min(limit, len(task.examples)) if limit else len(task.examples)):
        context = prompt(task, i, num_fewshot, target_delimiter, fewshot_delimiter)
        for j, choice in enumerate(task.examples[i].choices):
            head, tail = encode_pair(tokenizer, context, target_delimiter + choice, prefix)
            if not tail or len(tail) > window:
                raise ConfigError(f"{options}tasks: {task.name} example {i} choice {j} is {len(tail)} tokens; allowed: "
                                  f"1..{window} ({window_option})")
            tokens = (head + tail)[-(window + 1):]
            out.append(Request(i, j, tokens[:-1], tail))
    return out


def scores(task: Task, requests: list[Request], log_likelihoods: list[float]) -> dict[str, float]:
    """acc, acc_norm, acc_bytes (lm-evaluation-harness's) and gold_loss, the gold choices' loss
    per token (a smooth number, on the scale of the training loss, to compare runs by)."""
    per_example: dict[int, list[float]] = {}
    gold_tokens: dict[int, int] = {}
    for request, value in zip(requests, log_likelihoods, strict=True):
        per_example.setdefault(request.example, []).append(value)
        if request.choice == task.examples[request.example].gold:
            gold_tokens[request.example] = len(request.targets)
    totals = {"acc": 0.0, "acc_norm": 0.0, "acc_bytes": 0.0, "gold_loss": 0.0}
    for i, lls in per_example.items():
        example = task.examples[i]

        def best(length) -> int:
            return max(range(len(lls)), key=lambda j: lls[j] / length(example.choices[j]))

        totals["acc"] += best(lambda c: 1) == example.gold
        totals["acc_norm"] += best(len) == example.gold
        totals["acc_bytes"] += best(lambda c: len(c.encode())) == example.gold
        totals["gold_loss"] -= lls[example.gold] / gold_tokens[i]
    return {name: value / len(per_example) for name, value in totals.items()}
