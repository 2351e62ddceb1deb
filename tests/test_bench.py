"""`plait bench` end to end on the tiny model: the columns and what must hold between rows
(speeds themselves are not asserted)."""

import json
import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = pytest.mark.slow


def test_bench_measures_memory_collectives_and_overhead(tmp_path):
    out = tmp_path / "bench"
    # plan's predictions need a calibration; the data sheet's numbers test the plumbing (the
    # doctor's calibration against a measurement: test_doctor)
    from dataclasses import asdict
    from plait.plan.calibration import data_sheet
    (tmp_path / "doctor.json").write_text(json.dumps({"calibration": asdict(data_sheet("h100"))}))
    proc = subprocess.run([sys.executable, "-m", "plait", "bench", "--flavor", "debug", "--steps", "3",
                           "--calibration", str(tmp_path / "doctor.json"),
                           "--seq_len", "64", "--rows", "raw_pytorch", "transformers", "single", "raw_fsdp2", "ddp", "fsdp2", "fsdp2_ac_full", "pp", "--out",
                           str(out),
                           # fp32 alone: the same rows on every CPU kind, and no bf16 runs, which an AVX2 CPU
                           # emulates (minutes); the bf16 rows share every line of code but the dtype
                           "--precisions", "float32"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("| layout | world | fp32 tok/s | MFU | vs raw | peak mem GiB | state GiB/rank "
            "| collectives/step | AC vs FSDP2 |") in proc.stdout
    assert "| raw PyTorch loop (no plait) | 1 |" in proc.stdout and "| FSDP2 | 2 |" in proc.stdout
    result = json.loads(out.with_suffix(".json").read_text())
    rows = {row["key"]: row for row in result["rows"]}
    assert list(rows) == ["raw_pytorch", "transformers", "single", "raw_fsdp2", "ddp", "fsdp2", "fsdp2_ac_full", "pp"]
    for dtype in ("float32",):
        assert all(row[f"{dtype}_tokens_per_sec"] > 0 and row[f"{dtype}_vs_raw"] > 0
                   and row[f"{dtype}_memory_gib"] > 0 for row in rows.values())
        assert rows["raw_pytorch"][f"{dtype}_vs_raw"] == 1
        # Same model, same fp32 parameters, gradients and AdamW state: plait adds no state memory.
        assert rows["single"][f"{dtype}_state_gib"] == rows["raw_pytorch"][f"{dtype}_state_gib"]
        # transformers' model of the same config.json holds the same parameters; the raw FSDP2 loop shards as plait.
        assert rows["transformers"][f"{dtype}_state_gib"] == rows["single"][f"{dtype}_state_gib"]
        assert rows["raw_fsdp2"][f"{dtype}_state_gib"] == rows["fsdp2"][f"{dtype}_state_gib"]
        assert rows["ddp"][f"{dtype}_state_gib"] == rows["single"][f"{dtype}_state_gib"]
        # FSDP2 at world 2 holds half of everything (up to shard padding).
        assert rows["fsdp2"][f"{dtype}_state_gib"] == pytest.approx(rows["ddp"][f"{dtype}_state_gib"] / 2, rel=1e-3)
        assert rows["single"][f"{dtype}_collectives_per_step"] == 0
        # Activation checkpointing: its peak memory and speed against FSDP2's, the same state.
        ac = rows["fsdp2_ac_full"]
        assert ac[f"{dtype}_state_gib"] == rows["fsdp2"][f"{dtype}_state_gib"] and ac[f"{dtype}_ac_speed"] > 0
        assert ac[f"{dtype}_ac_saved_gib"] == rows["fsdp2"][f"{dtype}_memory_gib"] - ac[f"{dtype}_memory_gib"]
        assert "| FSDP2, AC full | 2 |" in proc.stdout and " GiB saved, " in proc.stdout
        assert rows["ddp"][f"{dtype}_collectives_per_step"] > 0 and rows["fsdp2"][f"{dtype}_collectives_per_step"] > 0
    ratio, pipeline = result["state_ratios"]
    assert ratio["layout"] == "FSDP2" and ratio["ratio"] == pytest.approx(0.5, rel=1e-3)
    # Rank 0 holds stage 0: the embedding and one of the two blocks, about half of the model.
    assert pipeline["reference"] == "single device" and 0.3 < pipeline["ratio"] < 0.7
    for dtype in ("float32",):  # each rank's idle share, next to the schedule's ideal bubble
        assert set(rows["pp"][f"{dtype}_idle"]) == {"0", "1"} and all(0 < v < 1 for v in rows["pp"][f"{dtype}_idle"].values())
        assert f"PP2 (1f1b, 4 micro-batches) {dtype}: idle rank 0 " in proc.stdout
    line = "FSDP2 state per rank / DDP (fully_shard, replicate mesh) state per rank at world 2: 0.50"
    assert line in proc.stdout and line in out.with_suffix(".md").read_text()
    for line in ("framework tax: single device vs raw PyTorch loop (no plait): ",
                 "framework tax: single device vs transformers' model, raw loop: ",
                 "framework tax: FSDP2 vs raw FSDP2 loop (fully_shard, no plait): "):
        assert line in proc.stdout and "x (float32) tokens/s" in proc.stdout.split(line)[1].splitlines()[0]
    machine = result["hardware"]["debug"]
    assert out.with_suffix(".md").read_text().startswith(f"hardware: {machine['device']} | native bf16: ")
    assert set(machine["peak_tflops"]) == {"float32"} and all(machine["peak_tflops"].values())
    # MFU is at most 1, or not reported where a calibration proved too low (see test_hardware)
    assert all(row[f"{dtype}_mfu"] is None or 0 < row[f"{dtype}_mfu"] <= 1
               for row in rows.values() for dtype in ("float32",))
    assert any(row["float32_mfu"] for row in rows.values())
    # plan's prediction of each row it models, beside the measurement (not the raw loops)
    assert all((f"{dtype}_predicted_tokens_per_sec" in row) == (key not in ("raw_pytorch", "transformers", "raw_fsdp2"))
               for key, row in rows.items() for dtype in ("float32",))
    assert "plan: FSDP2: float32 predicted " in proc.stdout


def test_bench_says_when_bf16_was_not_measured():
    """Where bf16 is emulated, the default is to measure fp32 only and say so in place of the table;
    a float8 row is compared with the same layout without float8."""
    from plait.proof.bench_table import markdown

    row = {"flavor": "debug", "key": "single", "layout": "single device", "world": 1, "float32_tokens_per_sec": 100.0,
           "float32_mfu": 0.5, "float32_vs_raw": None, "float32_memory_gib": 1.0, "float32_state_gib": 0.1,
           "float32_collectives_per_step": 0}
    machine = {"device": "AVX2 CPU", "native_bf16": False, "why": "emulated here", "threads": 2,
               "dtypes": ["float32"], "peak_tflops": {"float32": 0.1}}
    float8 = {**row, "key": "single_float8", "layout": "single device, float8 tensorwise", "float32_tokens_per_sec": 25.0}
    text = markdown({"settings": {"seq_len": 64, "global_batch_size": 4, "warmup": 2, "steps": 3},
                     "hardware": {"debug": machine}, "rows": [row, float8], "state_ratios": []})
    assert "single device, float8 tensorwise vs single device: 0.25x (float32) tokens/s" in text
    assert "| single device | 1 | 100 | 50.0% | - | 1.00 | 0.1 | 0 | - |" in text
    assert "bf16: not measured, emulated on this device (emulated here); `plait bench --emulated_bf16 run`" in text
    assert "bf16 tok/s" not in text


def test_bench_of_one_precision_tables_it_alone():
    """`--precisions bfloat16` (a GPU's choice): one table, no fp32 column or "not measured" line,
    state ratios from the bf16 runs."""
    from plait.proof.bench import state_ratios
    from plait.proof.bench_table import markdown

    def row(key, layout, world, state):
        return {"flavor": "debug", "key": key, "layout": layout, "world": world, "bfloat16_tokens_per_sec": 100.0,
                "bfloat16_mfu": 0.4, "bfloat16_vs_raw": None, "bfloat16_memory_gib": 1.0, "bfloat16_state_gib": state,
                "bfloat16_collectives_per_step": 0}

    rows = [row("ddp", "DDP", 2, 0.2), row("fsdp2", "FSDP2", 2, 0.1)]
    ratios = state_ratios(rows)
    assert [(r["layout"], r["ratio"]) for r in ratios] == [("FSDP2", 0.5)]
    machine = {"device": "GPU", "native_bf16": True, "why": "-", "threads": 16, "dtypes": ["bfloat16"],
               "peak_tflops": {"bfloat16": 989.5}}
    text = markdown({"settings": {"seq_len": 64, "global_batch_size": 4, "warmup": 2, "steps": 3,
                                  "precisions": ["bfloat16"]},
                     "hardware": {"debug": machine}, "rows": rows, "state_ratios": ratios})
    assert "| layout | world | bf16 tok/s | MFU | vs raw | peak mem GiB |" in text
    assert "fp32" not in text and "not measured" not in text and "| FSDP2 | 2 | 100 | 40.0% | - | 1.00 | 0.1 |" in text
    from plait.cli import main
    assert main(["bench", "--precisions"]) == 2  # (refused before any row runs)


def test_bench_tables_a_compiled_column_and_the_framework_tax():
    """With --compile, the rows measured compiled show tokens/s and the ratio to eager, and the tax
    lines compare eager with eager and compiled with compiled."""
    from plait.proof.bench_table import markdown

    def row(key, layout, eager, compiled=None):
        return {"flavor": "debug", "key": key, "layout": layout, "world": 1, "float32_tokens_per_sec": eager,
                "float32_mfu": None, "float32_vs_raw": None, "float32_memory_gib": 1.0, "float32_state_gib": 0.1,
                "float32_collectives_per_step": 0, **({"float32_compiled_tokens_per_sec": compiled} if compiled else {})}

    machine = {"device": "CPU", "native_bf16": False, "why": "-", "threads": 2, "dtypes": ["float32"],
               "peak_tflops": {"float32": 0.1}}
    rows = [row("raw_pytorch", "raw loop", 100.0, 150.0), row("single", "single device", 98.0, 156.0),
            row("ddp", "DDP", 90.0)]
    rows[1] |= {"float32_compiled_graph_breaks": 0, "float32_compiled_recompiles": 0,  # (plait's rows: its report,
                "float32_compiled_eager_fraction": 0.28}  # and its profiled step's time outside graphs)
    text = markdown({"settings": {"seq_len": 64, "global_batch_size": 4, "warmup": 2, "steps": 3, "compile": True},
                     "hardware": {"debug": machine}, "rows": rows, "state_ratios": []})
    assert "| layout | world | fp32 tok/s | compiled tok/s | MFU |" in text
    assert "| single device | 1 | 98 | 156 (1.59x, 0 graph breaks, 0 recompiles, 28% eager) | n/a |" in text
    assert "| raw loop | 1 | 100 | 150 (1.50x) | n/a |" in text and "| DDP | 1 | 90 | - | n/a |" in text
    assert "framework tax: single device vs raw loop: 0.980x (float32), 1.040x (float32, compiled) tokens/s" in text


def test_bench_rounds_take_each_rows_median_speed_and_highest_peak():
    """--rounds runs every row once per round: a row's tokens/s (and MFU) is the median of its
    rounds, its peak memory the highest, and the rounds' speeds stay in the JSON."""
    from plait.config import ConfigError
    from plait.proof.bench import BenchConfig, across_rounds, bench
    from plait.proof.bench_table import markdown

    runs = [{"float32_tokens_per_sec": tps, "float32_compiled_tokens_per_sec": 2 * tps, "float32_mfu": tps / 1000,
             "float32_memory_gib": mem, "float32_state_gib": 0.1, "float32_collectives_per_step": 3}
            for tps, mem in ((130.0, 1.0), (100.0, 1.5), (90.0, 1.2))]  # the first round neither the median nor the peak
    row = across_rounds(runs)
    assert row["float32_tokens_per_sec"] == 100.0 and row["float32_compiled_tokens_per_sec"] == 200.0
    assert row["float32_mfu"] == 0.1 and row["float32_memory_gib"] == 1.5
    assert row["float32_state_gib"] == 0.1 and row["float32_collectives_per_step"] == 3
    assert row["rounds_tokens_per_sec"]["float32_tokens_per_sec"] == [130.0, 100.0, 90.0]
    assert "rounds_tokens_per_sec" not in across_rounds(runs[:1])
    machine = {"device": "CPU", "native_bf16": False, "why": "-", "threads": 2, "dtypes": ["float32"],
               "peak_tflops": {"float32": 0.1}}
    table = {"flavor": "debug", "key": "single", "layout": "single device", "world": 1, "float32_vs_raw": None, **row}
    text = markdown({"settings": {"seq_len": 64, "global_batch_size": 4, "warmup": 2, "steps": 3, "rounds": 3},
                     "hardware": {"debug": machine}, "rows": [table], "state_ratios": []})
    assert "median of steps 3-3, then of 3 rounds run in turn; " in text
    with pytest.raises(ConfigError, match="rounds: must be at least 1, got 0"):
        bench(BenchConfig(rounds=0))


def test_bench_warns_under_the_table_when_its_ratios_cannot_be_trusted(monkeypatch):
    """Other work on the machine (the 1-minute load average beyond what the bench's own ranks make)
    or rounds of a row that disagree: a warning line under the table, not silently skewed ratios."""
    import os

    from plait.proof import bench as bench_module
    from plait.proof.bench_table import markdown

    machine = {"device": "CPU", "native_bf16": False, "why": "-", "threads": 2, "dtypes": ["float32"],
               "peak_tflops": {"float32": 0.1}}
    monkeypatch.setattr(bench_module, "hardware", lambda cfg, flavor: machine)  # no rows: nothing is measured
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    loads = iter([(2.5, 0.0, 0.0), (3.5, 0.0, 0.0)])  # at the start, at the end
    monkeypatch.setattr(os, "getloadavg", lambda: next(loads))
    result = bench_module.bench(bench_module.BenchConfig(rows=(), flavor="debug"))
    assert result["load"] == {"cores": 2, "start": 2.5, "end": 3.5, "own": 2}
    busy = ("warning: other work kept this machine busy (1-minute load average 2.5 at the start, 3.5 at the end, "
            "the bench's own ranks at most 2, on 2 cores): ratios between rows are not to be trusted; rerun on an idle machine")
    assert markdown(result).splitlines()[-1] == busy
    idle = {**result, "load": {"cores": 2, "start": 0.2, "end": 2.4, "own": 2}}  # the end's load is the bench's own
    assert "warning" not in markdown(idle)

    row = {"flavor": "debug", "key": "single", "layout": "single device", "world": 1, "float32_tokens_per_sec": 100.0,
           "float32_mfu": None, "float32_vs_raw": None, "float32_memory_gib": 1.0, "float32_state_gib": 0.1,
           "float32_collectives_per_step": 0, "rounds_tokens_per_sec": {"float32_tokens_per_sec": [130.0, 100.0, 90.0]}}
    steady = {**row, "key": "ddp", "layout": "DDP", "rounds_tokens_per_sec": {"float32_tokens_per_sec": [99.0, 100.0, 101.0]}}
    text = markdown({**idle, "settings": {**idle["settings"], "rounds": 3}, "rows": [row, steady]})
    assert text.splitlines()[-1] == ("warning: single device: its 3 rounds differ by 40% in float32 tokens/s (90 to 130): "
                                     "a noisy machine; ratios with this row are uncertain")
    assert text.count("warning") == 1
