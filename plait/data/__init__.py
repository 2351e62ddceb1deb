"""Training data: documents -> tokenizer -> tokenized folders -> per-rank batches.

Every source of a run is a tokenized folder (`plait/data/shards.py`): one `plait tokenize` made,
or, for a raw-text path, one built in the cache (`$PLAIT_CACHE`, default ~/.cache/plait) the
first time that corpus and tokenizer meet, by one rank under a file lock while the others wait.
A raw path is still read and hashed at every start (that is how its cache entry is found), so
large corpora are tokenized once with `plait tokenize` and trained from the folder.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from plait.config import ConfigError, Data, mix_sources
from plait.data.documents import fingerprint, load_texts
from plait.data.loader import BatchLoader, eval_batches
from plait.data.shards import FORMAT, MANIFEST, TOKENIZER, TokenizedFolder, is_tokenized, write_folder
from plait.cache import cache_dir, file_lock
from plait.data.tokenizer import eos_id, load_tokenizer, sha256, trained_tokenizer

__all__ = ["BatchLoader", "Corpus", "build_tokenizer", "eos_id", "eval_batches", "open_data", "vocab_size"]


@dataclass
class Corpus:
    tokenizer: Tokenizer
    sources: list[TokenizedFolder]
    weights: list[float]
    val: TokenizedFolder | None

    @property
    def fingerprint(self) -> str:
        """The training token streams and their weights, by content: part of a job's identity."""
        if len(self.sources) == 1:
            return self.sources[0].fingerprint
        parts = [f"{s.fingerprint}:{w!r}" for s, w in zip(self.sources, self.weights)]
        return hashlib.sha256(",".join(parts).encode()).hexdigest()


def _train_paths(cfg: Data) -> list[tuple[str, float]]:
    return mix_sources(cfg.mix) if cfg.mix else [(cfg.path, 1.0)]


def build_tokenizer(cfg: Data, texts: list[str] | None = None) -> Tokenizer:
    """The run's tokenizer: data.tokenizer if given, else the one a tokenized source was made
    with, else a BPE trained on data.path."""
    return _given_tokenizer(cfg) or trained_tokenizer(cfg, texts)


def _given_tokenizer(cfg: Data) -> Tokenizer | None:
    """data.tokenizer, or the tokenizer a tokenized source was made with; None: a BPE is trained."""
    if cfg.tokenizer:
        return load_tokenizer(cfg.tokenizer)
    option = "data.mix" if cfg.mix else "data.path"
    for path, _ in _train_paths(cfg):
        if is_tokenized(path):
            return load_tokenizer(str(Path(path) / TOKENIZER), option)
    if cfg.mix:
        raise ConfigError("data.mix: raw-text sources need data.tokenizer (or tokenize them first: plait tokenize)")
    return None


def vocab_size(cfg: Data) -> int:
    """The vocabulary of the run's tokenizer without tokenizing anything (for `plait plan`): a
    given tokenizer's, else the trained BPE's data.vocab_size (which a corpus of any size reaches)."""
    given = _given_tokenizer(cfg)
    return given.get_vocab_size() if given is not None else cfg.vocab_size


def open_data(cfg: Data) -> Corpus:
    """The run's tokenizer and token streams; checked, and built where needed, before any process group."""
    paths = _train_paths(cfg)
    texts = None if cfg.tokenizer or cfg.mix or is_tokenized(cfg.path) else load_texts(cfg.path, cfg.text_field)
    tokenizer = build_tokenizer(cfg, texts)
    option = "data.mix" if cfg.mix else "data.path"
    sources = [open_source(path, cfg, tokenizer, option, texts) for path, _ in paths]
    val = open_source(cfg.val_path, cfg, tokenizer, "data.val_path") if cfg.val_path else None
    return Corpus(tokenizer, sources, [w for _, w in paths], val)


def open_source(path: str, cfg: Data, tokenizer: Tokenizer, option: str, texts: list[str] | None = None):
    """A tokenized folder as it is, or a raw-text path through the cache."""
    if is_tokenized(path):
        folder = TokenizedFolder(path, option)
        if folder.tokenizer_sha256 != sha256(tokenizer):
            asked = f"data.tokenizer {cfg.tokenizer!r}" if cfg.tokenizer else "the run's tokenizer"
            raise ConfigError(f"{option}: {path} was tokenized with another tokenizer than {asked} (sha256 "
                              f"{folder.tokenizer_sha256[:12]} vs {sha256(tokenizer)[:12]}); tokenize it again with "
                              "that tokenizer, or train with the folder's own (drop data.tokenizer)")
        return folder
    if texts is None:
        try:
            texts = load_texts(path, cfg.text_field)
        except ConfigError as e:  # the documents' errors name data.path; this source may be another option
            raise ConfigError(str(e).replace("data.path:", f"{option}:", 1)) from None
    # the format in the name: a cache entry an older plait encoded differently is not reused
    version = FORMAT.rsplit("/", 1)[1]
    folder = cache_dir() / f"tokens-v{version}-{fingerprint(texts)[:16]}-{sha256(tokenizer)[:16]}"
    with file_lock(folder.with_name(folder.name + ".lock")):
        if not (folder / MANIFEST).exists():
            write_folder(((text, len(text)) for text in texts), tokenizer, folder, path or "(bundled corpus)")
    return TokenizedFolder(folder, option, label=path or "the bundled corpus")
