"""The tokenizer of an exported folder: what `AutoTokenizer` and `pipeline("text-generation")` load.

plait's tokenizers are `tokenizers` JSON files (a trained byte-level BPE, or a given one such as
Llama 3's), so the export is that file plus the two small configs transformers reads beside it:
which tokens begin and end a text, and how to generate by default. A run that started from a
Hugging Face folder with that same tokenizer keeps the folder's own configs instead (its chat
template, special tokens, generation defaults), carried through every checkpoint unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer

from plait.data import eos_id
from plait.data.tokenizer import read_tokenizer

TOKENIZER = "tokenizer.json"
BOS_TOKENS = ("<|begin_of_text|>", "<s>")  # Llama 3's, Llama 2's / TinyLlama's


def special_ids(tokenizer: Tokenizer) -> tuple[int | None, int]:
    """(beginning-of-text id or None, end-of-text id)."""
    bos = next((i for t in BOS_TOKENS if (i := tokenizer.token_to_id(t)) is not None), None)
    return bos, eos_id(tokenizer)


# A start folder's files that an export gives back as they were (with the folder's tokenizer).
COMPANIONS = ("tokenizer_config.json", "special_tokens_map.json", "generation_config.json", "chat_template.jinja")
# A start folder's config.json, kept beside a checkpoint under this name (a config.json would
# make the checkpoint look like a Hugging Face folder).
SOURCE_CONFIG = "hf_config.json"


def companions(folder: Path, tokenizer: Tokenizer) -> dict[str, bytes]:
    """name -> bytes of what a run starting from `folder` (a Hugging Face folder or a plait
    checkpoint) carries into its checkpoints: its config.json (as SOURCE_CONFIG), and its
    tokenizer's configs where the run's tokenizer is the folder's own."""
    config = folder / "config.json" if (folder / "config.json").is_file() else folder / SOURCE_CONFIG
    carried = {SOURCE_CONFIG: config.read_bytes()} if config.is_file() else {}
    own = folder / TOKENIZER
    if own.is_file() and read_tokenizer(own, "checkpoint.load").to_str() == tokenizer.to_str():
        carried |= {name: (folder / name).read_bytes() for name in COMPANIONS if (folder / name).is_file()}
    return carried


def write(tokenizer: Tokenizer, out: Path, max_length: int) -> None:
    bos, eos = special_ids(tokenizer)
    tokenizer.save(str(out / TOKENIZER))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
        "bos_token": tokenizer.id_to_token(bos) if bos is not None else None, "eos_token": tokenizer.id_to_token(eos),
        "clean_up_tokenization_spaces": False}, indent=1))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": bos, "eos_token_id": eos}, indent=1))


def write_companions(carried: dict[str, bytes], out: Path) -> None:
    for name, data in carried.items():
        (out / name).write_bytes(data)
