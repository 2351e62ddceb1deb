"""The tokenizer: a given tokenizer.json, or a byte-level BPE trained once on the corpus.

Every rank runs this on its own before any collective exists, so the slow part (training the
BPE) is cached on disk under a file lock: the first rank does the work, the others wait for it
and load the result.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from plait import jsonl, storage
from plait.cache import cache_dir, cached_file
from plait.config import ConfigError, Data
from plait.data.documents import fingerprint, load_texts

EOS = "<|eos|>"
# end-of-document tokens of foreign tokenizers: Llama 3, Llama 2 / Mistral, GPT-2
FOREIGN_EOS = ("<|end_of_text|>", "</s>", "<|endoftext|>")


def sha256(tokenizer: Tokenizer) -> str:
    return hashlib.sha256(tokenizer.to_str().encode()).hexdigest()


def read_tokenizer(path: str | Path, option: str) -> Tokenizer:
    """A tokenizer.json, or one line saying why it is none."""
    text = jsonl.text(storage.location(path, option), option)
    try:
        return Tokenizer.from_str(text)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # the Rust side raises a bare Exception, or panics (a BaseException) on some files
        raise ConfigError(f"{option}: {str(path)!r} is not a tokenizer.json (a Hugging Face `tokenizers` file, as in a "
                          f"model's folder): {str(e)[:300]}") from None


def load_tokenizer(path: str, option: str = "data.tokenizer") -> Tokenizer:
    tokenizer = read_tokenizer(path, option)
    eos_id(tokenizer, option)  # fail now, not after tokenizing the corpus
    return tokenizer


def trained_tokenizer(data_cfg: Data, texts: list[str] | None = None, corpus_sha: str | None = None) -> Tokenizer:
    """The BPE of `data.vocab_size` trained on the corpus of data.path, cached by the corpus's content."""
    vocab_size = data_cfg.vocab_size
    if vocab_size < 257:
        raise ConfigError(f"data.vocab_size: must be >= 257 (256 bytes + {EOS}), got {vocab_size}")
    if texts is None:
        texts = load_texts(data_cfg.path, data_cfg.text_field, data_cfg.extensions)
    path = cache_dir() / f"tokenizer-{(corpus_sha or fingerprint(texts))[:16]}-{vocab_size}.json"
    return cached_file(path, lambda: train_bpe(texts, vocab_size),
                       lambda tokenizer, tmp: tokenizer.save(str(tmp)), lambda p: Tokenizer.from_file(str(p)))


def train_bpe(texts: list[str], vocab_size: int) -> Tokenizer:
    # byte-level: every string is encodable (no <unk>) and decode(encode(s)) == s
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer, length=len(texts))
    return tokenizer


def text_encoder(tokenizer: Tokenizer) -> Tokenizer:
    """A copy of `tokenizer` that encodes special-token strings found in a document (a text that
    mentions <|endoftext|>) as the text they are: only plait puts the end-of-document id between
    documents, and the document mask and RoPE positions restart wherever it stands."""
    encoder = Tokenizer.from_str(tokenizer.to_str())
    encoder.encode_special_tokens = True
    return encoder


def eos_id(tokenizer: Tokenizer, option: str = "data.tokenizer") -> int:
    for token in (EOS, *FOREIGN_EOS):
        if (i := tokenizer.token_to_id(token)) is not None:
            return i
    raise ConfigError(f"{option}: has none of the end-of-document tokens {[EOS, *FOREIGN_EOS]}")
