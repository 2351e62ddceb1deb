"""Checkpoint save and load speed, a local folder against an object store, measured:

    python -m plait.proof.storage_bench --flavor small                      # moto's S3 server on a local port
    python -m plait.proof.storage_bench --flavor small --url s3://bucket/x  # a real one (the AWS_* environment)

The state is what a training checkpoint of the flavor holds (fp32 weights and both AdamW moments),
saved and loaded by DCP in one process through the same readers and writers training uses
(plait/checkpoint/safe_dcp.py); each cell is the median of --rounds. Prints one table, GiB/s and the
ratio to the local folder measured in the same run, beside the store's own speed for one object of
the same size (one put, one get: what no checkpoint can beat). Without --url the local server
(moto, a test extra) stands in: it measures plait's path through fsspec, not a network, and moto
reads a whole object for each ranged read, which a real store does not.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import tyro

from plait import storage
from plait.checkpoint import safe_dcp
from plait.models.flavors import FLAVORS
from plait.models.transformer import Transformer


@dataclass
class StorageBenchArgs:
    flavor: str = "small"
    url: str = ""
    """an object-store folder to write under (empty: moto's S3 server, started here on a free port)"""
    rounds: int = 3


def state_of(flavor: str) -> dict[str, torch.Tensor]:
    model = Transformer(FLAVORS[flavor])
    weights = {name: p.detach().float() for name, p in model.state_dict().items()}
    return {"model": weights, "exp_avg": {k: torch.randn_like(v) for k, v in weights.items()},
            "exp_avg_sq": {k: torch.rand_like(v) for k, v in weights.items()}}


def timed(state: dict, folder) -> tuple[float, float]:
    """Seconds to save `state` into `folder`, and to load it back."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        start = time.perf_counter()
        dcp.save(state, storage_writer=safe_dcp.writer(folder), no_dist=True)
        saved = time.perf_counter() - start
        target = {group: {k: torch.empty_like(v) for k, v in tensors.items()} for group, tensors in state.items()}
        start = time.perf_counter()
        safe_dcp.load(target, folder, no_dist=True)
        loaded = time.perf_counter() - start
    assert all(target[g][k].equal(v) for g, tensors in state.items() for k, v in tensors.items())
    return saved, loaded


def one_object(folder, size: int) -> tuple[float, float]:
    blob, data = (folder / "blob").path, os.urandom(size)
    start = time.perf_counter()
    folder.fs.pipe_file(blob, data)
    put = time.perf_counter() - start
    start = time.perf_counter()
    assert folder.fs.cat_file(blob) == data
    get = time.perf_counter() - start
    folder.fs.rm(blob)
    return put, get


def local_server() -> tuple[str, object]:
    """moto's S3 server on a free local port, the environment pointed at it, a bucket made."""
    import socket

    from moto.server import ThreadedMotoServer

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                      AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}")
    storage.location("s3://bench/x").fs.mkdir("bench")
    return "s3://bench/checkpoints", server


def main(argv: list[str] | None = None) -> None:
    args = tyro.cli(StorageBenchArgs, args=argv)
    url, server = (args.url, None) if args.url else local_server()
    state = state_of(args.flavor)
    gib = sum(v.numel() * v.element_size() for tensors in state.values() for v in tensors.values()) / 2**30
    cells: dict[str, list[tuple[float, float]]] = {"local folder": [], url: []}
    with tempfile.TemporaryDirectory(prefix="plait-storage-bench-") as tmp:
        for r in range(args.rounds):  # the two in turn each round: a busy machine slows both alike
            cells["local folder"].append(timed(state, Path(tmp, f"round-{r}")))
            remote = storage.location(f"{url.rstrip('/')}/round-{r}", "url")
            cells[url].append(timed(state, remote))
            storage.remove_tree(remote)
            cells.setdefault("(one object, put and get)", []).append(one_object(remote, int(gib * 2**30)))
    if server is not None:
        server.stop()
    medians = {where: (statistics.median(s for s, _ in runs), statistics.median(t for _, t in runs))
               for where, runs in cells.items()}
    base_save, base_load = medians["local folder"]
    print(f"{args.flavor}: {gib:.3f} GiB (fp32 weights and AdamW moments), median of {args.rounds} rounds")
    print(f"{'where':<32} {'save GiB/s':>10} {'load GiB/s':>10} {'save vs local':>13} {'load vs local':>13}")
    for where, (save, load) in medians.items():
        print(f"{where:<32} {gib / save:>10.3f} {gib / load:>10.3f} {base_save / save:>13.2f} {base_load / load:>13.2f}")


if __name__ == "__main__":
    main()
