"""Checkpoints and token shards on object storage: a real S3 server (moto's, tests/object_store.py)
on a local port, with its faults. Every comparison is with the same run on a local folder, and
bitwise: the bytes stored are the same bytes, so the training that reads them back is the same."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest

from conftest import run_plait
from object_store import ObjectStore
from plait.arguments import parse_args
from plait.checks import validate
from plait.config import ConfigError
from plait.data.batch_schedule import BatchSchedule

pytestmark = pytest.mark.slow
FSDP2 = ["--parallelism.dp_shard", "-1", "--training.steps", "4", "--checkpoint.interval", "2"]


@pytest.fixture(scope="module")
def store():
    server = ObjectStore()
    yield server
    server.close()


@pytest.fixture
def s3_env(store, monkeypatch):
    import s3fs

    for key, value in store.env.items():
        monkeypatch.setenv(key, value)
    s3fs.S3FileSystem.clear_instance_cache()  # (each test's clients as a new process's: of its environment)
    yield store
    s3fs.S3FileSystem.clear_instance_cache()


def losses(rows: list[dict]) -> list[tuple]:
    return [(r["step"], r["loss"], r["grad_norm"]) for r in rows]


def test_a_run_saved_to_s3_through_faults_resumes_from_it_as_from_a_local_folder(tmp_path, s3_env):
    """World 2 (FSDP2) saves every 2 steps, to a local folder and to S3. On S3 the first two
    writes fail with 500 (retried, and said), and the server goes away in the middle of step 4's
    upload: that save fails in one line and claims nothing, and the run ends as
    `checkpoint.on_error continue` says (its last checkpoint step 2). Once it is back, the run resumes from
    step 2 at world 2 and (a second job, from the same checkpoint) at world 1: bitwise the rows of
    the same resumes from the local folder; an export from S3 is the local export, byte for byte."""
    local = tmp_path / "local"
    env = s3_env.env
    reference, _ = run_plait(tmp_path, *FSDP2, "--checkpoint.folder", str(local), nproc=2)

    s3_env.fail_writes, s3_env.down_from = 2, "/run/step-4/__1_0.distcp"  # rank 1 mid-upload
    rows, failed = run_plait(tmp_path, *FSDP2, "--checkpoint.folder", "s3://plait/run", "--checkpoint.on_error",
                             "continue", nproc=2, check=False, env=env)
    assert s3_env.failed == 2, failed.stdout[-3000:] + failed.stderr[-3000:]
    assert failed.returncode == 0 and s3_env.down.is_set()
    assert losses(rows) == losses(reference)  # trained the same (steps 1-4 logged before the save failed)
    out = failed.stdout + failed.stderr
    assert "plait: checkpoint s3://plait/run/step-2 complete" in out and "retried" in out, out[-3000:]
    assert "checkpoint: saving s3://plait/run/step-4 failed" in out and "training goes on" in out, out[-3000:]
    fs = s3_env.fs()
    assert fs.exists("plait/run/step-2/plait.json") and not fs.exists("plait/run/step-4/plait.json")
    assert env["AWS_SECRET_ACCESS_KEY"] not in out and env["AWS_SECRET_ACCESS_KEY"] not in \
        fs.cat("plait/run/step-2/plait.json").decode()  # credentials never printed nor recorded

    s3_env.come_back()
    resumed, done = run_plait(tmp_path, *FSDP2, "--checkpoint.folder", "s3://plait/run", "--checkpoint.async_mode",
                              "async", nproc=2, env=env)  # (step 4 uploaded in the background)
    assert "resumed from s3://plait/run/step-2" in done.stdout + done.stderr
    assert fs.exists("plait/run/step-4/plait.json")
    assert losses(resumed) == losses(reference)[2:]

    # world 1: each folder's step-4 removed, both resume from step 2 (not bitwise world 2's: one
    # rank sums the gradient in another order; bitwise each other's)
    fs.rm("plait/run/step-4", recursive=True)
    for step_4 in (local / "step-4").iterdir():
        step_4.unlink()
    (local / "step-4").rmdir()
    alone = [run_plait(tmp_path, *FSDP2, "--parallelism.dp_shard", "1", "--checkpoint.folder", folder,
                       "--checkpoint.keep_latest_k", "1", env=env)[0] for folder in ("s3://plait/run", str(local))]
    assert losses(alone[0]) == losses(alone[1]) and [r["step"] for r in alone[0]] == [3, 4]
    assert not fs.exists("plait/run/step-2") and not (local / "step-2").exists()  # (keep_latest_k 1 pruned it)
    assert fs.exists("plait/run/step-4/plait.json") and (local / "step-4" / "plait.json").exists()

    from plait.cli import main

    assert main(["export", "--checkpoint", "s3://plait/run", "--out", "s3://plait/hf"]) == 0
    assert main(["export", "--checkpoint", str(local), "--out", str(tmp_path / "hf")]) == 0
    exported = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert sorted(name.rsplit("/", 1)[1] for name in fs.ls("plait/hf")) == exported
    for name in exported:
        assert fs.cat(f"plait/hf/{name}") == (tmp_path / "hf" / name).read_bytes(), name


def test_training_reads_s3_shards_as_the_same_shards_on_disk(tmp_path, s3_env):
    """`plait tokenize --out s3://...` writes what it writes to a local folder, byte for byte; the
    loader reads the same batches from each, including after a resume from its state."""
    from plait.cli import main
    from plait.data.loader import BatchLoader
    from plait.data.shards import TokenizedFolder, RangedShard

    for out in ("s3://plait/tokens", str(tmp_path / "tokens")):
        assert main(["tokenize", "--out", out, "--workers", "1", "--shard_mb", "0.05",
                     "--data.vocab_size", "512"]) == 0
    fs = s3_env.fs()
    names = sorted(p.name for p in (tmp_path / "tokens").iterdir())
    assert sorted(name.rsplit("/", 1)[1] for name in fs.ls("plait/tokens")) == names and len(names) > 4
    assert all(fs.cat(f"plait/tokens/{name}") == (tmp_path / "tokens" / name).read_bytes() for name in names)

    remote, disk = TokenizedFolder("s3://plait/tokens"), TokenizedFolder(str(tmp_path / "tokens"))
    assert isinstance(remote._shard(0), RangedShard)  # read by ranges, not memory-mapped from a download
    loaders = [BatchLoader([folder], [1.0], 64, 8, 2, 1, 2, seed=5) for folder in (remote, disk)]
    for _ in range(3):
        (a, b), (c, d) = (loader.next_batches()[0] for loader in loaders)
        assert a.equal(c) and b.equal(d)
    state = loaders[0].state_dict()
    again = BatchLoader([TokenizedFolder("s3://plait/tokens")], [1.0], 64, 8, 2, 1, 2, seed=5)
    again.load_state_dict(json.loads(json.dumps(state)))
    assert again.next_batches()[0][0].equal(loaders[1].next_batches()[0][0])
    start = len(disk) - 100  # a read across the end of one shard into the next
    assert np.array_equal(remote.read(start, 100), disk.read(start, 100))


@pytest.mark.parametrize("options, says", [
    (["--checkpoint.folder", "s3://no-such-bucket/run"], "checkpoint.folder: s3://no-such-bucket/run: the bucket "
                                                         "'no-such-bucket' does not exist"),
    (["--checkpoint.folder", "gs://bucket/run"], "checkpoint.folder: gs://bucket/run needs the package gcsfs"),
    (["--checkpoint.folder", "nosuch://bucket/run"], "checkpoint.folder: 'nosuch://bucket/run' is a URL of "
                                                     "nosuch://, which no fsspec filesystem serves"),
    (["--checkpoint.folder", "s3://"], "checkpoint.folder: 's3://' names no bucket or folder"),
    (["--data.path", "s3://plait/raw.txt"], "data.path: 's3://plait/raw.txt' does not exist"),
    (["--checkpoint.load", "s3://plait/nothing"], "checkpoint.load: 's3://plait/nothing' is not a folder"),
])
def test_a_url_that_cannot_serve_the_run_is_refused_in_one_line_at_start_up(s3_env, options, says):
    with pytest.raises(ConfigError) as refused:
        validate(parse_args(options), world=1)
    assert str(refused.value).startswith(says), refused.value


def test_without_credentials_or_server_the_refusal_names_the_option(s3_env, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")  # nothing listens there
    with pytest.raises(ConfigError, match=r"^checkpoint.folder: s3://plait/run is unreachable: "):
        validate(parse_args(["--checkpoint.folder", "s3://plait/run"]), world=1)


def test_metrics_and_their_plot_under_a_url_keep_each_step_once_across_a_resume(s3_env, capsys):
    """The JSONL is uploaded whole with each console line (an object store has no append) and at
    the end, with its summary and plot; a run resumed from step 2 drops the rows after it."""
    from plait.metrics import summary
    from plait.metrics.logger import MetricsLogger

    def row(step: int) -> dict:
        return {"step": step, "loss": 5.0 - step / 10, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_sec": 100.0,
                "step_time": 1.0, "mfu": None, "memory_gib": 0.1}

    fs = s3_env.fs()
    first = MetricsLogger("s3://plait/metrics/m.jsonl", "", 2, plot="s3://plait/metrics/loss.png", steps=4)
    for step in (1, 2, 3):
        first.log(row(step))
        published = [json.loads(line)["step"] for line in fs.cat("plait/metrics/m.jsonl").decode().splitlines()]
        assert published == ([1] if step == 1 else [1, 2])  # (uploaded at the lines of steps 1 and 2)
    first.close()  # a run stopped after step 3: its rows are all there
    assert [json.loads(line)["step"] for line in fs.cat("plait/metrics/m.jsonl").decode().splitlines()] == [1, 2, 3]
    assert fs.cat("plait/metrics/loss.png").startswith(b"\x89PNG")

    resumed = MetricsLogger("s3://plait/metrics/m.jsonl", "", 2, resumed_step=2, steps=4)
    for step in (3, 4):
        resumed.log(row(step))
    loader = types.SimpleNamespace(schedule=BatchSchedule(64, 4), step=4, sources=[], used=[], num_sequences=[])
    resumed.finish(summary.build([row(3), row(4)], loader, 1.0, 3.0, None))
    resumed.close()
    assert [json.loads(line)["step"] for line in fs.cat("plait/metrics/m.jsonl").decode().splitlines()] == [1, 2, 3, 4]
    assert json.loads(fs.cat("plait/metrics/m.summary.json"))["step"] == 4
