import json
import hashlib
import multiprocessing
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from plait.config import ConfigError, Data
from plait.data import BatchLoader, build_tokenizer, eos_id, open_data, shards, tokenizer as tokenizers_module
from plait.data.documents import fingerprint, load_texts
from plait.data.loader import permute

DOCS = ["first document\nwith two lines", "second one: héllo wörld ✓", "third " * 50]


@pytest.fixture(scope="session")
def shared_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("plait_cache")


def tokenize_corpus(cfg: Data) -> tuple[np.ndarray, Tokenizer]:
    """The whole token stream of a one-source run, and its tokenizer."""
    corpus = open_data(cfg)
    stream = corpus.sources[0]
    return stream.read(0, len(stream)), corpus.tokenizer


@pytest.fixture(scope="session")
def bundled(shared_cache):
    """The bundled corpus tokenized once with a small vocabulary (fast)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PLAIT_CACHE", str(shared_cache))
        return tokenize_corpus(Data(vocab_size=512))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PLAIT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def write_corpus(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "a.txt").write_text(DOCS[0])
    (folder / "b.jsonl").write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(DOCS[1:])))
    return folder


# ---- documents

def test_bundled_corpus_is_nontrivial_and_deterministic():
    texts = load_texts("", "text")
    assert len(texts) > 20 and sum(map(len, texts)) > 100_000
    assert texts == load_texts("", "text")


def test_txt_jsonl_folder(tmp_path):
    folder = write_corpus(tmp_path / "corpus")
    assert load_texts(str(folder / "a.txt"), "text") == DOCS[:1]
    assert load_texts(str(folder / "b.jsonl"), "text") == DOCS[1:]
    (folder / "sub").mkdir()
    (folder / "sub" / "c.txt").write_text("nested")
    (folder / "notes.csv").write_text("ignored")
    assert load_texts(str(folder), "text") == DOCS + ["nested"]  # sorted paths: a, b, sub/c


def test_markdown_compressed_json_lines_and_more_text_suffixes(tmp_path):
    """issue 62: a folder of .md files held "no text"; corpora ship compressed JSON lines (Dolma's
    .json.gz, DCLM's .jsonl.zst), read as they stream; data.extensions adds text suffixes."""
    import gzip

    zstandard = pytest.importorskip("zstandard")
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.md").write_text("# A page\n\nof markdown")
    lines = "".join(json.dumps({"text": t}) + "\n" for t in DOCS).encode()
    (folder / "b.json.gz").write_bytes(gzip.compress(lines))
    (folder / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
    (folder / "d.rst").write_text("restructured")
    assert load_texts(str(folder), "text") == ["# A page\n\nof markdown", *DOCS, *DOCS]
    assert load_texts(str(folder), "text", (".rst",))[-1] == "restructured"
    assert load_texts(str(folder / "d.rst"), "text", ("rst",)) == ["restructured"]
    # a truncated archive is one line naming the file
    (folder / "e.jsonl.gz").write_bytes(gzip.compress(lines)[:-12])
    with pytest.raises(ConfigError, match=r"^data.path: .*e.jsonl.gz is not a readable .jsonl.gz file"):
        load_texts(str(folder), "text")


def test_parquet(tmp_path):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"content": DOCS}), tmp_path / "d.parquet")
    assert load_texts(str(tmp_path / "d.parquet"), "content") == DOCS
    with pytest.raises(ConfigError, match="data.text_field"):
        load_texts(str(tmp_path / "d.parquet"), "text")


@pytest.mark.parametrize("name, field, option", [
    ("missing.txt", "text", "data.path"),
    ("corpus/b.jsonl", "body", "data.text_field"),
    ("x.csv", "text", "data.path"),  # unsupported extension
    ("empty.txt", "text", "data.path"),  # no text
    ("no_files", "text", "data.path"),  # folder without corpus files
])
def test_bad_inputs_name_the_option(tmp_path, name, field, option):
    write_corpus(tmp_path / "corpus")
    (tmp_path / "x.csv").write_text("a,b")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "no_files").mkdir()
    with pytest.raises(ConfigError, match=f"^{option}: "):
        load_texts(str(tmp_path / name), field)


