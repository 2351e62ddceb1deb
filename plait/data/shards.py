"""Tokenized folders: a corpus tokenized once, read through memory maps.

A folder holds `shard-NNNNN.bin` files (the raw token ids, uint16 when the vocabulary fits,
else uint32, each document followed by EOS, as nanoGPT's and Megatron's .bin files), the
`tokenizer.json` that made them and `manifest.json`: the tokenizer's hash, the token count,
source hash and token hash of every shard, EOS id. Shards are cut at document boundaries
after a fixed amount of text, so the shards (and every byte in them) do not depend on how
many processes tokenized them. A shard is renamed into place when complete and recorded in a
`shard-NNNNN.json` beside it; the manifest is written last, so a folder without one is an
unfinished tokenize, which a rerun finishes, never a corpus.

Opening a folder reads the manifest and stats the shards; tokens are read only where a batch
needs them, so start-up time and memory do not grow with the corpus. A folder under a URL
(plait/storage.py) is read the same way, by ranged requests: no rank downloads a whole shard.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import re
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from plait import jsonl, storage
from plait.config import ConfigError
from plait.data.documents import fingerprint
from plait.data.tokenizer import eos_id, sha256, text_encoder

# Format 2: special-token strings inside a document are text. Format 1 matched them (a document
# mentioning <|endoftext|> held a boundary); its folders are still read, as they were.
FORMAT = "plait-tokens/2"
READABLE = ("plait-tokens/1", FORMAT)
MANIFEST = "manifest.json"
PARTIAL = "partial.json"  # the settings of a tokenize in progress
TOKENIZER = "tokenizer.json"
SETTING_NAMES = {"format": "format", "tokenizer_sha256": "tokenizer", "shard_chars": "shard_mb"}
SHARD = re.compile(r"shard-(\d{5})\.(bin|json)$")


def is_tokenized(path: str | Path) -> bool:
    p = storage.location(path)
    return p.is_dir() and ((p / MANIFEST).exists() or (p / PARTIAL).exists())


def _write_json(path: Path, value: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(value, indent=1))
    os.replace(tmp, path)


# -----------------------------------------------------------------------------
# writing

def write_folder(documents: Iterable[tuple[str, int]], tokenizer: Tokenizer, out: Path, source: str,
                 workers: int = 0, shard_chars: int = 64_000_000, progress=None, kept: list | None = None) -> dict:
    """Tokenize `documents` ((text, source bytes) pairs) into `out`; returns the manifest.
    `workers` processes encode shards in parallel (0: this process). Shards already in `out` from
    an interrupted or earlier run are kept where their source text is unchanged (their manifest
    entries are appended to `kept`, so a caller can report the new work alone)."""
    settings = {"format": FORMAT, "tokenizer_sha256": sha256(tokenizer), "shard_chars": shard_chars}
    done = _finished_shards(out, settings)
    _write_json(out / PARTIAL, settings)
    tokenizer.save(str(out / TOKENIZER))
    dtype = "uint16" if tokenizer.get_vocab_size() <= 1 << 16 else "uint32"
    eos, encoder = eos_id(tokenizer), text_encoder(tokenizer)
    entries: list[dict] = []
    pending: collections.deque = collections.deque()

    def settle(item) -> None:
        k, result, source_bytes = item
        entry = result.result() if isinstance(result, Future) else result
        _write_json(out / f"shard-{k:05d}.json", entry)
        entries.append(entry)
        if progress is not None:
            progress.update(source_bytes)
            documents, tokens = sum(e["documents"] for e in entries), sum(e["tokens"] for e in entries)
            rate = tokens / max(progress.format_dict["elapsed"], 1e-9)
            progress.set_postfix_str(f"{documents:,} documents, {tokens:,} tokens, {rate:,.0f} tokens/s")

    pool = ProcessPoolExecutor(workers, get_context("spawn"), _start_worker, (tokenizer.to_str(),)) if workers else None
    try:
        for k, texts, source_bytes in _chunks(documents, shard_chars):
            source_sha, old = fingerprint(texts), done.get(k)
            if old and old["source_sha256"] == source_sha and _size_ok(out / old["file"], old, dtype):
                result = old
                if kept is not None:
                    kept.append(old)
            elif pool:
                result = pool.submit(_encode_shard, None, eos, dtype, out, k, texts, source_sha)
            else:
                result = _encode_shard(encoder, eos, dtype, out, k, texts, source_sha)
            pending.append((k, result, source_bytes))
            while len(pending) > 2 * workers:  # bounded: the corpus never sits in memory
                settle(pending.popleft())
        while pending:
            settle(pending.popleft())
    finally:
        if pool:
            pool.shutdown(cancel_futures=True)
    if not sum(e["tokens"] for e in entries):
        raise ConfigError(f"data.path: {source!r} holds no text")
    for stale in out.iterdir():  # shards of a longer earlier source, sidecars, temporary files
        match = SHARD.match(stale.name)
        if stale.name.endswith(".tmp") or (match and (match.group(2) == "json" or int(match.group(1)) >= len(entries))):
            stale.unlink()
    whole = hashlib.sha256("".join(e["tokens_sha256"] for e in entries).encode()).hexdigest()
    manifest = {**settings, "source": source, "vocab_size": tokenizer.get_vocab_size(), "eos_id": eos, "dtype": dtype,
                "documents": sum(e["documents"] for e in entries), "tokens": sum(e["tokens"] for e in entries),
                "tokens_sha256": whole, "shards": entries}
    _write_json(out / MANIFEST, manifest)
    (out / PARTIAL).unlink()
    return manifest


def _finished_shards(out: Path, settings: dict) -> dict[int, dict]:
    """Shards an earlier run of the same settings left in `out`, by index."""
    if out.exists() and any(out.iterdir()) and not is_tokenized(out):
        raise ConfigError(f"out: {out} is not empty and not a tokenized folder; choose an empty or new folder")
    out.mkdir(parents=True, exist_ok=True)
    done: dict[int, dict] = {}
    for path in (out / MANIFEST, out / PARTIAL):
        earlier = jsonl.object_or_none(path)
        if earlier is not None and {k: earlier.get(k) for k in settings} != settings:
            differ = [SETTING_NAMES[k] for k in settings if earlier.get(k) != settings[k]]
            raise ConfigError(f"out: {out} holds tokens made with another {' and '.join(differ)}; remove it or "
                              "choose another folder")
        if path.name == MANIFEST and earlier is not None:
            done = dict(enumerate(earlier["shards"]))
            path.unlink()  # from here on the folder is unfinished until the new manifest
    for sidecar in sorted(out.glob("shard-*.json")):
        if (entry := jsonl.object_or_none(sidecar)) is not None:
            done[int(SHARD.match(sidecar.name).group(1))] = entry
    return done


def _chunks(documents: Iterable[tuple[str, int]], shard_chars: int) -> Iterator[tuple[int, list[str], int]]:
    texts, chars, source_bytes, k = [], 0, 0, 0
    for text, size in documents:
        texts.append(text)
        chars += len(text)
        source_bytes += size
        if chars >= shard_chars:
            yield k, texts, source_bytes
            texts, chars, source_bytes, k = [], 0, 0, k + 1
    if texts:
        yield k, texts, source_bytes


def _size_ok(path: Path, entry: dict, dtype: str) -> bool:
    return path.exists() and path.stat().st_size == entry["tokens"] * np.dtype(dtype).itemsize


_worker_tokenizer: Tokenizer | None = None


def _start_worker(tokenizer_json: str) -> None:
    global _worker_tokenizer
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker: --workers is the parallelism
    _worker_tokenizer = text_encoder(Tokenizer.from_str(tokenizer_json))


def _encode_shard(tokenizer: Tokenizer | None, eos: int, dtype: str, out: Path, k: int, texts: list[str],
                  source_sha: str) -> dict:
    tokenizer = tokenizer or _worker_tokenizer
    parts, end = [], np.array([eos], dtype=dtype)
    for i in range(0, len(texts), 4096):  # chunks bound the memory held by Encoding objects
        # no special tokens (e.g. Llama 3's BOS): the EOS after each document is the only separator
        for encoding in tokenizer.encode_batch_fast(texts[i:i + 4096], add_special_tokens=False):
            parts += [np.asarray(encoding.ids, dtype=dtype), end]
    tokens = np.concatenate(parts)
    name = f"shard-{k:05d}.bin"
    tmp = out / f".{name}.{os.getpid()}.tmp"
    tokens.tofile(tmp)
    os.replace(tmp, out / name)
    return {"file": name, "documents": len(texts), "tokens": len(tokens), "source_sha256": source_sha,
            "tokens_sha256": hashlib.sha256(tokens.tobytes()).hexdigest()}


# -----------------------------------------------------------------------------
# reading

class TokenizedFolder:
    """The token stream of a tokenized folder: its shards end to end, memory-mapped on first use."""

    def __init__(self, path: str | Path, option: str = "data.path", label: str = ""):
        self.path = storage.location(path, option)
        self.label = label or str(path)  # what errors call it: the user's raw-text path for a cache entry
        manifest = jsonl.object_or_none(self.path / MANIFEST)
        if manifest is None:
            unfinished = (self.path / PARTIAL).exists()
            raise ConfigError(f"{option}: {path} " + ("is an unfinished `plait tokenize`: run it again to finish it"
                                                      if unfinished else f"has no readable {MANIFEST}"))
        if manifest.get("format") not in READABLE:
            raise ConfigError(f"{option}: {path} is in format {manifest.get('format')!r}; this plait reads {READABLE}")
        self.manifest, self.dtype = manifest, np.dtype(manifest["dtype"])
        for entry in manifest["shards"]:
            shard = self.path / entry["file"]
            size = shard.stat().st_size if shard.exists() else None
            if size != entry["tokens"] * self.dtype.itemsize:
                raise ConfigError(f"{option}: {shard} holds {size} bytes but the manifest says {entry['tokens']} "
                                  f"{self.dtype} tokens: the folder does not match its manifest; tokenize again")
        self.ends = np.cumsum([entry["tokens"] for entry in manifest["shards"]])
        self._maps: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return int(self.ends[-1])

    @property
    def fingerprint(self) -> str:
        return self.manifest["tokens_sha256"]

    @property
    def tokenizer_sha256(self) -> str:
        return self.manifest["tokenizer_sha256"]

    def read(self, start: int, count: int) -> np.ndarray:
        """Tokens [start, start + count) of the stream, as int64."""
        parts = []
        while count > 0:
            k = int(np.searchsorted(self.ends, start, side="right"))
            first = int(self.ends[k]) - self.manifest["shards"][k]["tokens"]
            take = min(count, int(self.ends[k]) - start)
            parts.append(self._shard(k)[start - first:start - first + take])
            start, count = start + take, count - take
        return np.concatenate(parts).astype(np.int64)

    def locate(self, start: int, count: int, eos: int) -> str:
        """Where tokens [start, start + count) are: the shard file, the offsets in it, and which of
        its documents (counted by `eos`, from 0) they cover. Reads the shard up to there: for an
        error's report, not for training."""
        k = int(np.searchsorted(self.ends, start, side="right"))
        offset = start - (int(self.ends[k]) - self.manifest["shards"][k]["tokens"])
        tokens = self._shard(k)[:offset + count]
        first = int(np.count_nonzero(tokens[:offset] == eos))
        last = first + int(np.count_nonzero(tokens[offset:offset + count - 1] == eos))
        shard = self.path / self.manifest["shards"][k]["file"]
        return f"{shard} tokens {offset}-{offset + count} (documents {first}-{last})"

    def _shard(self, k: int) -> np.ndarray:
        if k not in self._maps:
            path = self.path / self.manifest["shards"][k]["file"]
            self._maps[k] = RangedShard(path, self.dtype) if storage.is_remote(path) else \
                np.memmap(path, dtype=self.dtype, mode="r")
        return self._maps[k]


class RangedShard:
    """A shard under a URL, sliced as a memory map is: each slice one ranged read of its bytes."""

    def __init__(self, path, dtype: np.dtype):
        self.path, self.dtype = path, dtype

    def __getitem__(self, part: slice) -> np.ndarray:
        size = self.dtype.itemsize
        data = self.path.fs.cat_file(self.path.path, start=(part.start or 0) * size, end=part.stop * size)
        return np.frombuffer(data, dtype=self.dtype)
