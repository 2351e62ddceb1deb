"""`plait tokenize`: a corpus tokenized once, in parallel processes, into a tokenized folder.

    plait tokenize --data.path corpus/ --out tokens/ [--data.tokenizer tokenizer.json] [--workers N]
    plait train --data.path tokens/

An interrupted tokenize, run again with the same options, keeps the shards it finished.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from plait.arguments import parse
from plait.config import ConfigError, Data
from plait.data import build_tokenizer
from plait.data.documents import iter_documents, source_bytes
from plait.data.shards import is_tokenized, write_folder


@dataclass
class TokenizeArgs:
    out: str
    """the tokenized folder to write (or to finish, after an interruption)"""
    data: Data = field(default_factory=Data)
    workers: int = os.cpu_count() or 1
    """processes that encode shards in parallel, one core each"""
    shard_mb: float = 64.0
    """text per shard, in millions of characters (shards are the unit of parallel work and of resumption)"""


def main(argv: list[str]) -> int:
    opts = parse(TokenizeArgs, argv, "plait tokenize")
    d = opts.data
    if d.mix or d.val_path:
        raise ConfigError("data.mix / data.val_path: plait tokenize takes one data.path; tokenize each source "
                          "into a folder of its own")
    if d.path and not Path(d.path).exists():
        raise ConfigError(f"data.path: {d.path!r} does not exist")
    if is_tokenized(d.path):
        raise ConfigError(f"data.path: {d.path} is already a tokenized folder")
    if opts.workers < 1 or opts.shard_mb <= 0:
        raise ConfigError(f"workers must be >= 1 and shard_mb > 0, got {opts.workers}, {opts.shard_mb}")
    tokenizer = build_tokenizer(d)
    start = time.perf_counter()
    with tqdm(total=source_bytes(d.path) or None, unit="B", unit_scale=True, desc="tokenize", mininterval=1) as bar:
        manifest = write_folder(iter_documents(d.path, d.text_field), tokenizer, Path(opts.out),
                                d.path or "(bundled corpus)", opts.workers, int(opts.shard_mb * 1e6), bar)
    seconds = time.perf_counter() - start
    print(f"plait: tokenized {manifest['documents']} documents into {manifest['tokens']} tokens "
          f"({manifest['dtype']}, {len(manifest['shards'])} shards) in {opts.out}: {seconds:.1f} s, "
          f"{manifest['tokens'] / seconds:,.0f} tokens/s with {opts.workers} workers")
    return 0
