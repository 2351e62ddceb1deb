"""Shared helpers: run the real `plait` CLI (as torchrun's ranks for world > 1) and read its metrics."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from plait.launch import descendants  # noqa: F401 (for the tests: torchrun workers are grandchildren)

ROOT = Path(__file__).resolve().parents[1]

# One thread per rank in every run that is compared: the thread count changes summation order.
# The precision is pinned too, so a test means the same on every CPU (`auto` is bf16 where the
# CPU has bf16 units, fp32 where bf16 is emulated): fp32, exact and fast everywhere; a test about
# bf16 adds BF16 (later flags win), which runs bf16 even where it is emulated (slowly).
TINY = ["--training.threads", "1", "--training.seq_len", "64", "--training.global_batch_size", "4",
        "--training.warmup_steps", "2", "--data.vocab_size", "512", "--training.mixed_precision_param", "float32"]
BF16 = ["--training.mixed_precision_param", "bfloat16"]


# Tables a test wants in CI's output even when it passes (pytest -q hides passing tests' prints).
# A test's tables travel with its report (from the pytest-xdist worker that ran it) to SHOWN.
REPORTS: dict[str, str] = {}
SHOWN: dict[str, str] = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    while REPORTS:
        report.user_properties.append(("plait-report", REPORTS.popitem()))


def pytest_runtest_logreport(report):
    SHOWN.update(value for name, value in report.user_properties if name == "plait-report")


def pytest_terminal_summary(terminalreporter):
    for title, text in SHOWN.items():
        terminalreporter.write_sep("-", title)
        terminalreporter.write_line(text)


@pytest.hookimpl(tryfirst=True)  # (before pytest-xdist's own hook, which reads the groups)
def pytest_collection_modifyitems(items):
    """Under pytest-xdist (`-n 2 --dist loadgroup`, the suite's default): the tests of a file that
    share a module fixture in one worker, which makes it once; every other test wherever a worker
    is free. (The shared runs, `train_once`, are shared between the workers on disk.)"""
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        scopes = {fixture.scope for defs in info.name2fixturedefs.values() for fixture in defs} if info else set()
        if scopes & {"module", "class", "package"}:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


def session_folder(tmp_path_factory) -> Path:
    """A folder of this test session that every pytest-xdist worker sees: the workers' base
    folders (popen-gw0, ...) share their parent, which a run of one process does not."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session", autouse=True)
def plait_cache(tmp_path_factory):
    """One tokenizer/token cache for the whole session (its workers too: plait locks what it
    writes there), isolated from the user's."""
    cache = session_folder(tmp_path_factory) / "plait-cache"
    cache.mkdir(exist_ok=True)
    os.environ["PLAIT_CACHE"] = str(cache)
    return cache


