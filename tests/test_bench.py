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
    proc = subprocess.run([sys.executable, "-m", "plait", "bench", "--flavor", "debug", "--steps", "3",
                           "--seq_len", "64", "--rows", "raw_pytorch", "single", "ddp", "fsdp2", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("| layout | world | bf16 tok/s | MFU | vs raw | vs fp32 | peak mem GiB | state GiB/rank "
            "| collectives/step |") in proc.stdout
    assert "| raw PyTorch loop (no plait) | 1 |" in proc.stdout and "| FSDP2 | 2 |" in proc.stdout
    result = json.loads(out.with_suffix(".json").read_text())
    rows = {row["key"]: row for row in result["rows"]}
    assert list(rows) == ["raw_pytorch", "single", "ddp", "fsdp2"]
    for dtype in ("float32", "bfloat16"):
        assert all(row[f"{dtype}_tokens_per_sec"] > 0 and row[f"{dtype}_mfu"] > 0 and row[f"{dtype}_vs_raw"] > 0
                   and row[f"{dtype}_memory_gib"] > 0 for row in rows.values())
        assert rows["raw_pytorch"][f"{dtype}_vs_raw"] == 1
        # Same model, same fp32 parameters, gradients and AdamW state: plait adds no state memory.
        assert rows["single"][f"{dtype}_state_gib"] == rows["raw_pytorch"][f"{dtype}_state_gib"]
        assert rows["ddp"][f"{dtype}_state_gib"] == rows["single"][f"{dtype}_state_gib"]
        # FSDP2 at world 2 holds half of everything (up to shard padding).
        assert rows["fsdp2"][f"{dtype}_state_gib"] == pytest.approx(rows["ddp"][f"{dtype}_state_gib"] / 2, rel=1e-3)
        assert rows["single"][f"{dtype}_collectives_per_step"] == 0
        assert rows["ddp"][f"{dtype}_collectives_per_step"] > 0 and rows["fsdp2"][f"{dtype}_collectives_per_step"] > 0
    [ratio] = result["state_ratios"]
    assert ratio["layout"] == "FSDP2" and ratio["ratio"] == pytest.approx(0.5, rel=1e-3)
    line = "FSDP2 state per rank / DDP (fully_shard, replicate mesh) state per rank at world 2: 0.50"
    assert line in proc.stdout and line in out.with_suffix(".md").read_text()
    assert out.with_suffix(".md").read_text().startswith("flavor debug")
