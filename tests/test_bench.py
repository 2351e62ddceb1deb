"""`plait bench` end to end on the tiny model (the numbers themselves are not asserted)."""

import json
import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = pytest.mark.slow


def test_bench_prints_a_table_and_writes_json(tmp_path):
    out = tmp_path / "bench"
    proc = subprocess.run([sys.executable, "-m", "plait", "bench", "--flavor", "debug", "--steps", "2", "--warmup", "1",
                           "--seq_len", "64", "--rows", "single", "tp", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| single device | 1 |" in proc.stdout and "| TP2 | 2 |" in proc.stdout
    table = json.loads(out.with_suffix(".json").read_text())
    assert [row["layout"] for row in table] == ["single device", "TP2"]
    assert all(row["bfloat16_tokens_per_sec"] > 0 and row["float32_mfu"] > 0 for row in table)
    assert out.with_suffix(".md").read_text().startswith("flavor debug")
