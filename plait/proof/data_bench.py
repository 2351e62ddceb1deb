"""Data at scale, measured: tokenize throughput by worker count, and start-up time and memory of
a rank from raw text vs from a tokenized folder, for generated corpora of the given sizes.

    python -m plait.proof.data_bench --sizes_mb 300 3000 --workers 1 2 --out /tmp/data-bench

Prints one table; each start-up is a fresh process (open the data, read one batch), after a
first start that built the raw text's cache entry.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import tyro

STARTUP = """
import sys, time
from plait.config import Data
from plait.data import BatchLoader, open_data

def kib(field):
    return int(next(line for line in open("/proc/self/status") if line.startswith(field)).split()[1])

path, tokenizer, seq_len, batch = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
before, start = kib("VmRSS:"), time.perf_counter()
corpus = open_data(Data(path=path, tokenizer=tokenizer))
BatchLoader(corpus.sources, corpus.weights, seq_len, batch, batch, 0, 1, 0).next_batches()
print((kib("VmHWM:") - before) / 1024, time.perf_counter() - start)
"""


@dataclass
class DataBenchArgs:
    out: str
    """working folder: corpora, tokenizer, tokenized folders (several GB for large sizes)"""
    sizes_mb: list[int] = field(default_factory=lambda: [300])
    """generated corpus sizes (MB of .jsonl)"""
    workers: list[int] = field(default_factory=lambda: [1, 2])
    """worker counts to tokenize with (the largest size runs only the largest count)"""
    raw: bool = True
    """also measure start-up from the raw text (its cache entry is built first: a single-process tokenize)"""


def generate(path: Path, megabytes: int, seed: int = 0) -> None:
    """Zipf-distributed pseudo-words in documents of 50-2000 words, until the file has the size."""
    if path.exists() and path.stat().st_size >= megabytes * 1e6:
        return
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlucmfwypvbgkjqxz"))
    words = np.array(["".join(rng.choice(letters, rng.integers(1, 10))) for _ in range(20000)])
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        while f.tell() < megabytes * 1e6:
            lengths = rng.integers(50, 2000, 1000)
            ids = np.minimum(rng.zipf(1.2, lengths.sum()), len(words)) - 1
            for doc in np.split(words[ids], np.cumsum(lengths)[:-1]):
                f.write(json.dumps({"text": " ".join(doc.tolist())}) + "\n")
    os.replace(tmp, path)


def startup(path: Path, tokenizer: Path, seq_len: int = 2048, batch: int = 8) -> tuple[float, float]:
    """(peak RSS growth in MiB, seconds) of opening `path` and reading one batch, in a fresh
    process, after the imports (the same for every corpus)."""
    out = subprocess.run([sys.executable, "-c", STARTUP, str(path), str(tokenizer), str(seq_len), str(batch)],
                         capture_output=True, text=True, check=True).stdout.split()
    return float(out[0]), float(out[1])


def main(argv: list[str] | None = None) -> int:
    args = tyro.cli(DataBenchArgs, args=argv, use_underscores=True)
    from plait.data.documents import iter_documents
    from plait.data.tokenizer import train_bpe

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ["PLAIT_CACHE"] = str(out / "cache")
    rows = []
    for size in args.sizes_mb:
        corpus = out / f"corpus-{size}mb.jsonl"
        generate(corpus, size)
        tokenizer = out / "tokenizer.json"
        if not tokenizer.exists():
            sample = [text for _, (text, _) in zip(range(2000), iter_documents(str(corpus)))]
            train_bpe(sample, 4096).save(str(tokenizer))
        row = {"corpus": f"{size} MB"}
        for workers in args.workers if size == min(args.sizes_mb) else [max(args.workers)]:
            folder = out / f"tokens-{size}mb-w{workers}"
            subprocess.run(["rm", "-rf", str(folder)], check=True)
            start = time.perf_counter()
            subprocess.run([sys.executable, "-m", "plait", "tokenize", "--data.path", str(corpus), "--data.tokenizer",
                            str(tokenizer), "--out", str(folder), "--workers", str(workers)], check=True,
                           stderr=subprocess.DEVNULL)
            tokens = json.loads((folder / "manifest.json").read_text())["tokens"]
            row["tokens"] = tokens
            row[f"tokenize {workers}w tok/s"] = f"{tokens / (time.perf_counter() - start):,.0f}"
        rss, seconds = startup(folder, tokenizer)
        row["start tokenized"] = f"{seconds:.2f} s, {rss:.0f} MiB"
        if args.raw:
            startup(corpus, tokenizer)  # builds the cache entry
            rss, seconds = startup(corpus, tokenizer)
            row["start raw"] = f"{seconds:.1f} s, {rss:.0f} MiB"
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    columns = list(dict.fromkeys(k for row in rows for k in row))
    print("| " + " | ".join(columns) + " |\n|" + "---|" * len(columns))
    for row in rows:
        print("| " + " | ".join(str(row.get(c, "-")) for c in columns) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