def test_datasets_folder_without_datasets(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    (tmp_path / "dataset_info.json").write_text("{}")
    with pytest.raises(ConfigError, match="^data.path: .*datasets"):
        load_texts(str(tmp_path), "text")


def test_datasets_folder_uses_train_split(tmp_path, monkeypatch):
    class DatasetDict(dict):
        pass

    class Dataset:
        def __init__(self, texts):
            self.column_names, self.texts = ["text"], texts

        def __getitem__(self, column):
            return self.texts

    splits = DatasetDict(test=Dataset(["t"]), train=Dataset(["a", None, "b"]))
    fake = types.SimpleNamespace(DatasetDict=DatasetDict, load_from_disk=lambda path: splits)
    monkeypatch.setitem(sys.modules, "datasets", fake)
    (tmp_path / "dataset_dict.json").write_text("{}")
    assert load_texts(str(tmp_path), "text") == ["a", "b"]
    with pytest.raises(ConfigError, match="^data.text_field: "):
        load_texts(str(tmp_path), "body")


def test_fingerprint_depends_on_document_boundaries():
    assert fingerprint(["ab", "c"]) != fingerprint(["a", "bc"])
    assert fingerprint(DOCS) == fingerprint(list(DOCS))


# ---- tokenizer

def test_tokenizer_deterministic_and_cached(tmp_path, monkeypatch):
    corpus = write_corpus(tmp_path / "corpus")
    cfg = Data(path=str(corpus), vocab_size=300)
    files = []
    for name in ("c1", "c2"):
        monkeypatch.setenv("PLAIT_CACHE", str(tmp_path / name))
        build_tokenizer(cfg)
        files += list((tmp_path / name).glob("tokenizer-*.json"))
    assert len(files) == 2 and files[0].read_bytes() == files[1].read_bytes()

    def no_training(*args):
        raise AssertionError("trained again instead of loading the cache")
    monkeypatch.setattr(tokenizers_module, "train_bpe", no_training)
    assert build_tokenizer(cfg).to_str() == Tokenizer.from_file(str(files[1])).to_str()
    assert not list((tmp_path / "c2").glob("*.tmp"))


def test_round_trip_and_eos(bundled):
    tokens, tokenizer = bundled
    text = "def f(x):\n    return x ** 2  # héllo ✓ 🙂\n"
    assert tokenizer.decode(tokenizer.encode(text).ids) == text
    eos = eos_id(tokenizer)
    assert tokenizer.id_to_token(eos) == "<|eos|>"
    assert tokens.dtype == np.int64 and tokens[-1] == eos
    assert (tokens == eos).sum() == len(load_texts("", "text"))  # one EOS per document
    assert tokenizer.get_vocab_size() == 512


def test_tokens_cached(bundled, shared_cache, monkeypatch):
    monkeypatch.setenv("PLAIT_CACHE", str(shared_cache))
    monkeypatch.setattr(shards, "_encode_shard", lambda *a: pytest.fail("encoded again instead of loading the cache"))
    tokens, _ = tokenize_corpus(Data(vocab_size=512))
    assert np.array_equal(tokens, bundled[0])


def test_foreign_tokenizer(tmp_path, cache):
    path = cache / f"tokenizer-{fingerprint(DOCS)[:16]}-300.json"
    tokenizers_module.train_bpe(DOCS, 300).save(str(tmp_path / "tok.json"))
    cfg = Data(path=str(write_corpus(tmp_path / "corpus")), tokenizer=str(tmp_path / "tok.json"))
    tokens, tokenizer = tokenize_corpus(cfg)
    assert not path.exists()  # nothing trained
    eos = eos_id(tokenizer)
    docs = np.split(tokens, np.flatnonzero(tokens == eos) + 1)[:-1]  # each ends with its EOS
    assert [tokenizer.decode(d[:-1].tolist()) for d in docs] == DOCS
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="^data.tokenizer: "):
        build_tokenizer(Data(tokenizer=str(tmp_path / "bad.json")))


