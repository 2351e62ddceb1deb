"""Watching a run: Weights & Biases (offline, read back from its local run folder) and `plait plot`."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest

from plait.arguments import parse_args
from plait.checks import check_options
from plait.cli import main
from plait.config import ConfigError
from conftest import TINY, launch

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def wandb_records(run_folder: Path):
    """The records of an offline W&B run's run-ID.wandb: wandb 0.31 has no Python reader of its
    own (its Go core writes it), so this reads the LevelDB log format it uses: a 7-byte file
    header, then 32 KiB blocks of chunks (crc32 4, length 2, type 1: full, first, middle, last),
    each record one protobuf `Record`."""
    from wandb.proto import wandb_internal_pb2

    data = next(run_folder.glob("run-*.wandb")).read_bytes()
    assert data[:4] == b":W&B"
    position, block, pending = 7, 32768, b""
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a chunk header is padding
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if kind == 0:
            break
        pending += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a whole record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def read_wandb_run(run_folder: Path) -> dict:
    """id, project, name, config (flat), history rows and the final summary of an offline run."""
    run, config, history, summary = None, {}, [], {}
    for record in wandb_records(run_folder):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
            config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
        elif kind == "config":
            config.update({item.key: json.loads(item.value_json) for item in record.config.update})
        elif kind == "history":
            history.append({(item.key or ".".join(item.nested_key)): json.loads(item.value_json)
                            for item in record.history.item})
        elif kind == "summary":
            summary.update({(item.key or ".".join(item.nested_key)): json.loads(item.value_json)
                            for item in record.summary.update})
    return {"id": run.run_id, "project": run.project, "name": run.display_name, "config": config,
            "history": history, "summary": summary}


def test_a_run_logs_to_wandb_offline_and_a_resumed_run_continues_it(tmp_path):
    pytest.importorskip("wandb")
    folder, wandb_dir = tmp_path / "ckpt", tmp_path / "wandb"
    env = {"WANDB_DIR": str(wandb_dir), "WANDB_MODE": "offline", "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
           "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"), "WANDB_DATA_DIR": str(tmp_path / "wandb-data")}
    job = [*TINY, "--checkpoint.folder", str(folder), "--checkpoint.interval", "3", "--metrics.wandb_project",
           "plait-test", "--metrics.wandb_run_name", "tiny", "--metrics.wandb_offline"]

    def train(steps: int, metrics: Path, *more: str):
        proc = launch(["train", *job, "--training.steps", str(steps), "--metrics.jsonl", str(metrics), *more], 1,
                      300, env=env, forked=True)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return [json.loads(line) for line in metrics.read_text().splitlines()]

    plot = tmp_path / "end-of-run.png"
    first_rows = train(3, tmp_path / "first.jsonl", "--metrics.plot", str(plot))
    assert plot.read_bytes()[:8] == PNG_MAGIC  # metrics.plot: drawn when the run ends
    (first,) = [read_wandb_run(f) for f in (wandb_dir / "wandb").glob("offline-run-*")]
    assert (first["project"], first["name"]) == ("plait-test", "tiny")
    assert first["config"]["training"]["steps"] == 3 and first["config"]["model"]["flavor"] == "debug"
    assert first["config"]["model_args"]["dim"] > 0  # the model the job built, flavor or Hugging Face folder
    assert [row["_step"] for row in first["history"]] == [1, 2, 3]
    for logged, row in zip(first["history"], first_rows):
        for key in ("loss", "lr", "grad_norm", "tokens_per_sec", "memory_gib", "step_time"):
            assert logged[key] == pytest.approx(row[key], rel=1e-12), key
    assert first["summary"]["loss"] == pytest.approx(first_rows[-1]["loss"], rel=1e-12)
    # the end-of-run summary (plait.metrics.summary), as the console and <jsonl>.summary.json have it
    summary = json.loads((tmp_path / "first.summary.json").read_text())
    assert summary["steps_run"] == 3 and summary["checkpoint"].endswith("step-3")
    assert {k: first["summary"][k] for k in ("steps_run", "checkpoint", "wall_time_s", "tokens")} == \
        {k: summary[k] for k in ("steps_run", "checkpoint", "wall_time_s", "tokens")}
    assert (folder / "wandb-run-id").read_text().strip() == first["id"]

    train(5, tmp_path / "second.jsonl")  # resumes from step 3's checkpoint
    runs = sorted((read_wandb_run(f) for f in (wandb_dir / "wandb").glob("offline-run-*")),
                  key=lambda run: run["history"][0]["_step"])
    assert len(runs) == 2
    second = runs[1]
    assert second["id"] == first["id"]  # the same W&B run, continued
    assert [row["_step"] for row in second["history"]] == [4, 5]
    assert second["config"]["training"]["steps"] == 5


def test_wandb_run_skips_unmeasured_values_and_takes_the_summary_whole(tmp_path, monkeypatch):
    """In-process, no training: an MFU of None (not measured) is left out rather than logged as
    0, and the end-of-run summary reaches W&B with its nested parts."""
    pytest.importorskip("wandb")
    for name, value in {"WANDB_DIR": tmp_path, "WANDB_MODE": "offline", "WANDB_CONFIG_DIR": tmp_path / "config",
                        "WANDB_CACHE_DIR": tmp_path / "cache", "WANDB_DATA_DIR": tmp_path / "data"}.items():
        monkeypatch.setenv(name, str(value))
    from plait.metrics.wandb_log import WandbRun

    cfg = parse_args([*TINY, "--metrics.wandb_project", "plait-test", "--metrics.wandb_offline"])
    run = WandbRun(cfg, {"dim": 8}, 0)
    run.log({"step": 1, "loss": 2.5, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_sec": 10.0, "mfu": None})
    summary = {"loss": 2.5, "wall_time_s": 3.0, "checkpoint": "ckpt/step-1", "val_loss": None,
               "sources": [{"source": "corpus", "epochs": 0.5}]}
    run.finish(summary)
    run.close()
    (logged,) = [read_wandb_run(f) for f in (tmp_path / "wandb").glob("offline-run-*")]
    assert "mfu" not in logged["history"][0] and logged["history"][0]["loss"] == 2.5
    assert {k: logged["summary"][k] for k in ("loss", "wall_time_s", "checkpoint", "sources")} == \
        {k: v for k, v in summary.items() if v is not None}


def test_wandb_without_the_package_is_one_line_at_start_up(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: `import wandb` raises ImportError
    with pytest.raises(ConfigError, match=r'^metrics.wandb_project: .*pip install -e "\.\[wandb\]"'):
        check_options(parse_args([*TINY, "--metrics.wandb_project", "p"]), 1)
    with pytest.raises(ConfigError, match="^metrics.wandb_run_name: set metrics.wandb_project too"):
        check_options(parse_args([*TINY, "--metrics.wandb_run_name", "r"]), 1)


def metrics_file(path: Path, scale: float) -> Path:
    rows = [{"step": s, "loss": scale * 10 / s, "grad_norm": scale / s, "lr": 1e-3 * min(1, s / 3),
             "tokens_per_sec": 1000.0 + s, "mfu": None, "memory_gib": 0.1} for s in range(1, 9)]
    for row in rows[3::4]:
        row["val_loss"] = row["loss"] * 1.1
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_plot_draws_one_run_and_several_overlaid(tmp_path, capsys):
    a, b = metrics_file(tmp_path / "a.jsonl", 1.0), metrics_file(tmp_path / "b.jsonl", 0.5)
    assert main(["plot", str(a), "--out", str(tmp_path / "one.png")]) == 0
    assert main(["plot", str(a), str(b), "--out", str(tmp_path / "two.png")]) == 0
    for name in ("one.png", "two.png"):
        png = (tmp_path / name).read_bytes()
        assert png[:8] == PNG_MAGIC and len(png) > 10_000
    assert "two.png: 2 runs" in capsys.readouterr().out
    assert main(["plot", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "x.png")]) == 2
    assert "missing.jsonl" in capsys.readouterr().err


@pytest.mark.parametrize("line", ["[1, 2]", '{"text": "a validation document"}', '{"step": "one", "loss": 1.0}'])
def test_plot_refuses_a_file_that_is_not_metrics_in_one_line(tmp_path, capsys, line):
    """JSON lines that are not a run's rows (a list, a validation set's documents): one line, no traceback."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text(line + "\n")
    assert main(["plot", str(bad), "--out", str(tmp_path / "x.png")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"plait: error: files: {bad} line 1 is not a row of metrics (a JSON object with a whole-number step): is it "
        "a metrics.jsonl?"]


def test_plot_and_a_task_refuse_a_file_that_is_not_utf8_in_one_line(tmp_path, capsys):
    from plait.config import ConfigError
    from plait.evals.tasks import load_task

    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes('{"step": 1, "note": "caf\u00e9"}\n'.encode("latin-1"))
    assert main(["plot", str(latin1), "--out", str(tmp_path / "x.png")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"plait: error: files: {latin1} is not UTF-8 text (byte 24): is it a metrics.jsonl?"]
    with pytest.raises(ConfigError, match=r"is not UTF-8 text \(byte 24\): is it a task file\?"):
        load_task(str(latin1))


def test_plot_reads_rows_whose_strings_hold_line_separators(tmp_path):
    """Lines end at \\n only: U+2028 and U+0085 are characters in a JSON string (json.dumps with
    ensure_ascii=False writes them as they are)."""
    from plait.metrics.plot import read_rows

    rows = [{"step": 1, "loss": 2.0, "note": "a\u2028b\x85c"}, {"step": 2, "loss": 1.5}]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    assert read_rows(metrics) == rows
