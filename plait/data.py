"""Training data: documents -> tokenizer -> one packed token stream -> per-rank batches.

Every rank runs this on its own before any collective exists, so the slow parts (training the
BPE, tokenizing) are cached on disk under a file lock: the first rank does the work, the others
wait for it and load the result.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib
import json
import os
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from plait.config import ConfigError, Data

EOS = "<|eos|>"
# end-of-document tokens of foreign tokenizers: Llama 3, Llama 2 / Mistral, GPT-2
FOREIGN_EOS = ("<|end_of_text|>", "</s>", "<|endoftext|>")
SUFFIXES = (".txt", ".jsonl", ".parquet")
DATASETS_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")  # written by save_to_disk


# -----------------------------------------------------------------------------
# documents

def load_texts(path: str, text_field: str = "text") -> list[str]:
    """The documents of `data.path`; "" is the CPython docs that ship with every Python."""
    if not path:
        from pydoc_data.topics import topics
        return [topics[key] for key in sorted(topics)]  # sorted: dict order is not a contract
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"data.path: {path!r} does not exist")
    if p.is_dir() and any((p / marker).exists() for marker in DATASETS_MARKERS):
        texts = _load_datasets(p, text_field)
    elif p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in SUFFIXES)
        if not files:
            raise ConfigError(f"data.path: folder {path!r} holds no {'/'.join(SUFFIXES)} files")
        texts = [text for f in files for text in _load_file(f, text_field)]
    else:
        texts = _load_file(p, text_field)
    if not any(texts):
        raise ConfigError(f"data.path: {path!r} holds no text")
    return texts


def _load_file(f: Path, field: str) -> list[str]:
    if f.suffix == ".txt":
        return [f.read_text(encoding="utf-8", errors="replace")]
    if f.suffix == ".jsonl":
        texts = []
        with open(f, encoding="utf-8") as lines:
            for n, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ConfigError(f"data.path: {f}:{n} is not valid JSON: {e}") from None
                if not isinstance(row, dict) or not isinstance(row.get(field), str):
                    raise ConfigError(f"data.text_field: {f}:{n} has no string field {field!r}")
                texts.append(row[field])
        return texts
    if f.suffix == ".parquet":
        pq = _require("pyarrow.parquet", "pyarrow", f"reading {f}")
        columns = pq.read_schema(f).names
        if field not in columns:
            raise ConfigError(f"data.text_field: {f} has no column {field!r}; columns: {columns}")
        return [t for t in pq.read_table(f, columns=[field]).column(field).to_pylist() if t is not None]
    raise ConfigError(f"data.path: {str(f)!r} has an unsupported extension; allowed: "
                      f"{', '.join(SUFFIXES)}, a folder of them, or a Hugging Face datasets folder")


def _load_datasets(p: Path, field: str) -> list[str]:
    datasets = _require("datasets", "datasets", f"{p} is a Hugging Face datasets folder; reading it")
    ds = datasets.load_from_disk(str(p))
    if isinstance(ds, datasets.DatasetDict):
        ds = ds["train"] if "train" in ds else ds[next(iter(ds))]
    if field not in ds.column_names:
        raise ConfigError(f"data.text_field: {p} has no column {field!r}; columns: {ds.column_names}")
    return [t for t in ds[field] if t is not None]


def _require(module: str, package: str, what: str):
    # optional dependencies: only the inputs that need them pay for them
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(f"data.path: {what} needs `{package}`: pip install 'plait[data]'") from None


def corpus_fingerprint(texts: list[str]) -> str:
    h = hashlib.sha256()
    for text in texts:
        b = text.encode("utf-8")
        h.update(len(b).to_bytes(8, "little"))  # length prefix: ["ab", "c"] != ["a", "bc"]
        h.update(b)
    return h.hexdigest()


# -----------------------------------------------------------------------------
# on-disk cache shared by concurrent ranks

def cache_dir() -> Path:
    d = Path(os.environ.get("PLAIT_CACHE") or Path.home() / ".cache" / "plait")
    d.mkdir(parents=True, exist_ok=True)
    return d


def cached_file(path: Path, build, save, load):
    """Load `path`, building it first if needed. The lock makes one process build while the others
    wait; the atomic rename means nobody ever reads a half-written file. The builder loads the file
    back too, so every process gets exactly the same object."""
    if not path.exists():
        with open(path.with_name(path.name + ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            if not path.exists():
                tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
                save(build(), tmp)
                os.replace(tmp, path)
    return load(path)


# -----------------------------------------------------------------------------
# tokenizer

def build_tokenizer(data_cfg: Data) -> Tokenizer:
    """data.tokenizer if given, else a byte-level BPE trained once on the corpus and cached."""
    texts = [] if data_cfg.tokenizer else load_texts(data_cfg.path, data_cfg.text_field)
    return _tokenizer(data_cfg, texts, corpus_fingerprint(texts))


def _tokenizer(data_cfg: Data, texts: list[str], fingerprint: str) -> Tokenizer:
    if data_cfg.tokenizer:
        try:
            tokenizer = Tokenizer.from_file(data_cfg.tokenizer)
        except Exception as e:  # the Rust side raises a bare Exception
            raise ConfigError(f"data.tokenizer: cannot load {data_cfg.tokenizer!r}: {e}") from None
        eos_id(tokenizer)  # fail now, not after tokenizing the corpus
        return tokenizer
    vocab_size = data_cfg.vocab_size
    if vocab_size < 257:
        raise ConfigError(f"data.vocab_size: must be >= 257 (256 bytes + {EOS}), got {vocab_size}")
    path = cache_dir() / f"tokenizer-{fingerprint[:16]}-{vocab_size}.json"
    return cached_file(path, lambda: _train_bpe(texts, vocab_size),
                   lambda tokenizer, tmp: tokenizer.save(str(tmp)), lambda p: Tokenizer.from_file(str(p)))


def _train_bpe(texts: list[str], vocab_size: int) -> Tokenizer:
    # byte-level: every string is encodable (no <unk>) and decode(encode(s)) == s
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer, length=len(texts))
    return tokenizer


def eos_id(tokenizer: Tokenizer) -> int:
    for token in (EOS, *FOREIGN_EOS):
        if (i := tokenizer.token_to_id(token)) is not None:
            return i
    raise ConfigError(f"data.tokenizer: has none of the end-of-document tokens {[EOS, *FOREIGN_EOS]}")


# -----------------------------------------------------------------------------
# token stream

def tokenize_corpus(data_cfg: Data) -> tuple[np.ndarray, Tokenizer]:
    """All documents as one uint32 stream, each followed by EOS; cached, and memory-mapped
    (read-only) so the ranks of a host share one copy in the page cache."""
    texts = load_texts(data_cfg.path, data_cfg.text_field)
    fingerprint = corpus_fingerprint(texts)
    tokenizer = _tokenizer(data_cfg, texts, fingerprint)
    tokenizer_hash = hashlib.sha256(tokenizer.to_str().encode()).hexdigest()
    path = cache_dir() / f"tokens-{fingerprint[:16]}-{tokenizer_hash[:16]}.npy"
    tokens = cached_file(path, lambda: _encode(texts, tokenizer), _save_npy, lambda p: np.load(p, mmap_mode="r"))
    return tokens, tokenizer


def _encode(texts: list[str], tokenizer: Tokenizer) -> np.ndarray:
    eos = np.array([eos_id(tokenizer)], dtype=np.uint32)
    parts = []
    for i in range(0, len(texts), 4096):  # chunks bound the memory held by Encoding objects
        # no special tokens (e.g. Llama 3's BOS): the EOS between documents is the only separator
        for enc in tokenizer.encode_batch_fast(texts[i:i + 4096], add_special_tokens=False):
            parts += [np.asarray(enc.ids, dtype=np.uint32), eos]
    return np.concatenate(parts)


def _save_npy(tokens: np.ndarray, tmp: Path) -> None:
    with open(tmp, "wb") as f:  # a file object: np.save would append ".npy" to a path
        np.save(f, tokens)


# -----------------------------------------------------------------------------
# batches

class BatchLoader:
    """Packed sequences in an order that depends only on (seed, step), never on the parallel layout.

    The stream of sequences is an endless series of epochs, each a fresh permutation. Step k takes
    stream positions [k*G, (k+1)*G); data-parallel rank r takes the contiguous share r of those, cut
    into micro-batches. So any dp degree / micro-batch size trains on the same data per step.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, global_batch_size: int, micro_batch_size: int,
                 dp_rank: int, dp_size: int, seed: int):
        self.tokens, self.seq_len, self.seed = tokens, seq_len, seed
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        if self.num_sequences < global_batch_size:
            raise ConfigError(
                f"data.path: the corpus has {len(tokens)} tokens = {self.num_sequences} sequences of "
                f"training.seq_len={seq_len}, fewer than training.global_batch_size={global_batch_size}")
        self.share = global_batch_size // dp_size
        if global_batch_size % dp_size or self.share % micro_batch_size:
            raise ConfigError(f"training.global_batch_size: {global_batch_size} must be a multiple of "
                              f"micro_batch_size ({micro_batch_size}) x dp degree ({dp_size})")
        self.first = dp_rank * self.share  # this rank's offset inside a step
        self.step = 0
        self._perms: dict[int, np.ndarray] = {}

    @property
    def num_sequences(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len  # -1: the last label needs one more token

    def _sequence_ids(self, start: int, count: int) -> np.ndarray:
        n = self.num_sequences
        positions = np.arange(start, start + count)
        epochs = positions // n
        # keep only the epochs this call touches (at most two, as N >= G)
        self._perms = {e: self._perms[e] if e in self._perms else np.random.default_rng([self.seed, e]).permutation(n)
                       for e in np.unique(epochs).tolist()}
        ids = np.empty(count, dtype=np.int64)
        for e, perm in self._perms.items():
            mask = epochs == e
            ids[mask] = perm[positions[mask] % n]
        return ids

    def next_batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(inputs, labels) int64 [micro_batch_size, seq_len] per micro-batch of this rank's next step."""
        ids = self._sequence_ids(self.step * self.global_batch_size + self.first, self.share)
        windows = ids[:, None] * self.seq_len + np.arange(self.seq_len + 1)
        seqs = torch.from_numpy(np.asarray(self.tokens[windows], dtype=np.int64))
        self.step += 1
        return [(m[:, :-1].contiguous(), m[:, 1:].contiguous()) for m in seqs.split(self.micro_batch_size)]

    def state_dict(self) -> dict:
        return {"step": self.step, "seq_len": self.seq_len, "global_batch_size": self.global_batch_size,
                "seed": self.seed, "num_sequences": self.num_sequences}

    def load_state_dict(self, state: dict) -> None:
        options = {"seq_len": "training.seq_len", "global_batch_size": "training.global_batch_size",
                   "seed": "training.seed", "num_sequences": "data.path"}
        mine = self.state_dict()
        for key, option in options.items():
            if int(state[key]) != mine[key]:
                raise ConfigError(f"{option}: the checkpoint's data loader has {key}={int(state[key])} but this run "
                                  f"has {mine[key]}; resuming would not continue the same data order")
        self.step = int(state["step"])