def run_plait(tmp_path: Path, *args: str, nproc: int = 1, check: bool = True, timeout: float = 300,
              metrics: Path | None = None, forked: bool = True, env: dict | None = None):
    """Run `plait train` with `args` (forked from the fork server: tests/forkserver.py, unless
    `forked` is False; `env` added to the environment); returns (per-step metric rows, completed
    process). The rows are read from `metrics` if given, else from a new file of the run's own."""
    metrics = metrics or tmp_path / f"metrics-{len(list(tmp_path.glob('metrics-*')))}.jsonl"
    proc = launch(["train", *TINY, *args, "--metrics.jsonl", str(metrics)], nproc, timeout, forked=forked, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(proc.args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr[-4000:]}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    return rows, proc


def plait_forked(*argv: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m plait ARGV` in ROOT, forked from the fork server (its ~4 s of imports done): for a
    command whose results a test reads. (What a fresh process prints at start-up, a one-line refusal
    say, is proven by the tests that start one.)"""
    return launch(list(argv), 1, timeout, env=env, forked=True)


class ForkServer:
    """The tests' end of tests/forkserver.py, started at the first forked launch."""

    def __init__(self):
        self.server = subprocess.Popen([sys.executable, str(ROOT / "tests" / "forkserver.py")], cwd=ROOT,
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.pending, self.codes = b"", {}

    def _messages(self, block: bool):
        """The server's messages: those already read, then (waiting for one if `block`) new ones."""
        while True:
            while b"\n" in self.pending:
                line, self.pending = self.pending.split(b"\n", 1)
                yield json.loads(line)
                block = False
            if not block and not select.select([self.server.stdout], [], [], 0)[0]:
                return
            data = os.read(self.server.stdout.fileno(), 1 << 16)
            if not data:
                raise RuntimeError("the fork server died")
            self.pending += data

    def start(self, argv: list[str], env: dict, stdout: Path, stderr: Path) -> int:
        self.server.stdin.write(json.dumps({"argv": argv, "env": env, "stdout": str(stdout),
                                            "stderr": str(stderr)}).encode() + b"\n")
        self.server.stdin.flush()
        while True:
            for message in self._messages(block=True):
                if "pid" in message:
                    return message["pid"]
                self.codes[message["exited"]] = message["code"]

    def code(self, pid: int) -> int | None:
        for message in self._messages(block=False):
            self.codes[message["exited"]] = message["code"]
        return self.codes.get(pid)


FORK_SERVER: list[ForkServer] = []


class Forked:
    """A forked `plait` process, with Popen's poll() and kill()."""

    def __init__(self, argv: list[str], env: dict, stdout: Path, stderr: Path):
        if not FORK_SERVER:
            FORK_SERVER.append(ForkServer())
        self.server = FORK_SERVER[0]
        self.pid = self.server.start(argv, env, stdout, stderr)

    def poll(self) -> int | None:
        return self.server.code(self.pid)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)


def launch(argv: list[str], nproc: int, timeout: float, nodes: int = 1, env: dict | None = None,
           forked: bool = False) -> subprocess.CompletedProcess:
    """`plait ARGV` as one process, or as `nproc` ranks with the environment torchrun gives its
    workers but without torchrun's agent (whose own torch import costs ~2 s a run; the launch
    itself is proven by the tests that run `plait train --nproc` or torchrun). As the agent does,
    a rank that fails stops the others (a peer would otherwise wait for it until the timeout),
    3 s on. `nodes` > 1 numbers the ranks as that many machines of nproc / nodes ranks would.
    `forked`: from the fork server (~4 s of imports less per process, which runs a sitecustomize
    that `env`'s PYTHONPATH adds after the imports), else started by Python (its start-up as
    usual: a sitecustomize before any import)."""
    with socket.socket() as probe:  # a free port for rank 0's store
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    local = nproc // nodes
    shared = {**os.environ, **(env or {})}
    if nproc > 1:
        shared.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(nproc),
                       "LOCAL_WORLD_SIZE": str(local), "TORCHELASTIC_RESTART_COUNT": "0"})
    command = [sys.executable, "-m", "plait", *argv]
    with tempfile.TemporaryDirectory(prefix="plait-launch-") as folder:
        ranks, files = [], []
        for rank in range(nproc):
            rank_env = {**shared, "RANK": str(rank), "LOCAL_RANK": str(rank % local),
                        "GROUP_RANK": str(rank // local)} if nproc > 1 else shared
            out, err = Path(folder, f"{rank}.out"), Path(folder, f"{rank}.err")
            files.append((out, err))
            if forked:
                ranks.append(Forked(argv, rank_env, out, err))
            else:
                with open(out, "w") as stdout, open(err, "w") as stderr:
                    ranks.append(subprocess.Popen(command, cwd=ROOT, env=rank_env, stdout=stdout, stderr=stderr))
        deadline, code, timed_out = time.monotonic() + timeout, 0, False
        while any(p.poll() is None for p in ranks):
            if not code and (code := next((p.poll() for p in ranks if p.poll()), 0)):  # the first failure's
                deadline = min(deadline, time.monotonic() + 3)  # peers failing on the same verdict say so first
            if time.monotonic() > deadline:
                timed_out = not code
                for p in ranks:
                    p.kill()
            time.sleep(0.05)
        stdout = "".join(out.read_text(errors="replace") for out, _ in files)
        stderr = "".join(err.read_text(errors="replace") for _, err in files)
    if timed_out:
        raise subprocess.TimeoutExpired(command, timeout, stdout, stderr)
    code = code or next((p.poll() for p in ranks if p.poll()), 0)
    return subprocess.CompletedProcess(command, code, stdout, stderr)


STEPS = ["--training.steps", "6"]
AUTOCAST = ["--training.mixed_precision_mode", "autocast"]
SIMPLE = ["--parallelism.dp_backend", "simple_fsdp"]
TP2 = ["--parallelism.tp", "2"]
PP2 = ["--parallelism.pp", "2"]
TIED = ["--model.tie_embeddings"]
CP2 = ["--parallelism.cp", "2"]
CAUSAL = ["--model.attention_mask", "causal"]
ULYSSES = ["--parallelism.cp_kind", "ulysses"]
FLOAT8 = ["--training.float8", "tensorwise"]
ROWWISE = ["--training.float8", "rowwise"]
MXFP8 = ["--training.float8", "mxfp8"]
DEEP = ["--model.n_layers", "4"]  # two stages per rank at pp 2 need four blocks
QWEN3, QWEN2, OLMO2, OLMO3, GEMMA3, GLM, LLAMA4 = (["--model.flavor", f"debug_{family}"] for family in (
    "qwen3", "qwen2", "olmo2", "olmo3", "gemma3", "glm4_moe", "llama4"))
MOE, SIGMOID = ["--model.flavor", "debug_moe"], ["--model.flavor", "debug_moe_sigmoid"]
HYBRID, HYBRID_MOE = ["--model.flavor", "debug_hybrid"], ["--model.flavor", "debug_hybrid_moe"]
OLMO_HYBRID = ["--model.flavor", "debug_olmo_hybrid"]
KIMI = ["--model.flavor", "debug_kimi"]
SLIDING, GPT_OSS = ["--model.flavor", "debug_sliding"], ["--model.flavor", "debug_gpt_oss"]
# DeepSeek-V3's sequence-wise balance loss at 1000x its 0.0001: strong enough that a layout's
# wrong share of its gradient moves the losses past the parity bounds
MLA = ["--model.flavor", "debug_mla", "--training.moe_sequence_aux_coef", "0.1"]
EP2 = ["--parallelism.ep", "2"]
MUON = ["--optimizer.name", "muon"]


def pp_schedule(name: str) -> list[str]:
    return ["--parallelism.pp_schedule", name]


def degrees(replicate: int, shard: int, tp: int = 1) -> list[str]:
    return ["--parallelism.dp_replicate", str(replicate), "--parallelism.dp_shard", str(shard),
            *(TP2 if tp == 2 else [])]


# Every layout plait has, as (world, options). The single device accumulates two micro-batches,
# so it sums the same two slices world-2 ranks hold, in the same order.
LAYOUTS = {
    "single": (1, ["--training.micro_batch_size", "2"]),
    "ddp": (2, degrees(2, 1)),
    "fsdp2": (2, degrees(1, 2)),
    "classic_ddp": (2, ["--parallelism.dp_backend", "ddp", *degrees(2, 1)]),
    "simple_fsdp": (2, [*SIMPLE, *degrees(1, 2)]),
    "simple_ddp": (2, [*SIMPLE, *degrees(2, 1)]),
    "tp": (2, degrees(1, 1, tp=2)),
    "hsdp_w4": (4, degrees(2, 2)),
    "ddp_tp": (4, degrees(2, 1, tp=2)),
    "fsdp2_tp": (4, degrees(1, 2, tp=2)),
    "simple_hsdp_w4": (4, [*SIMPLE, *degrees(2, 2)]),
    "simple_ddp_tp": (4, [*SIMPLE, *degrees(2, 1, tp=2)]),
    "simple_fsdp_tp": (4, [*SIMPLE, *degrees(1, 2, tp=2)]),
    # Pipelines split the local batch into as many micro-batches as stages: at world 2 the two
    # micro-batches of 2 the single device accumulates; the interleaved and V schedules run 4
    # stages of a 4-block model on 4 micro-batches of 1, against `single_deep`.
    "pp": (2, PP2),  # 1f1b
    "pp_gpipe": (2, [*PP2, *pp_schedule("gpipe")]),
    "single_deep": (1, [*DEEP, "--training.micro_batch_size", "1"]),
    "pp_interleaved_1f1b": (2, [*PP2, *DEEP, *pp_schedule("interleaved_1f1b")]),
    "pp_interleaved_zb": (2, [*PP2, *DEEP, *pp_schedule("interleaved_zb")]),
    "pp_zbv": (2, [*PP2, *DEEP, *pp_schedule("zbv")]),
    "pp_fsdp2": (4, [*PP2, *degrees(1, 2)]),
    "pp_ddp": (4, [*PP2, *degrees(2, 1)]),
    "pp_tp": (4, [*PP2, *degrees(1, 1, tp=2)]),
    "pp_fsdp2_tp": (8, [*PP2, *degrees(1, 2, tp=2)]),
    # A tied output layer (one matrix with the embedding): the wrappers that handle parameters
    # differently (fully_shard, TP's vocabulary split, SimpleFSDP's parametrization).
    "single_tied": (1, [*TIED, "--training.micro_batch_size", "2"]),
    "fsdp2_tied": (2, [*TIED, *degrees(1, 2)]),
    "tp_tied": (2, [*TIED, *degrees(1, 1, tp=2)]),
    "simple_fsdp_tied": (2, [*TIED, *SIMPLE, *degrees(1, 2)]),
    # Context parallelism: each sequence split over 2 ranks (under the default document mask, and
    # causal against the causal single device), composed with FSDP2, TP, a pipeline, and both.
    "single_causal": (1, [*CAUSAL, "--training.micro_batch_size", "2"]),
    "cp": (2, [*CP2, "--training.micro_batch_size", "2"]),
    "cp_causal": (2, [*CP2, *CAUSAL, "--training.micro_batch_size", "2"]),
    "cp_fsdp2": (4, [*CP2, *degrees(1, 2)]),
    "cp_tp": (4, [*CP2, *degrees(1, 1, tp=2), "--training.micro_batch_size", "2"]),
    "pp_cp": (4, [*PP2, *CP2]),
    "cp_fsdp2_tp": (8, [*CP2, *degrees(1, 2, tp=2)]),
    # Ulysses CP: heads, not keys, move (debug: 4 query heads, 2 key/value heads; under TP2 each
    # rank's one key/value head is repeated to two before the all-to-all).
    "cp_ulysses": (2, [*CP2, *ULYSSES, "--training.micro_batch_size", "2"]),
    "cp_ulysses_causal": (2, [*CP2, *ULYSSES, *CAUSAL, "--training.micro_batch_size", "2"]),
    "cp_ulysses_fsdp2": (4, [*CP2, *ULYSSES, *degrees(1, 2)]),
    "cp_ulysses_tp": (4, [*CP2, *ULYSSES, *degrees(1, 1, tp=2), "--training.micro_batch_size", "2"]),
    "pp_cp_ulysses": (4, [*PP2, *CP2, *ULYSSES]),
    # Hybrid: Ulysses within pairs of cp ranks, keys and values all-gathered across the pairs.
    "cp_hybrid": (4, ["--parallelism.cp", "4", "--parallelism.cp_kind", "hybrid", "--parallelism.cp_ulysses", "2",
                      *degrees(1, 1), "--training.micro_batch_size", "2"]),
    # Float8 (the blocks' linear layers), against the single device with the same recipe:
    # tensorwise in every layout that shards or reorders what its scales are taken over, rowwise
    # where sharding meets its per-row scales (FSDP2 gathers it in the compute dtype, TP splits
    # rows; FSDP2+TP2 rowwise measured what TP2 rowwise does, 7.3e-5, and is left out).
    "single_f8": (1, [*FLOAT8, "--training.micro_batch_size", "2"]),
    "fsdp2_f8": (2, [*FLOAT8, *degrees(1, 2)]),
    "ddp_f8": (2, [*FLOAT8, *degrees(2, 1)]),
    "classic_ddp_f8": (2, [*FLOAT8, "--parallelism.dp_backend", "ddp", *degrees(2, 1)]),
    "tp_f8": (2, [*FLOAT8, *degrees(1, 1, tp=2), "--training.micro_batch_size", "2"]),
    "pp_f8": (2, [*FLOAT8, *PP2]),
    "fsdp2_tp_f8": (4, [*FLOAT8, *degrees(1, 2, tp=2)]),
    "single_f8_rowwise": (1, [*ROWWISE, "--training.micro_batch_size", "2"]),
    "fsdp2_f8_rowwise": (2, [*ROWWISE, *degrees(1, 2)]),
    "tp_f8_rowwise": (2, [*ROWWISE, *degrees(1, 1, tp=2), "--training.micro_batch_size", "2"]),
    # Llama's relatives (debug's shape with a family's switches), against the single device of the
    # same family: q/k norm per head (Qwen3, tied as its small sizes are), q/k/v biases (Qwen2; also
    # under a pipeline, which refuses tying: what a stage holds of a block is the same question for
    # any parameter), and OLMo 2's norms after the sub-layers and over the whole projection (TP
    # splits that norm: one all-reduce completes it).
    "single_qwen3_tied": (1, [*QWEN3, *TIED, "--training.micro_batch_size", "2"]),
    "fsdp2_qwen3_tied": (2, [*QWEN3, *TIED, *degrees(1, 2)]),
    "tp_qwen3_tied": (2, [*QWEN3, *TIED, *degrees(1, 1, tp=2)]),
    "single_qwen2": (1, [*QWEN2, "--training.micro_batch_size", "2"]),
    "fsdp2_qwen2": (2, [*QWEN2, *degrees(1, 2)]),
    "tp_qwen2": (2, [*QWEN2, *degrees(1, 1, tp=2)]),
    "pp_qwen2": (2, [*QWEN2, *PP2]),
    "single_olmo2": (1, [*OLMO2, "--training.micro_batch_size", "2"]),
    "tp_olmo2": (2, [*OLMO2, *degrees(1, 1, tp=2)]),
    # OLMo 3 (debug_olmo3): OLMo 2's norms, a sliding block and a full one, each with its own RoPE
    # (YaRN on the full block): the tables by block kind, as each layout hands RoPE's rows on
    "single_olmo3": (1, [*OLMO3, "--training.micro_batch_size", "2"]),
    "fsdp2_olmo3": (2, [*OLMO3, *degrees(1, 2)]),
    "tp_olmo3": (2, [*OLMO3, *degrees(1, 1, tp=2)]),
    "pp_olmo3": (2, [*OLMO3, *PP2]),
    "cp_olmo3": (2, [*OLMO3, *CP2, "--training.micro_batch_size", "2"]),
    # Gemma 3 (debug_gemma3): norms around each sub-layer (zero-centred: TP's sequence parallelism
    # runs them on the shard as OLMo's), the embedding scaled, GeGLU, RoPE by block kind, tied
    "single_gemma3": (1, [*GEMMA3, "--training.micro_batch_size", "2"]),
    "fsdp2_gemma3": (2, [*GEMMA3, *degrees(1, 2)]),
    "tp_gemma3": (2, [*GEMMA3, *degrees(1, 1, tp=2)]),
    "cp_gemma3": (2, [*GEMMA3, *CP2, "--training.micro_batch_size", "2"]),
    # A sliding block (window 8: half a cp2 chunk) on a global one, Qwen3-shaped (debug_sliding)
    "single_sliding": (1, [*SLIDING, "--training.micro_batch_size", "2"]),
    "fsdp2_sliding": (2, [*SLIDING, *degrees(1, 2)]),
    "tp_sliding": (2, [*SLIDING, *degrees(1, 1, tp=2)]),
    "pp_sliding": (2, [*SLIDING, *PP2]),
    "cp_sliding": (2, [*SLIDING, *CP2, "--training.micro_batch_size", "2"]),
    "cp_ulysses_sliding": (2, [*SLIDING, *CP2, *ULYSSES, "--training.micro_batch_size", "2"]),
    # gpt-oss (debug_gpt_oss): sinks, windows, biased experts and router, the clamped SwiGLU, YaRN
    "single_gpt_oss": (1, [*GPT_OSS, "--training.micro_batch_size", "2"]),
    "fsdp2_gpt_oss": (2, [*GPT_OSS, *degrees(1, 2)]),
    "tp_gpt_oss": (2, [*GPT_OSS, *degrees(1, 1, tp=2), "--training.micro_batch_size", "2"]),
    "ep2_gpt_oss": (2, [*GPT_OSS, *EP2]),
    "pp_gpt_oss": (2, [*GPT_OSS, *PP2]),
    "cp_gpt_oss": (2, [*GPT_OSS, *CP2, "--training.micro_batch_size", "2"]),
    # DeepSeek-V3 (debug_mla): latent attention, grouped sigmoid routing, a shared expert, block 0 dense,
    # multi-token prediction (under PP on the last stage)
    "single_mla": (1, [*MLA, "--training.micro_batch_size", "2"]),
    "fsdp2_mla": (2, [*MLA, *degrees(1, 2)]),
    "tp_mla": (2, [*MLA, *degrees(1, 1, tp=2), "--training.micro_batch_size", "2"]),
    "ep2_mla": (2, [*MLA, *EP2]),
    "ep2_fsdp2_mla": (4, [*MLA, *EP2]),  # experts over 2 of the 4 FSDP2 ranks, each rank one sequence
    "hsdp_mla": (4, [*MLA, *degrees(2, 2)]),
    "pp_mla": (2, [*MLA, *PP2]),  # MTP on the last stage, with a copy of the embedding
    "cp_mla": (2, [*MLA, *CP2, "--training.micro_batch_size", "2"]),
    # MXFP8 (emulated here), against the single device with MXFP8: its blocks of 32 along each
    # matmul's reduced dimension, split by FSDP2 (a gathered weight's rows are whole), TP (a rank's
    # shard is whole blocks), a pipeline's stages and EP (each expert's tokens padded to blocks).
    # The experts' MXFP8 matmuls are bf16-only: the MoE rows run bf16 alone.
    "single_mx": (1, [*MXFP8, "--training.micro_batch_size", "2"]),
    "single_mx_wgrad_hp": (1, ["--training.float8", "mxfp8_wgrad_hp", "--training.micro_batch_size", "2"]),
    "fsdp2_mx": (2, [*MXFP8, *degrees(1, 2)]),
    "tp_mx": (2, [*MXFP8, *degrees(1, 1, tp=2)]),
    "pp_mx": (2, [*MXFP8, *PP2]),
    "cp_mx": (2, [*MXFP8, *CP2, "--training.micro_batch_size", "2"]),
    "fsdp2_tp_mx": (4, [*MXFP8, *degrees(1, 2, tp=2)]),
    "single_moe_mx": (1, [*MOE, *MXFP8, "--training.micro_batch_size", "2"]),
    "single_moe_mx_mb1": (1, [*MOE, *MXFP8, "--training.micro_batch_size", "1"]),
    "ep2_moe_mx": (2, [*MOE, *MXFP8, *EP2]),
    "ep2_fsdp2_moe_mx": (4, [*MOE, *MXFP8, *EP2]),
    # GLM-4.5 (debug_glm4_moe): DeepSeek-V3's router and shared expert on grouped-query attention
    # with q/k/v biases and q/k norms, RoPE on half of each head
    "single_glm4_moe": (1, [*GLM, "--training.micro_batch_size", "2"]),
    "fsdp2_glm4_moe": (2, [*GLM, *degrees(1, 2)]),
    "tp_glm4_moe": (2, [*GLM, *degrees(1, 1, tp=2), "--training.micro_batch_size", "2"]),
    "ep2_glm4_moe": (2, [*GLM, *EP2]),
    "pp_glm4_moe": (2, [*GLM, *PP2]),
    "cp_glm4_moe": (2, [*GLM, *CP2, "--training.micro_batch_size", "2"]),
    # Llama 4 (debug_llama4): experts weighed on their inputs with a shared one, a dense block with
    # RoPE and L2 q/k norms, a sparse one without RoPE whose queries are temperature-tuned
    "single_llama4": (1, [*LLAMA4, "--training.micro_batch_size", "2"]),
    "fsdp2_llama4": (2, [*LLAMA4, *degrees(1, 2)]),
    "tp_llama4": (2, [*LLAMA4, *degrees(1, 1, tp=2), "--training.micro_batch_size", "2"]),
    "ep2_llama4": (2, [*LLAMA4, *EP2]),
    "pp_llama4": (2, [*LLAMA4, *PP2]),
    "cp_llama4": (2, [*LLAMA4, *CP2, "--training.micro_batch_size", "2"]),
    # Qwen3-Next (debug_hybrid: a linear-attention block, the gated delta rule, then a gated full one;
    # debug_hybrid_moe: with experts and a gated shared expert)
    "single_hybrid": (1, [*HYBRID, "--training.micro_batch_size", "2"]),
    "cp2_hybrid": (2, [*HYBRID, *CP2, "--training.micro_batch_size", "2"]),
    "fsdp2_hybrid": (2, [*HYBRID, *degrees(1, 2)]),
    "tp_hybrid": (2, [*HYBRID, *degrees(1, 1, tp=2), "--training.micro_batch_size", "2"]),
    "pp_hybrid": (2, [*HYBRID, *PP2]),
    "single_hybrid_moe": (1, [*HYBRID_MOE, "--training.micro_batch_size", "2"]),
    "ep2_hybrid_moe": (2, [*HYBRID_MOE, *EP2]),
    # OLMo hybrid (debug_olmo_hybrid: the step doubled, a linear block that norms its input, then an
    # OLMo 3 attention block without RoPE) under CP2 and FSDP2 at world 4
    "single_olmo_hybrid": (1, [*OLMO_HYBRID, "--training.micro_batch_size", "2"]),
    "cp_fsdp2_olmo_hybrid": (4, [*OLMO_HYBRID, *CP2, *degrees(1, 2)]),
    # Kimi Linear (debug_kimi: Kimi Delta Attention, its gate per key channel through a bottleneck, then
    # latent attention without RoPE with experts) under TP2, EP2, and CP2 with FSDP2 at world 4
    "single_kimi": (1, [*KIMI, "--training.micro_batch_size", "2"]),
    "tp_kimi": (2, [*KIMI, *degrees(1, 1, tp=2), "--training.micro_batch_size", "2"]),
    "ep2_kimi": (2, [*KIMI, *EP2]),
    "cp_fsdp2_kimi": (4, [*KIMI, *CP2, *degrees(1, 2)]),
    "single_mla_f8": (1, [*MLA, *FLOAT8, "--training.micro_batch_size", "2"]),  # (the MTP module's layers too)
    "fsdp2_mla_f8": (2, [*MLA, *FLOAT8, *degrees(1, 2)]),
    # Mixtures of experts (debug_moe: 8 experts, top 2, Qwen3-MoE's router and q/k norm). Their
    # load-balancing loss is taken over each forward's tokens, so a row's reference forwards the
    # same sequences together: 2 per forward (single_moe) or 1 (single_moe_mb1, the world-4 rows
    # whose ranks hold 1 sequence each).
    "single_moe": (1, [*MOE, "--training.micro_batch_size", "2"]),
    "single_moe_mb1": (1, [*MOE, "--training.micro_batch_size", "1"]),
    "ep2_moe": (2, [*MOE, *EP2]),
    "tp_moe": (2, [*MOE, *degrees(1, 1, tp=2), "--training.micro_batch_size", "2"]),
    "simple_fsdp_moe": (2, [*MOE, *SIMPLE, *degrees(1, 2)]),
    "ep2_fsdp2_moe": (4, [*MOE, *EP2]),
    "ep2_hsdp_moe": (4, [*MOE, *EP2, *degrees(2, 2)]),
    "ep2_tp2_moe": (4, [*MOE, *EP2, *degrees(1, 2, tp=2)]),
    "pp_ep2_moe": (4, [*MOE, *EP2, *PP2]),
    "pp_moe": (2, [*MOE, *PP2]),  # 2 micro-batches of 2 sequences: single_moe's forwards
    "cp_moe": (2, [*MOE, *CP2, "--training.micro_batch_size", "2"]),
    "cp_ep2_moe": (2, [*MOE, *CP2, *EP2, "--training.micro_batch_size", "2"]),  # ep borrows the cp ranks
    "cp_ulysses_moe": (2, [*MOE, *CP2, *ULYSSES, "--training.micro_batch_size", "2"]),
    # Muon (the blocks' matrices orthogonalised whole, spread over the ranks that shard them), against the
    # single device with Muon: every way a matrix is split (FSDP2, HSDP, SimpleFSDP, TP, FSDP2+TP,
    # pipeline stages) or replicated (DDP, classic DDP).
    "single_muon": (1, [*MUON, "--training.micro_batch_size", "2"]),
    "fsdp2_muon": (2, [*MUON, *degrees(1, 2)]),
    "ddp_muon": (2, [*MUON, *degrees(2, 1)]),
    "classic_ddp_muon": (2, [*MUON, "--parallelism.dp_backend", "ddp", *degrees(2, 1)]),
    "simple_fsdp_muon": (2, [*MUON, *SIMPLE, *degrees(1, 2)]),
    "tp_muon": (2, [*MUON, *degrees(1, 1, tp=2)]),
    "pp_muon": (2, [*MUON, *PP2]),
    "fsdp2_w4_muon": (4, [*MUON, *degrees(1, 4)]),
    "hsdp_muon": (4, [*MUON, *degrees(2, 2)]),
    "fsdp2_tp_muon": (4, [*MUON, *degrees(1, 2, tp=2)]),
    "single_moe_sigmoid": (1, [*SIGMOID, "--training.micro_batch_size", "2"]),
    "ep2_moe_sigmoid": (2, [*SIGMOID, *EP2]),
    "pp_moe_sigmoid": (2, [*SIGMOID, *PP2]),
}


def reference(args: list[str]) -> str:
    if MUON[1] in args:
        return "single_muon"
    if SIGMOID[1] in args:
        return "single_moe_sigmoid"
    if MXFP8[1] in args:
        return "single_moe_mx" if MOE[1] in args else "single_mx"
    if MOE[1] in args:  # (the rows whose ranks forward 1 sequence at a time are named in ONE_PER_FORWARD)
        return "single_moe"
    if MLA[1] in args:
        return "single_mla_f8" if FLOAT8[0] in args else "single_mla"
    if QWEN3[0] in args:
        return f"single_{args[args.index(QWEN3[0]) + 1].removeprefix('debug_')}{'_tied' * (TIED[0] in args)}"
    if FLOAT8[0] in args:
        return f"single_f8{'_rowwise' * (ROWWISE[1] in args)}"
    if "--model.n_layers" in args:
        return "single_deep"
    return "single_tied" if TIED[0] in args else "single_causal" if CAUSAL[1] in args else "single"


ONE_PER_FORWARD = ("ep2_fsdp2_moe", "ep2_hsdp_moe", "pp_ep2_moe")
REFERENCE = {name: "single_moe_mb1" if name in ONE_PER_FORWARD else reference(args) for name, (_, args) in LAYOUTS.items()}
REFERENCE["ep2_fsdp2_moe_mx"] = "single_moe_mx_mb1"


def validation_text() -> str:
    """Held-out text for validation losses: prose the bundled corpus (pydoc topics) does not hold."""
    import argparse
    import json as json_module
    import unittest

    return "\n\n".join([argparse.__doc__, json_module.__doc__, unittest.__doc__])


# Validation in every shared run: 1 batch after steps 3 and 6 (torch 2.13's zbv cannot evaluate),
# and (TASK) the bundled task's first 4 examples (16 requests) scored with them in the runs of
# debug's own model (no flavor, float8 or optimizer of its own): the task's path through each
# layout is the layout's (data parallelism's, TP's vocabulary shards, a pipeline's padded
# batches, CP's), not the model's or the recipe's. (The task's first scoring costs a quarter of a
# small run: each request length a new shape for DTensor's sharding rules.)
VALIDATE = ["--training.eval_interval", "3", "--training.eval_steps", "1"]
TASK = ["--eval.interval", "3", "--eval.limit", "4"]


def scores_the_task(args) -> bool:
    return not any(option in args for option in ("--model.flavor", "--training.float8", "--optimizer.name"))


@contextlib.contextmanager
def held(lock: Path):
    """An exclusive lock on the file `lock` (made if missing), for as long as the block runs: the
    other workers' `held` of it waits (the OS lets go of it if this process dies)."""
    with open(lock, "w") as file:
        fcntl.flock(file, fcntl.LOCK_EX)
        yield


@pytest.fixture(scope="session")
def train_once(tmp_path_factory):
    """`train_once(world, *args)` -> (metric rows, step-1 probe records). Each distinct run
    happens once per test session however many tests (in whichever worker) read it, with the
    probe on (step 1), the profiler on (step 2: `train_once.traces[(world, args)]` is its folder;
    it costs ~1%) and the validation loss measured (VALIDATE; the task too where TASK says). A
    run's folder is named by its options in a folder all workers share; the first worker to need
    it trains it under the folder's lock while a second one waits for the lock, then reads what
    the first wrote."""
    runs = session_folder(tmp_path_factory) / "shared-runs"
    runs.mkdir(exist_ok=True)
    val = runs / "val.txt"
    with held(runs / "val.lock"):
        if not val.exists():
            val.write_text(validation_text())

    def train(world: int, *args: str):
        key = (world, args)
        tmp = runs / hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]
        with held(Path(f"{tmp}.lock")):
            if not (tmp / "done").exists():
                shutil.rmtree(tmp, ignore_errors=True)  # (what a failed try left)
                tmp.mkdir()
                task = TASK if scores_the_task(args) else []
                validate = [] if "zbv" in args else [*VALIDATE, *task, "--data.val_path", str(val)]
                run_plait(tmp, *args, *validate, "--debug.dtype_probe", str(tmp / "probe.json"), "--profiling.enable",
                          "--profiling.steps", "1", "--profiling.folder", str(tmp / "trace"), nproc=world,
                          metrics=tmp / "metrics.jsonl")
                (tmp / "done").touch()
        train.traces[key] = tmp / "trace"
        rows = [json.loads(line) for line in (tmp / "metrics.jsonl").read_text().splitlines()]
        return rows, json.loads((tmp / "probe.json").read_text())

    train.traces = {}
    return train


def layout_run(train_once, name: str, precision: list[str] = (), mode: list[str] = ()):
    """A LAYOUTS entry trained for STEPS steps in the given precision options."""
    world, args = LAYOUTS[name]
    return train_once(world, *STEPS, *args, *precision, *mode)


def losses(rows: list[dict]) -> list[float]:
    return [row["loss"] for row in rows]


def val_losses(rows: list[dict]) -> list[float]:
    return [row["val_loss"] for row in rows if "val_loss" in row]


def eval_scores(rows: list[dict]) -> list[tuple[float, float]]:
    """(gold_loss, acc) of the bundled task at each evaluation."""
    return [(row["eval_sample_gold_loss"], row["eval_sample_acc"]) for row in rows if "eval_sample_acc" in row]


def max_abs_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and a, (len(a), len(b))
    return max(abs(x - y) for x, y in zip(a, b))


def environ(pid: int) -> str:
    try:
        return "\0" + open(f"/proc/{pid}/environ").read()
    except OSError:
        return ""
