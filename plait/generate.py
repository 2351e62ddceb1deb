"""`plait generate`: text from a plait checkpoint or a Hugging Face folder (Llama or a relative).

Sampling as transformers does it (temperature, then nucleus/top-p; temperature 0 = greedy),
one token at a time with a KV cache: the prompt is run once, then each new token attends to
the cached keys and values of every position before it instead of recomputing them.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from tokenizers import Tokenizer

from plait import hf, storage
from plait.arguments import parse
from plait.checkpoint.manifest import check_compatible, checkpoint_in, manifest_model, read_manifest
from plait.checkpoint.offline import load_full_state_dict
from plait.config import ConfigError
from plait.data import eos_id
from plait.data.tokenizer import read_tokenizer
from plait.hf.tokenizer import TOKENIZER
from plait.models.attention import KVCache
from plait.models.transformer import Transformer
from plait.models.weights import fill_weights


@dataclass
class GenerateArgs:
    checkpoint: str
    """a plait checkpoint (seed or training) or a Hugging Face folder (Llama, Mistral, Qwen2/2.5, Qwen3, OLMo 2,
    SmolLM3)"""
    prompt: str
    """the text to continue; "" samples a text from nothing (from the end-of-text token)"""
    max_new_tokens: int = 64
    """tokens to generate at most (fewer if the end-of-text token comes first)"""
    temperature: float = 0.8
    """sampling temperature; 0 = greedy (always the most likely token)"""
    top_p: float = 0.95
    """nucleus sampling: draw from the most likely tokens that together hold this probability"""
    seed: int = 0
    """seed of the sampling"""
    kv_cache: bool = True
    """keep earlier positions' keys and values (--no-kv-cache recomputes the whole text per token)"""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """dtype of the weights and the computation"""
    ids: bool = False
    """also print the generated token ids (to compare with another implementation)"""
    weights: Literal["model", "ema"] = "model"
    """a plait checkpoint's weights, or their moving average (saved by a run with training.ema)"""


def load(folder: Path, weights: str = "model") -> tuple[Transformer, Tokenizer]:
    """The model and tokenizer of a plait checkpoint (`weights` ema: its average of the weights) or
    a Hugging Face folder, on the CPU."""
    if not folder.is_dir():
        raise ConfigError(f"checkpoint: {str(folder)!r} is not a folder")
    folder = checkpoint_in(folder, "checkpoint")
    if hf.is_hf_folder(folder):
        if weights == "ema":
            raise ConfigError(f"weights: {folder} is a Hugging Face folder, which holds no average of the weights; "
                              "allowed here: model")
        args = hf.model_args(folder, "checkpoint")
        weights = hf.HFWeights(folder, args, "checkpoint")
        model = Transformer(args)
        fill_weights(model, lambda name, shape: weights[name], weights.buffers)
    else:
        manifest = read_manifest(folder)
        if manifest is None:
            raise ConfigError(f"checkpoint: {folder} is neither a plait checkpoint (plait.json) nor a Hugging Face "
                              "folder (config.json)")
        args = manifest_model(manifest, folder, "checkpoint")
        check_compatible(folder, args, "checkpoint")
        model = Transformer(args)
        model.load_state_dict(load_full_state_dict(folder, args, "checkpoint", weights))
    if not (folder / TOKENIZER).is_file():
        raise ConfigError(f"checkpoint: {folder} has no {TOKENIZER} to turn text into tokens and back")
    tokenizer = read_tokenizer(folder / TOKENIZER, "checkpoint")
    if tokenizer.get_vocab_size() > args.vocab_size:
        raise ConfigError(f"checkpoint: {folder}'s tokenizer has {tokenizer.get_vocab_size()} tokens, more than the "
                          f"model's {args.vocab_size} embeddings")
    return model.eval(), tokenizer


def next_token(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> int:
    if temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    sorted_probs, order = probs.sort(descending=True)
    # Keep the most likely tokens until they hold top_p (at least one), renormalised by multinomial.
    outside = sorted_probs.cumsum(0) - sorted_probs > top_p
    sorted_probs[outside] = 0
    return int(order[torch.multinomial(sorted_probs, 1, generator=generator)])


@torch.inference_mode()
def generate(model: Transformer, prompt: list[int], max_new_tokens: int, temperature: float, top_p: float,
             seed: int, eos: int, kv_cache: bool) -> Iterator[int]:
    """The new tokens, one at a time; stops after `eos` or max_new_tokens."""
    generator = torch.Generator().manual_seed(seed)
    cache = KVCache() if kv_cache else None
    tokens = torch.tensor([prompt])
    logits = model(tokens, cache)[0, -1]
    for _ in range(max_new_tokens):
        token = next_token(logits, temperature, top_p, generator)
        yield token
        if token == eos:
            return
        tokens = torch.tensor([[token]]) if cache is not None else torch.cat([tokens, torch.tensor([[token]])], dim=1)
        logits = model(tokens, cache)[0, -1]


def main(argv: list[str]) -> int:
    opts = parse(GenerateArgs, argv, "plait generate")
    if opts.temperature < 0 or not 0 < opts.top_p <= 1 or opts.max_new_tokens < 1:
        raise ConfigError("temperature must be >= 0, top_p in (0, 1], max_new_tokens >= 1; got "
                          f"{opts.temperature}, {opts.top_p}, {opts.max_new_tokens}")
    model, tokenizer = load(storage.location(opts.checkpoint, "checkpoint"), opts.weights)
    model.to(getattr(torch, opts.dtype))
    eos = eos_id(tokenizer, "checkpoint")
    # An empty prompt (with a tokenizer that adds no start token) samples the model unconditionally:
    # from the end-of-text token, after which every document of training began.
    prompt = tokenizer.encode(opts.prompt).ids or [eos]
    if len(prompt) + opts.max_new_tokens > model.args.max_seq_len:
        raise ConfigError(f"max_new_tokens: the prompt's {len(prompt)} tokens + {opts.max_new_tokens} exceed the "
                          f"model's {model.args.max_seq_len} positions")
    print(opts.prompt, end="", flush=True)
    new, shown, start = [], "", time.perf_counter()
    prompt_length = len(tokenizer.decode(prompt))
    for token in generate(model, prompt, opts.max_new_tokens, opts.temperature, opts.top_p, opts.seed,
                          eos, opts.kv_cache):
        new.append(token)
        text = tokenizer.decode(prompt + new)[prompt_length:]
        if not text.endswith("\ufffd"):  # wait for the rest of a character split across tokens
            print(text[len(shown):], end="", flush=True)
            shown = text
    seconds = time.perf_counter() - start
    print(flush=True)  # the text ends its line, in a terminal and in a file it is redirected to
    print(f"plait: {len(new)} tokens in {seconds:.2f}s ({len(new) / seconds:.1f} tokens/s, KV cache "
          f"{'on' if opts.kv_cache else 'off'})" + (f"; ids {new}" if opts.ids else ""), file=sys.stderr)
    return 0
