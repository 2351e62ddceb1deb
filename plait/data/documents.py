"""Raw documents: text files (.txt, .md, data.extensions: one document each), JSON lines (.jsonl,
and compressed as corpora ship them: Dolma's .json.gz, DCLM's .jsonl.zst, streamed), .parquet
files, folders of them, Hugging Face `datasets` folders.

Documents stream one at a time, each with the bytes of its source it used up, so `plait tokenize`
can show progress through a corpus larger than memory.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import importlib
import io
import json
import os
import re
import sys
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path

from plait.config import ConfigError

TEXT = (".txt", ".md")  # a file of these is one document
JSON_LINES = (".jsonl", ".jsonl.gz", ".json.gz", ".jsonl.zst", ".json.zst")  # a document per line, {text_field: ...}
SUFFIXES = (*TEXT, *JSON_LINES, ".parquet")
DATASETS_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")  # written by save_to_disk


def iter_documents(path: str, text_field: str = "text", extensions: tuple[str, ...] = ()) -> Iterator[tuple[str, int]]:
    """(text, source bytes read for it) for each document of `path`, in a fixed order;
    "" is the CPython documentation that ships with every Python. `extensions`: more suffixes
    read as text (data.extensions)."""
    if not path:
        from pydoc_data.topics import topics
        for key in sorted(topics):  # sorted: dict order is not a contract
            yield topics[key], len(topics[key])
        return
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"data.path: {path!r} does not exist")
    if p.is_dir() and any((p / marker).exists() for marker in DATASETS_MARKERS):
        yield from ((text, 0) for text in _datasets_texts(p, text_field))
    elif p.is_dir():
        files = source_files(p, extensions)
        if not files:
            raise ConfigError(f"data.path: folder {path!r} holds no {'/'.join(suffixes(extensions))} files "
                              "(data.extensions adds text suffixes)")
        for f in files:
            yield from _file_documents(f, text_field, extensions)
    elif not p.is_file():  # (a device such as /dev/zero: a read without end)
        raise ConfigError(f"data.path: {path!r} is neither a folder nor a regular file")
    else:
        yield from _file_documents(p, text_field, extensions)


def suffixes(extensions: tuple[str, ...] = ()) -> tuple[str, ...]:
    """Every suffix read: SUFFIXES and data.extensions (with or without their dot)."""
    return (*SUFFIXES, *(e if e.startswith(".") else f".{e}" for e in extensions))


def kind(f: Path, extensions: tuple[str, ...] = ()) -> str | None:
    """The suffix `f` is read by (a compressed one whole: .jsonl.gz), or None."""
    return next((s for s in sorted(suffixes(extensions), key=len, reverse=True) if f.name.endswith(s)), None)


def source_files(p: Path, extensions: tuple[str, ...] = ()) -> list[Path]:
    return sorted(f for f in p.rglob("*") if f.is_file() and kind(f, extensions)) if p.is_dir() else [p]


def source_bytes(path: str, extensions: tuple[str, ...] = ()) -> int:
    """The size of what iter_documents reads (0 where unknown), for a progress bar's total."""
    if not path:
        from pydoc_data.topics import topics
        return sum(map(len, topics.values()))
    return sum(f.stat().st_size for f in source_files(Path(path), extensions))


def load_texts(path: str, text_field: str = "text", extensions: tuple[str, ...] = ()) -> list[str]:
    """Every document of `path` in memory: for small corpora (the bundled one, tests)."""
    texts = [text for text, _ in iter_documents(path, text_field, extensions)]
    if not any(texts):
        raise ConfigError(f"data.path: {path!r} holds no text")
    return texts


