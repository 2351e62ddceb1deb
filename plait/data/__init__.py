"""Training data: documents -> tokenizer -> tokenized folders -> per-rank batches.

Every source of a run is a tokenized folder (`plait/data/shards.py`): one `plait tokenize` made,
or, for a raw-text path, one built in the cache (`$PLAIT_CACHE`, default ~/.cache/plait) the
first time that corpus and tokenizer meet, by one rank under a file lock while the others wait.
A raw path is still read and hashed at every start (that is how its cache entry is found), so
large corpora are tokenized once with `plait tokenize` and trained from the folder.
"""

from __future__ import annotations

import hashlib
import shlex
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from plait import storage
from plait.config import ConfigError, Data
from plait.data.mixture import RAW_NEEDS_TOKENIZER, mix_sources
from plait.data.phases import phase_paths
from plait.data.documents import fingerprint, load_texts
from plait.data.loader import BatchLoader, eval_batches
from plait.data.shards import FORMAT, MANIFEST, TOKENIZER, TokenizedFolder, is_tokenized, write_folder
from plait.cache import cache_dir, file_lock
from plait.data.tokenizer import eos_id, load_tokenizer, sha256, trained_tokenizer

__all__ = ["BatchLoader", "Corpus", "build_tokenizer", "eos_id", "eval_batches", "open_data", "vocab_size"]


@dataclass
class Corpus:
    tokenizer: Tokenizer
    sources: list[TokenizedFolder]  # the run's own (data.path or data.mix), then those only phases name
    weights: list[float]  # the run's own sources'
    val: TokenizedFolder | None
    paths: list[str]  # each source's, as the options give it

    @property
    def fingerprint(self) -> str:
        """The run's own token streams and their weights, by content: part of a job's identity
        (not the phases': a job may gain an anneal when it is resumed)."""
        if len(self.weights) == 1:
            return self.sources[0].fingerprint
        parts = [f"{s.fingerprint}:{w!r}" for s, w in zip(self.sources, self.weights)]
        return hashlib.sha256(",".join(parts).encode()).hexdigest()

    def phase_weights(self, phases) -> dict[int, list[float]]:
        """Each phase with a mixture -> its weight for each source."""
        weights = {}
        for phase in phases.phases if phases else ():
            if phase.mix:
                given = dict(mix_sources(phase.mix, f"training.phases: phase {phase.number}'s mix"))
                weights[phase.number] = [given.get(path, 0.0) for path in self.paths]
        return weights


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
            return load_tokenizer(str(storage.location(path, option) / TOKENIZER), option)
    if cfg.mix:
        raise ConfigError(RAW_NEEDS_TOKENIZER)
    return None


def vocab_size(cfg: Data) -> int:
    """The vocabulary of the run's tokenizer without tokenizing anything (for `plait plan`): a
    given tokenizer's, else the trained BPE's data.vocab_size (which a corpus of any size reaches)."""
    given = _given_tokenizer(cfg)
    return given.get_vocab_size() if given is not None else cfg.vocab_size


def open_data(cfg: Data, hf_start: Path | None = None, phases: tuple[str, ...] = ()) -> Corpus:
    """The run's tokenizer and token streams; checked, and built where needed, before any process
    group. `hf_start`: the Hugging Face folder the run starts from (checkpoint.load), whose own
    tokenizer.json data.tokenizer then is unless the user gave one (the messages say which);
    `phases`: training.phases, whose mixtures may name more sources."""
    paths = _train_paths(cfg)
    texts = None if cfg.tokenizer or cfg.mix or is_tokenized(cfg.path) else load_texts(cfg.path, cfg.text_field, cfg.extensions)
    tokenizer = build_tokenizer(cfg, texts)
    option = "data.mix" if cfg.mix else "data.path"
    sources = [open_source(path, cfg, tokenizer, option, texts, hf_start) for path, _ in paths]
    extra = phase_paths(cfg, phases)  # (raw text among them is tokenized with the run's tokenizer)
    sources += [open_source(path, cfg, tokenizer, "training.phases", hf_start=hf_start) for path in extra]
    val = open_source(cfg.val_path, cfg, tokenizer, "data.val_path", hf_start=hf_start) if cfg.val_path else None
    return Corpus(tokenizer, sources, [w for _, w in paths], val, [path for path, _ in paths] + extra)


def open_source(path: str, cfg: Data, tokenizer: Tokenizer, option: str, texts: list[str] | None = None,
                hf_start: Path | None = None):
    """A tokenized folder as it is, or a raw-text path through the cache."""
    if is_tokenized(path):
        folder = TokenizedFolder(path, option)
        if folder.tokenizer_sha256 != sha256(tokenizer):
            raise ConfigError(_other_tokenizer(path, folder, cfg, sha256(tokenizer), option, hf_start))
        return folder
    if texts is None:
        try:
            texts = load_texts(path, cfg.text_field, cfg.extensions)
        except ConfigError as e:  # the documents' errors name data.path; this source may be another option
            raise ConfigError(str(e).replace("data.path:", f"{option}:", 1)) from None
    # the format in the name: a cache entry an older plait encoded differently is not reused
    version = FORMAT.rsplit("/", 1)[1]
    folder = cache_dir() / f"tokens-v{version}-{fingerprint(texts)[:16]}-{sha256(tokenizer)[:16]}"
    with file_lock(folder.with_name(folder.name + ".lock")):
        if not (folder / MANIFEST).exists():
            write_folder(((text, len(text)) for text in texts), tokenizer, folder, path or "(bundled corpus)")
    return TokenizedFolder(folder, option, label=path or "the bundled corpus")


def _other_tokenizer(path: str, folder: TokenizedFolder, cfg: Data, run_sha256: str, option: str,
                     hf_start: Path | None) -> str:
    """Why `folder` does not fit the run's tokenizer, and the exact command that tokenizes its
    text with that tokenizer. Dropping data.tokenizer is offered only where the user gave one and
    the run would then take this folder's own (no Hugging Face folder's instead)."""
    if hf_start is not None and cfg.tokenizer == str(hf_start / TOKENIZER):
        tokenizer_file = cfg.tokenizer
        asked = f"{cfg.tokenizer} (checkpoint.load's own: the model's embeddings are that tokenizer's)"
    elif cfg.tokenizer:
        tokenizer_file, asked = cfg.tokenizer, f"data.tokenizer {cfg.tokenizer!r}"
    else:  # the first tokenized training folder's own, else a BPE trained on data.path (in the cache)
        first = next((p for p, _ in _train_paths(cfg) if is_tokenized(p)), None)
        tokenizer_file, asked = (str(Path(first) / TOKENIZER) if first else ""), "the run's tokenizer"
    message = (f"{option}: {path} was tokenized with another tokenizer than {asked} (sha256 "
               f"{folder.tokenizer_sha256[:12]} vs {run_sha256[:12]}); ")
    if tokenizer_file:
        raw = folder.manifest.get("source", "")  # the text the folder was made from, as tokenize was given it
        out = f"{Path(path)}-{Path(tokenizer_file).parent.name or 'retokenized'}"
        command = ["plait", "tokenize", *(["--data.path", raw] if raw != "(bundled corpus)" else []), "--out", out,
                   "--data.tokenizer", tokenizer_file]
        message += f"tokenize its text with that one: {shlex.join(command)}, and train from {out}"
    else:
        message += f"give {option} as raw text instead: it is tokenized with the run's tokenizer at start-up"
    if cfg.tokenizer and hf_start is None and option == "data.path":
        message += "; or train with the folder's own tokenizer (drop data.tokenizer)"
    return message
