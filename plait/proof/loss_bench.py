"""What the chunked loss saves, measured: `python -m plait.proof.loss_bench`.

For each vocabulary x sequence length a Qwen3-shaped model (qwen3_0_6b's width and heads, cut to
`--layers` blocks, the vocabulary as given, the output layer untied as in Qwen3 from 4B up) trains
`--steps` steps of one sequence on one device, in fp32, once with the whole logits (training.loss_chunk 0) and once chunked (the default), each
in a process of its own: tokens/s (AdamW steps, the median after the first), and the memory of
one more forward and backward beside the weights, measured by torch's MemTracker (every tensor's
storage from allocation to release, by kind, on any device) at its peak: what it saves for
backward, its workspace, and the gradients made by then. Beside it, what plan predicts for the
step (activations + buffers, plait/plan/memory.py; gradients are state there). A noisy machine
blurs tokens/s: compare within one table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import time

import torch

from torch.distributed._tools.mem_tracker import MemTracker

from plait.arguments import parse_args
from plait.checks import check_options
from plait.models.flavors import FLAVORS
from plait.models.transformer import Transformer, initial_value
from plait.models.weights import fill_weights
from plait.plan.memory import activation_bytes, buffer_bytes
from plait.plan.parameters import rank_parameters

GIB = 2**30


def job(vocab: int, seq_len: int, layers: int, chunk: int):
    cfg = check_options(parse_args(["--model.flavor", "qwen3_0_6b", "--model.n_layers", str(layers), "--training.seq_len",
                      str(seq_len), "--training.global_batch_size", "1", "--training.loss_chunk", str(chunk),
                      "--training.mixed_precision_param", "float32"]), 1)
    return dataclasses.replace(FLAVORS["qwen3_0_6b"], n_layers=layers, vocab_size=vocab, tie_embeddings=False), cfg


def predicted_step_bytes(vocab: int, seq_len: int, layers: int, chunk: int) -> int:
    args, cfg = job(vocab, seq_len, layers, chunk)
    return activation_bytes(args, cfg, None, 4) + buffer_bytes(args, cfg, rank_parameters(args, cfg, None), 4, seq_len)


def cell(vocab: int, seq_len: int, layers: int, chunk: int, steps: int, threads: int) -> dict:
    """One run in this process: its tokens/s and the step's memory at its peak, in GiB."""
    torch.manual_seed(0)
    if threads:
        torch.set_num_threads(threads)
    args, _ = job(vocab, seq_len, layers, chunk)
    model = Transformer(args)
    fill_weights(model, lambda name, shape: initial_value(model, name, shape, 0))
    model.loss.chunk = chunk
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    seconds = []
    for _ in range(steps):
        tokens = torch.randint(vocab, (1, seq_len + 1))
        start = time.perf_counter()
        model(tokens[:, :-1], labels=tokens[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds.append(time.perf_counter() - start)
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        model(tokens[:, :-1], labels=tokens[:, 1:]).backward()
    peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
    kinds = {str(kind.value).lower(): n / GIB for kind, n in peak.items() if kind != "Total"}
    return {"step_gib": kinds["activation"] + kinds["temp"] + kinds["gradient"], **kinds,
            "tokens_per_sec": seq_len / statistics.median(seconds[1:] or seconds)}


def table(rows: list[dict]) -> str:
    lines = ["vocab    seq   loss     step GiB  plan GiB  ratio   tok/s   vs whole"]
    for r in rows:
        for name in ("whole", "chunked"):
            run, plan = r[name], r[f"plan_{name}_gib"]
            lines.append(f"{r['vocab']:<8} {r['seq_len']:<5} {name:<8} {run['step_gib']:>8.3f}  {plan:>8.3f}  "
                         f"{run['step_gib'] / plan:>5.3f}  {run['tokens_per_sec']:>6.1f}  "
                         f"{run['tokens_per_sec'] / r['whole']['tokens_per_sec']:>8.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocabs", type=int, nargs="+", default=[151936, 201088])
    parser.add_argument("--seq_lens", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=256, help="training.loss_chunk of the chunked runs")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="CPU threads of each run; 0 = torch's default")
    parser.add_argument("--out", default="", help="also write every number as JSON")
    parser.add_argument("--cell", type=int, nargs=3, help=argparse.SUPPRESS)  # VOCAB SEQ CHUNK: one run, here
    opts = parser.parse_args(argv)
    if opts.cell:
        print(json.dumps(cell(*opts.cell[:2], opts.layers, opts.cell[2], opts.steps, opts.threads)))
        return 0
    rows = []
    for vocab in opts.vocabs:
        for seq_len in opts.seq_lens:
            row = {"vocab": vocab, "seq_len": seq_len}
            for name, chunk in (("whole", 0), ("chunked", opts.chunk)):
                run = subprocess.run([sys.executable, "-m", "plait.proof.loss_bench", "--cell", str(vocab),
                                      str(seq_len), str(chunk), "--layers", str(opts.layers), "--steps",
                                      str(opts.steps), "--threads", str(opts.threads)], capture_output=True, text=True, check=True)
                row[name] = json.loads(run.stdout.splitlines()[-1])
                row[f"plan_{name}_gib"] = predicted_step_bytes(vocab, seq_len, opts.layers, chunk) / GIB
            rows.append(row)
            print("\n".join(table(rows[-1:]).split("\n")[1:]), flush=True)
    print(table(rows))
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