def test_special_tokens_in_a_documents_text_are_text(tmp_path, cache):
    """A document that mentions an end-of-text string is encoded as the text it is: only plait puts
    the EOS id between documents (else the document mask and RoPE positions restart mid-document)."""
    mentions = ["the separator is <|eos|> here", "GPT-2 ends with <|endoftext|>, Llama 3 with <|end_of_text|>."]
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in mentions))
    tokenizer = tokenizers_module.train_bpe(DOCS + mentions, 300)
    tokenizer.add_special_tokens(["<|endoftext|>", "<|end_of_text|>"])  # as Hugging Face tokenizers hold them
    tokenizer.save(str(tmp_path / "tok.json"))
    tokens, tokenizer = tokenize_corpus(Data(path=str(tmp_path / "corpus"), tokenizer=str(tmp_path / "tok.json")))
    specials = {tokenizer.token_to_id(t) for t in ("<|eos|>", "<|endoftext|>", "<|end_of_text|>")}
    ends = np.flatnonzero(np.isin(tokens, list(specials)))
    assert ends.tolist() == np.flatnonzero(tokens == eos_id(tokenizer)).tolist() and len(ends) == len(mentions)
    docs = np.split(tokens, ends + 1)[:-1]
    assert [tokenizer.decode(d[:-1].tolist()) for d in docs] == mentions


def _tokens_sha(cfg: Data) -> str:
    return hashlib.sha256(tokenize_corpus(cfg)[0].tobytes()).hexdigest()


def test_concurrent_ranks_train_once(tmp_path, cache):
    """Three processes with no process group race for the same cache entries: all get the same tokens."""
    cfg = Data(path=str(write_corpus(tmp_path / "corpus")), vocab_size=300)
    with multiprocessing.get_context("fork").Pool(3) as pool:  # fork: no torch re-import, fast
        assert len(set(pool.map(_tokens_sha, [cfg] * 3))) == 1
    folders = [p for p in cache.glob("tokens-*") if p.is_dir()]
    assert len(folders) == 1 and not list(folders[0].glob("*.tmp")) and not list(folders[0].glob("shard-*.json"))


# ---- batches

SEQ = 4


class Ramp:
    """A token stream where token t = t, so a sequence's id is inputs[0] // SEQ."""

    def __init__(self, num_sequences: int):
        self.tokens = np.arange(num_sequences * SEQ + 1, dtype=np.int64)

    def __len__(self):
        return len(self.tokens)

    def read(self, start, count):
        return self.tokens[start:start + count]


