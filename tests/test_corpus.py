"""Data at pre-training scale: `plait tokenize` into memory-mapped shards, start-up that does not
grow with the corpus, mixtures, and bad tokenized input."""

import json
import random
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

from conftest import losses, run_plait
from plait.cli import main
from plait.config import ConfigError, Data
from plait.data.mixture import mix_sources
from plait.data import BatchLoader, open_data, shards
from plait.data.documents import iter_documents
from plait.data.tokenize import main as tokenize_main
from plait.data.tokenizer import load_tokenizer
from plait.proof.data_bench import startup

WORDS = [f"{a}{b}" for a in ("ka", "lo", "mi", "nu", "pe", "ra", "si", "tu") for b in ("n", "r", "s", "", "th", "m")]


def write_jsonl(path: Path, documents: int, seed: int = 0) -> Path:
    """Pseudo-text documents of varied length (from 5 to 400 words)."""
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for _ in range(documents):
            f.write(json.dumps({"text": " ".join(rng.choices(WORDS, k=rng.randint(5, 400)))}) + "\n")
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A ~2 MB corpus, its BPE, and its tokenization by 1 and by 3 workers, in shards of 0.2 MB."""
    root = tmp_path_factory.mktemp("corpus")
    source = write_jsonl(root / "c.jsonl", 2000)
    for workers in (1, 3):
        assert main(["tokenize", "--data.path", str(source), "--data.vocab_size", "300", "--out",
                     str(root / f"w{workers}"), "--workers", str(workers), "--shard_mb", "0.2"]) == 0
    return root


def shard_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_workers_do_not_change_a_byte(corpus):
    one, three = shard_bytes(corpus / "w1"), shard_bytes(corpus / "w3")
    assert one == three
    manifest = json.loads(one["manifest.json"])
    assert len(manifest["shards"]) >= 8 and manifest["documents"] == 2000 and manifest["dtype"] == "uint16"
    assert set(one) == {"manifest.json", "tokenizer.json", *(e["file"] for e in manifest["shards"])}


def test_the_stream_is_every_document_then_eos(corpus):
    folder = shards.TokenizedFolder(corpus / "w1")
    tokenizer = load_tokenizer(str(corpus / "w1" / "tokenizer.json"))
    eos = folder.manifest["eos_id"]
    tokens = folder.read(0, len(folder))
    documents = np.split(tokens, np.flatnonzero(tokens == eos) + 1)[:-1]
    texts = [text for text, _ in iter_documents(str(corpus / "c.jsonl"))]
    assert len(documents) == len(texts) == 2000
    assert [tokenizer.decode(d[:-1].tolist()) for d in documents[::97]] == texts[::97]


def test_an_interrupted_tokenize_resumes_to_the_same_bytes(corpus, tmp_path, monkeypatch):
    tokenizer = load_tokenizer(str(corpus / "w1" / "tokenizer.json"))
    documents = list(iter_documents(str(corpus / "c.jsonl")))
    encode, calls = shards._encode_shard, []

    def crash_after_three(*args):
        if len(calls) == 3:
            raise KeyboardInterrupt  # as a Ctrl-C or a killed job would stop it
        calls.append(args[4])
        return encode(*args)

    monkeypatch.setattr(shards, "_encode_shard", crash_after_three)
    with pytest.raises(KeyboardInterrupt):
        shards.write_folder(documents, tokenizer, tmp_path / "t", "c.jsonl", shard_chars=200_000)
    with pytest.raises(ConfigError, match="^data.path: .* unfinished `plait tokenize`"):
        shards.TokenizedFolder(tmp_path / "t")
    calls.append(None)  # no more crashes
    monkeypatch.setattr(shards, "_encode_shard", lambda *args: calls.append(args[4]) or encode(*args))
    manifest = shards.write_folder(documents, tokenizer, tmp_path / "t", "c.jsonl", shard_chars=200_000)
    assert calls[:3] == [0, 1, 2] and calls[4] == 3  # the rerun encoded only the shards not done
    assert len(calls) - 4 == len(manifest["shards"]) - 3
    assert shard_bytes(tmp_path / "t") == {k: v for k, v in shard_bytes(corpus / "w1").items()
                                           if k != "manifest.json"} | {"manifest.json": (tmp_path / "t/manifest.json").read_bytes()}
    assert manifest["tokens_sha256"] == json.loads((corpus / "w1/manifest.json").read_text())["tokens_sha256"]


def test_training_from_the_folder_equals_training_from_the_raw_text(corpus, tmp_path):
    """Same tokenizer, same stream, same order: bitwise."""
    tokenizer = ["--data.tokenizer", str(corpus / "w1" / "tokenizer.json")]
    raw, _ = run_plait(tmp_path, "--training.steps", "3", "--data.path", str(corpus / "c.jsonl"), *tokenizer)
    folder, _ = run_plait(tmp_path, "--training.steps", "3", "--data.path", str(corpus / "w3"))
    assert losses(folder) == losses(raw)


def test_startup_does_not_grow_with_the_corpus(corpus, tmp_path):
    big = write_jsonl(tmp_path / "big.jsonl", 20000, seed=1)  # 10x the corpus
    tokenizer = str(corpus / "w1" / "tokenizer.json")
    assert main(["tokenize", "--data.path", str(big), "--data.tokenizer", tokenizer, "--out", str(tmp_path / "big"),
                 "--workers", "2", "--shard_mb", "0.2"]) == 0
    for raw in (corpus / "c.jsonl", big):
        startup(raw, tokenizer, 64, 4)  # a raw text's first start tokenizes it into the cache
    measured = {(kind, size): startup(path, tokenizer, 64, 4) for kind, size, path in [
        ("tokenized", "2k", corpus / "w1"), ("tokenized", "20k", tmp_path / "big"),
        ("raw", "2k", corpus / "c.jsonl"), ("raw", "20k", big)]}
    print("\nstart-up (open + first batch): " + ", ".join(
        f"{kind} {size} documents {rss:.1f} MiB {seconds:.2f} s" for (kind, size), (rss, seconds) in measured.items()))
    growth = {kind: measured[kind, "20k"][0] - measured[kind, "2k"][0] for kind in ("tokenized", "raw")}
    # From a folder only the manifest grows with the corpus (a line per shard: 8 vs 82 here); raw
    # text is read whole at every start (~20 MB here, and its Python strings).
    assert abs(growth["tokenized"]) < 2 and growth["raw"] > 10, growth


def test_mixture_proportions_and_resume():
    """Three sources at 0.6/0.3/0.1: the sampled shares over 500 steps of 16 sequences lie within
    5 binomial standard deviations, every rank of every layout draws the same, and resume is exact."""
    class Stream:
        def __init__(self, tag, n):
            self.tokens = np.full(n * 4 + 1, tag, dtype=np.int64)

        def __len__(self):
            return len(self.tokens)

        def read(self, start, count):
            return self.tokens[start:start + count]

    sources, weights = [Stream(0, 50), Stream(1, 30), Stream(2, 17)], [6.0, 3.0, 1.0]

    def loader(rank=0, dp=1, micro=16):
        return BatchLoader(sources, weights, 4, 16, micro, rank, dp, seed=5)

    whole, halves = loader(), [loader(0, 2, 8), loader(1, 2, 4)]
    drawn = []
    for _ in range(500):
        step = np.concatenate([inputs[:, 0] for inputs, _ in whole.next_batches()])
        assert np.array_equal(step, np.concatenate([i[:, 0] for h in halves for i, _ in h.next_batches()]))
        drawn.append(step)
    counts, n = np.bincount(np.concatenate(drawn), minlength=3), 500 * 16
    for count, p in zip(counts, np.array(weights) / sum(weights)):
        assert abs(count - n * p) < 5 * np.sqrt(n * p * (1 - p)), (counts, weights)
    assert whole.state_dict()["used"] == counts.tolist()

    straight = loader()
    expected = [straight.next_batches()[0][0] for _ in range(12)]
    first = loader()
    got = [first.next_batches()[0][0] for _ in range(5)]
    resumed = loader(micro=8)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))  # as the checkpoint stores it
    got += [np.concatenate([i for i, _ in resumed.next_batches()]) for _ in range(7)]
    assert all(np.array_equal(a, b) for a, b in zip(got, expected))


def test_mixture_run_resumes_bitwise(corpus, tmp_path):
    mix = ["--data.mix", f"{corpus / 'w1'}:0.7,{corpus / 'w3'}:0.3"]
    folder = ["--checkpoint.folder", str(tmp_path / "ckpt"), "--checkpoint.interval", "2"]
    straight, _ = run_plait(tmp_path, "--training.steps", "4", *mix)
    run_plait(tmp_path, "--training.steps", "2", *mix, *folder)
    resumed, proc = run_plait(tmp_path, "--training.steps", "4", *mix, *folder)
    assert "resumed from" in proc.stdout + proc.stderr
    assert losses(resumed) == losses(straight)[2:]


@pytest.mark.parametrize("spec, message", [
    ("a.jsonl", "is not PATH:WEIGHT"), ("{a}:x", "is not PATH:WEIGHT"), ("{a}:nan", "is not PATH:WEIGHT"),
    ("{a}:-1", "is not PATH:WEIGHT"), ("{a}:0,{a}:0", "sum to 0"), ("missing:1", "does not exist")])
def test_bad_mix_weights(corpus, spec, message):
    with pytest.raises(ConfigError, match=f"^data.mix: .*{message}"):
        mix_sources(spec.format(a=corpus / "w1"))


def test_bad_tokenized_folders(corpus, tmp_path, capsys):
    other = tmp_path / "other.json"
    from plait.data.tokenizer import train_bpe
    train_bpe(["some other text entirely"], 280).save(str(other))
    with pytest.raises(ConfigError, match="^data.path: .* another tokenizer than data.tokenizer"):
        open_data(Data(path=str(corpus / "w1"), tokenizer=str(other)))

    damaged = tmp_path / "damaged"
    subprocess.run(["cp", "-r", str(corpus / "w1"), str(damaged)], check=True)
    shard = damaged / "shard-00002.bin"
    shard.write_bytes(shard.read_bytes()[:-2])  # one token short
    with pytest.raises(ConfigError, match="^data.path: .*shard-00002.bin holds .* does not match its manifest"):
        open_data(Data(path=str(damaged)))
    # through the CLI: one line, exit 2, before any process group
    assert main(["train", "--data.path", str(damaged), "--training.steps", "1"]) == 2
    assert capsys.readouterr().err.count("\n") == 1

    with pytest.raises(ConfigError, match="^out: .* another tokenizer and shard_mb"):
        tokenize_main([ "--data.path", str(corpus / "c.jsonl"), "--data.tokenizer", str(other), "--out",
              str(corpus / "w1")])
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="^out: .* is not empty and not a tokenized folder"):
        tokenize_main([ "--data.path", str(corpus / "c.jsonl"), "--out", str(tmp_path / "busy")])


def test_validation_and_mix_options_fail_in_one_line(corpus, tmp_path, capsys):
    (tmp_path / "val.txt").write_text("too short")
    cases = [
        (["--training.eval_interval", "2"], "training.eval_interval: set data.val_path too"),
        (["--training.eval_interval", "2", "--data.val_path", str(tmp_path / "val.txt")],
         "data.val_path: .* has 0 sequences of training.seq_len=128, not even one global batch"),
        (["--training.eval_steps", "0"], "training.eval_interval must be >= 0 and eval_steps >= 1"),
        (["--data.mix", f"{corpus / 'w1'}:1", "--data.path", str(corpus / "w1")], "data.mix: give data.path or data.mix"),
        (["--data.mix", f"{corpus / 'c.jsonl'}:1"], "data.mix: raw-text sources need data.tokenizer"),
        (["--parallelism.pp", "2", "--parallelism.pp_schedule", "zbv", "--model.n_layers", "4", "--nproc", "2",
          "--data.val_path", str(tmp_path / "val.txt")], "data.val_path: .*zbv"),  # (eval_interval's default: auto)
    ]
    for argv, message in cases:
        assert main(["train", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and re.match(f"plait: error: {message}", err), err