def _file_documents(f: Path, field: str, extensions: tuple[str, ...] = ()) -> Iterator[tuple[str, int]]:
    suffix = kind(f, extensions)
    if suffix in JSON_LINES:
        yield from _json_lines(f, field, suffix)
    elif suffix in suffixes(extensions) and suffix != ".parquet":  # a text file: one document
        yield checked_text(f.read_text(encoding="utf-8", errors="replace"), f), f.stat().st_size
    elif f.suffix == ".parquet":
        pq = _require("pyarrow.parquet", "pyarrow", f"reading {f}")
        columns = pq.read_schema(f).names
        if field not in columns:
            raise ConfigError(f"data.text_field: {f} has no column {field!r}; columns: {columns}")
        parquet = pq.ParquetFile(f)
        per_row = f.stat().st_size // max(1, parquet.metadata.num_rows)
        for batch in parquet.iter_batches(columns=[field]):
            yield from ((t, per_row) for t in batch.column(0).to_pylist() if t is not None)
    else:
        raise ConfigError(f"data.path: {str(f)!r} has an unsupported extension; allowed: "
                          f"{', '.join(suffixes(extensions))}, a folder of them, or a Hugging Face datasets folder "
                          "(data.extensions adds text suffixes)")


def _json_lines(f: Path, field: str, suffix: str) -> Iterator[tuple[str, int]]:
    """A JSON lines file's documents, decompressed as they stream (never whole in memory), each
    with the bytes of the file read up to it (the compressed ones, for a progress bar)."""
    with open(f, "rb") as raw, _decompressed(raw, f, suffix) as lines:
        done, n = 0, 0
        try:
            for n, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError as e:  # not JSON, or not UTF-8
                    raise ConfigError(f"data.path: {f}:{n} is not valid JSON: {e}") from None
                if not isinstance(row, dict) or not isinstance(row.get(field), str):
                    raise ConfigError(f"data.text_field: {f}:{n} has no string field {field!r}")
                yield row[field], raw.tell() - done
                done = raw.tell()
        except ConfigError:
            raise
        except Exception as e:  # a truncated or corrupt archive: OSError, EOFError, zlib.error, zstandard's ZstdError
            if not isinstance(e, (OSError, EOFError, zlib.error)) and type(e).__name__ != "ZstdError":
                raise
            raise ConfigError(f"data.path: {f} is not a readable {suffix} file (after line {n}): {e}") from None


def _decompressed(raw, f: Path, suffix: str):
    if suffix.endswith(".gz"):
        return gzip.GzipFile(fileobj=raw)
    if suffix.endswith(".zst"):
        zstandard = _require("zstandard", "zstandard", f"reading {f}")
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw))
    return contextlib.nullcontext(raw)


# what is not text: bytes that are not UTF-8 (decoded as U+FFFD) and control characters other than
# tab, newline, form feed and carriage return
NOT_TEXT = re.compile("[\x00-\x08\x0b\x0e-\x1f\x7f\ufffd]")
MOSTLY_NOT_TEXT = 0.5


def checked_text(text: str, f: Path) -> str:
    """A .txt file's text, refused when it is mostly not text (a binary file, random bytes), and
    with a note from rank 0 saying how much of it is not, where any is."""
    bad = len(NOT_TEXT.findall(text))
    if bad:
        share = f"{bad / len(text):.2%} of its {len(text):,} characters are invalid UTF-8 or control characters"
        if bad > MOSTLY_NOT_TEXT * len(text):
            raise ConfigError(f"data.path: {f} is mostly not text ({share}); a binary file?")
        if os.environ.get("RANK", "0") == "0":
            print(f"plait: note: {f}: {share} (trained on as they are: U+FFFD and the control characters)",
                  file=sys.stderr, flush=True)
    return text


def _datasets_texts(p: Path, field: str) -> Iterable[str]:
    datasets = _require("datasets", "datasets", f"{p} is a Hugging Face datasets folder; reading it")
    ds = datasets.load_from_disk(str(p))
    if isinstance(ds, datasets.DatasetDict):
        ds = ds["train"] if "train" in ds else ds[next(iter(ds))]
    if field not in ds.column_names:
        raise ConfigError(f"data.text_field: {p} has no column {field!r}; columns: {ds.column_names}")
    return (t for t in ds[field] if t is not None)


def _require(module: str, package: str, what: str):
    # optional dependencies: only the inputs that need them pay for them
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(f"data.path: {what} needs `{package}`: pip install 'plait[data]'") from None


def fingerprint(texts: Iterable[str]) -> str:
    """sha256 of the documents, boundaries included: ["ab", "c"] != ["a", "bc"]."""
    h = hashlib.sha256()
    for text in texts:
        b = text.encode("utf-8")
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()
