"""The tokenizer: a given tokenizer.json, or a byte-level BPE trained once on the corpus.

Every rank runs this on its own before any collective exists, so the slow part (training the
BPE) is cached on disk under a file lock: the first rank does the work, the others wait for it
and load the result.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from plait.config import ConfigError, Data
from plait.data.documents import fingerprint, load_texts

EOS = "<|eos|>"
# end-of-document tokens of foreign tokenizers: Llama 3, Llama 2 / Mistral, GPT-2
FOREIGN_EOS = ("<|end_of_text|>", "</s>", "<|endoftext|>")


def cache_dir() -> Path:
    d = Path(os.environ.get("PLAIT_CACHE") or Path.home() / ".cache" / "plait")
    d.mkdir(parents=True, exist_ok=True)
    return d


@contextlib.contextmanager
def file_lock(path: Path):
    """One process at a time (across processes of a host); released when the file closes."""
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def cached_file(path: Path, build, save, load):
    """Load `path`, building it first if needed. The lock makes one process build while the others
    wait; the atomic rename means nobody ever reads a half-written file. The builder loads the file
    back too, so every process gets exactly the same object."""
    if not path.exists():
        with file_lock(path.with_name(path.name + ".lock")):
            if not path.exists():
                tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
                save(build(), tmp)
                os.replace(tmp, path)
    return load(path)


def sha256(tokenizer: Tokenizer) -> str:
    return hashlib.sha256(tokenizer.to_str().encode()).hexdigest()


def load_tokenizer(path: str, option: str = "data.tokenizer") -> Tokenizer:
    try:
        tokenizer = Tokenizer.from_file(path)
    except Exception as e:  # the Rust side raises a bare Exception
        raise ConfigError(f"{option}: cannot load {path!r}: {e}") from None
    eos_id(tokenizer, option)  # fail now, not after tokenizing the corpus
    return tokenizer


def trained_tokenizer(data_cfg: Data, texts: list[str] | None = None, corpus_sha: str | None = None) -> Tokenizer:
    """The BPE of `data.vocab_size` trained on the corpus of data.path, cached by the corpus's content."""
    vocab_size = data_cfg.vocab_size
    if vocab_size < 257:
        raise ConfigError(f"data.vocab_size: must be >= 257 (256 bytes + {EOS}), got {vocab_size}")
    if texts is None:
        texts = load_texts(data_cfg.path, data_cfg.text_field)
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


def eos_id(tokenizer: Tokenizer, option: str = "data.tokenizer") -> int:
    for token in (EOS, *FOREIGN_EOS):
        if (i := tokenizer.token_to_id(token)) is not None:
            return i
    raise ConfigError(f"{option}: has none of the end-of-document tokens {[EOS, *FOREIGN_EOS]}")