def ids(batches) -> list[int]:
    return [int(i) for inputs, _ in batches for i in inputs[:, 0] // SEQ]


def loader(n=10, global_batch=4, micro=2, rank=0, dp=1, seed=0):
    return BatchLoader([Ramp(n)], [1.0], SEQ, global_batch, micro, rank, dp, seed)


def test_shapes_and_labels():
    batches = loader().next_batches()
    assert len(batches) == 2
    for inputs, labels in batches:
        assert inputs.shape == labels.shape == (2, SEQ) and inputs.dtype == labels.dtype == torch.int64
        assert torch.equal(labels, inputs + 1)  # labels are the inputs shifted by one token


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_dp_shares_partition_the_global_batch(dp):
    reference = loader(n=13, global_batch=8, micro=8)
    ranks = [loader(n=13, global_batch=8, micro=2 if dp < 4 else 1, rank=r, dp=dp) for r in range(dp)]
    for step in range(5):  # 40 sequences over 13: crosses three epoch boundaries
        shares = [ids(r.next_batches()) for r in ranks]
        assert sum(shares, []) == ids(reference.next_batches())
        if step * 8 // 13 == (step * 8 + 7) // 13:  # a step inside one epoch has no repeats
            assert len(set(sum(shares, []))) == 8


def test_micro_batch_split():
    whole, split = loader(micro=4).next_batches(), loader(micro=2).next_batches()
    assert len(whole) == 1 and len(split) == 2
    assert torch.equal(whole[0][0], torch.cat([split[0][0], split[1][0]]))


def test_epochs_are_fresh_permutations():
    n = 8
    l = loader(n=n, global_batch=6, micro=6)  # 6 does not divide 8: steps straddle epochs
    stream = sum((ids(l.next_batches()) for _ in range(4)), [])  # 24 positions = 3 epochs
    epochs = [stream[i * n:(i + 1) * n] for i in range(3)]
    assert all(sorted(e) == list(range(n)) for e in epochs)
    assert epochs[0] != epochs[1] != epochs[2]
    assert epochs[1] == permute(np.arange(n), n, [0, 0, 1]).tolist()  # (seed, source, epoch)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 1000, 12345])
def test_permutation_is_a_seeded_bijection(n):
    positions = np.arange(n)
    order = permute(positions, n, [0, 0, 0])
    assert sorted(order.tolist()) == list(range(n))
    assert np.array_equal(permute(positions[::-1], n, [0, 0, 0]), order[::-1])  # per position, no state
    if n >= 1000:  # looks random: another key gives another order, and the order is not near the identity
        assert not np.array_equal(order, permute(positions, n, [1, 0, 0]))
        # a random permutation's correlation with its positions has std 1/sqrt(n): 5 sigma
        assert abs(np.corrcoef(positions, order)[0, 1]) < 5 / np.sqrt(n)


def test_resume_equals_uninterrupted():
    straight = loader(n=7, seed=3)
    expected = [ids(straight.next_batches()) for _ in range(6)]
    first = loader(n=7, seed=3)
    got = [ids(first.next_batches()) for _ in range(2)]
    state = first.state_dict()
    assert state["step"] == 2 and state["used"] == [8]
    resumed = loader(n=7, seed=3, micro=4)  # a different micro-batch size resumes too
    resumed.load_state_dict(state)
    got += [ids(resumed.next_batches()) for _ in range(4)]
    assert got == expected


@pytest.mark.parametrize("change, option", [
    (dict(seed=1), "training.seed"), (dict(n=11), "data.path")])
def test_mismatched_state_raises(change, option):
    state = loader().state_dict()
    with pytest.raises(ConfigError, match=f"^{option}: "):
        loader(**change).load_state_dict(state)
    other_seq = BatchLoader([Ramp(10)], [1.0], SEQ + 1, 4, 2, 0, 1, 0)
    with pytest.raises(ConfigError, match="^training.seq_len: "):
        other_seq.load_state_dict(state)


def test_too_few_sequences():
    with pytest.raises(ConfigError, match="^data.path: .*training.global_batch_size=8"):
        loader(n=7, global_batch=8)


def test_bundled_batches(bundled, shared_cache, monkeypatch):
    monkeypatch.setenv("PLAIT_CACHE", str(shared_cache))
    tokens, _ = bundled
    l = BatchLoader(open_data(Data(vocab_size=512)).sources, [1.0], 128, 8, 4, 0, 1, 0)
    assert l.num_sequences == [(len(tokens) - 1) // 128]
    (inputs, labels), _ = l.next_batches()
    assert inputs.max() < 512 and torch.equal(inputs[:, 1:], labels[:, :-1])


def test_a_corpus_that_is_mostly_not_text_is_refused(tmp_path, capsys):
    """Random bytes decode to ~55% U+FFFD and control characters; a little of them is trained on, with a note."""
    (tmp_path / "random.txt").write_bytes(np.random.default_rng(0).bytes(20_000))
    with pytest.raises(ConfigError, match=r"^data.path: .*random.txt is mostly not text \(5\d\.\d\d% of its"):
        load_texts(str(tmp_path / "random.txt"))
    (tmp_path / "some.txt").write_bytes(DOCS[2].encode() + b"\xff\xfe\x00")
    assert load_texts(str(tmp_path / "some.txt")) == [DOCS[2] + "\ufffd\ufffd\x00"]
    assert "some.txt: 0.99% of its 303 characters are invalid UTF-8 or control characters" in capsys.readouterr().err
