"""The tokenizer of an exported folder: what `AutoTokenizer` and `pipeline("text-generation")` load.

plait's tokenizers are `tokenizers` JSON files (a trained byte-level BPE, or a given one such as
Llama 3's), so the export is that file plus the two small configs transformers reads beside it:
which tokens begin and end a text, and how to generate by default.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer

from plait.data import eos_id

TOKENIZER = "tokenizer.json"
BOS_TOKENS = ("<|begin_of_text|>", "<s>")  # Llama 3's, Llama 2's / TinyLlama's


def special_ids(tokenizer: Tokenizer) -> tuple[int | None, int]:
    """(beginning-of-text id or None, end-of-text id)."""
    bos = next((i for t in BOS_TOKENS if (i := tokenizer.token_to_id(t)) is not None), None)
    return bos, eos_id(tokenizer)


def write(tokenizer: Tokenizer, out: Path, max_length: int) -> None:
    bos, eos = special_ids(tokenizer)
    tokenizer.save(str(out / TOKENIZER))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
        "bos_token": tokenizer.id_to_token(bos) if bos is not None else None, "eos_token": tokenizer.id_to_token(eos),
        "clean_up_tokenization_spaces": False}, indent=1))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": bos, "eos_token_id": eos}, indent=1))
