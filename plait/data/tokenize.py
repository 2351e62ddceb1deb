"""`plait tokenize`: a corpus tokenized once, in parallel processes, into a tokenized folder.

    plait tokenize --data.path corpus/ --out tokens/ [--data.tokenizer tokenizer.json] [--workers N]
    plait train --data.path tokens/

An interrupted tokenize, run again with the same options, keeps the shards it finished. An --out
under a URL (s3://...: plait/storage.py) is written in the cache first, where a rerun finishes it,
and uploaded shard by shard, its manifest last.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import tyro
from tqdm import tqdm

from plait import storage
from plait.arguments import parse
from plait.cache import cache_dir
from plait.config import ConfigError, Data
from plait.data import build_tokenizer
from plait.data.documents import iter_documents, source_bytes
from plait.data.shards import MANIFEST, is_tokenized, write_folder


# The data options tokenize takes: one raw source. Mixtures and validation sets are tokenized a
# folder each, so their options are left out of --help (main refuses them in one line).
@dataclass
class Source(Data):
    path: str = ""
    """raw text: a .txt/.jsonl/.parquet file, a folder of them, or a Hugging Face `datasets` folder; empty = bundled corpus"""
    mix: tyro.conf.Suppress[str] = ""
    val_path: tyro.conf.Suppress[str] = ""


@dataclass
class TokenizeArgs:
    out: str
    """the tokenized folder to write (or to finish, after an interruption)"""
    data: Source = field(default_factory=Source)
    workers: int = os.cpu_count() or 1
    """processes that encode shards in parallel, one core each"""
    shard_mb: float = 64.0
    """text per shard, in millions of characters (shards are the unit of parallel work and of resumption)"""


def main(argv: list[str]) -> int:
    if refused := [arg.split("=")[0][2:] for arg in argv if arg.split("=")[0] in ("--data.mix", "--data.val_path")]:
        raise ConfigError(f"{refused[0]}: plait tokenize takes one data.path; tokenize each source into a folder "
                          "of its own")
    opts = parse(TokenizeArgs, argv, "plait tokenize")
    d = opts.data
    if d.path and not Path(d.path).exists():
        raise ConfigError(f"data.path: {d.path!r} does not exist")
    if is_tokenized(d.path):
        raise ConfigError(f"data.path: {d.path} is already a tokenized folder")
    if opts.workers < 1 or opts.shard_mb <= 0:
        raise ConfigError(f"workers must be >= 1 and shard_mb > 0, got {opts.workers}, {opts.shard_mb}")
    out = target = storage.location(opts.out, "out")
    if storage.is_remote(target):
        storage.check_reachable(opts.out, "out")
        out = cache_dir() / f"upload-{hashlib.sha256(opts.out.encode()).hexdigest()[:16]}"
    tokenizer = build_tokenizer(d)
    start, kept = time.perf_counter(), []
    with tqdm(total=source_bytes(d.path, d.extensions) or None, unit="B", unit_scale=True, desc="tokenize", mininterval=1) as bar:
        manifest = write_folder(iter_documents(d.path, d.text_field, d.extensions), tokenizer, out,
                                d.path or "(bundled corpus)", opts.workers, int(opts.shard_mb * 1e6), bar, kept)
    if out != target:
        storage.upload(out, target, last=MANIFEST)
        storage.remove_tree(out)
    seconds = time.perf_counter() - start
    folder = f"{manifest['documents']} documents, {manifest['tokens']} tokens ({manifest['dtype']}, " \
             f"{len(manifest['shards'])} shards)"
    if len(kept) == len(manifest["shards"]):  # checking the source against the shards is all it did
        print(f"plait: {opts.out} already holds this source tokenized: {folder}; nothing to do")
        return 0
    # the speed of this run's work alone: shards kept from an interrupted run took no time here
    new_tokens = manifest["tokens"] - sum(entry["tokens"] for entry in kept)
    resumed = f", {len(kept)} shards kept from an earlier run" if kept else ""
    print(f"plait: tokenized {folder} into {opts.out}{resumed}: {seconds:.1f} s, {new_tokens / seconds:,.0f} "
          f"tokens/s with {opts.workers} workers")
    return 0
