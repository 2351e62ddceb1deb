"""What plait decides from the hardware: the compute dtype `auto` picks, MFU's peak, and the
warning for bf16 where it is emulated. The other CPU kind is reached two ways: a mocked
capability query, and oneDNN/ATen capped at AVX2 (ONEDNN_MAX_CPU_ISA, ATEN_CPU_CAPABILITY),
which runs the emulated bf16 kernels of an AVX2-only CPU on any x86 machine."""

import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, TINY
from plait import hardware, precision
from plait.arguments import parse_args
from plait.hardware import Peak, peak_flops
from plait.metrics.logger import Utilisation

AVX2_ONLY = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}


@pytest.mark.parametrize("native, expected", [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_computes_in_bf16_only_where_the_hardware_has_it(monkeypatch, native, expected):
    monkeypatch.setattr(precision, "native_bf16", lambda device: (native, "mocked CPU"))
    chosen = precision.resolve(parse_args([]))
    assert chosen.compute == expected and chosen.chosen_by == "auto: mocked CPU" and not chosen.emulated
    assert f"compute {str(expected)[6:]} (auto: mocked CPU)" in chosen.describe()
    # What is asked is what runs: an explicit bfloat16 is bf16 on any hardware, flagged where emulated.
    asked = precision.resolve(parse_args(["--training.mixed_precision_param", "bfloat16"]))
    assert asked.compute == torch.bfloat16 and asked.emulated == (not native)


def test_an_avx2_only_cpu_is_not_native_bf16():
    code = "import torch; from plait.hardware import native_bf16; print(native_bf16(torch.device('cpu')))"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **AVX2_ONLY}, capture_output=True,
                         text=True, check=True, cwd=ROOT).stdout
    assert out.startswith("(False, 'this CPU (AVX2) has neither AMX nor AVX512-BF16")


def test_on_an_avx2_cpu_auto_trains_fp32_and_asked_bf16_warns_how_much_slower(tmp_path):
    env = {**os.environ, **AVX2_ONLY}
    base = [sys.executable, "-m", "plait", "train", *TINY, "--training.steps", "1"]
    auto = subprocess.run([*base, "--training.mixed_precision_param", "auto"], env=env, capture_output=True,
                          text=True, cwd=ROOT)
    assert auto.returncode == 0, auto.stderr[-2000:]
    assert "precision: compute float32 (auto: this CPU (AVX2) has neither AMX nor AVX512-BF16" in auto.stdout
    assert "warning" not in auto.stdout
    asked = subprocess.run([*base, "--training.mixed_precision_param", "bfloat16"], env=env, capture_output=True,
                           text=True, cwd=ROOT)
    assert asked.returncode == 0, asked.stderr[-2000:]
    assert "precision: compute bfloat16 (emulated: no bf16 matmul units here)" in asked.stdout
    [warning] = [line for line in asked.stdout.splitlines() if line.startswith("plait: warning:")]
    slower = float(warning.split("measured ")[1].split("x slower")[0])
    print(f"\nemulated bf16 (AVX2 kernels) vs fp32 on the model's matmuls: {slower:.0f}x slower")
    assert slower > 3  # measured 60-280x; emulation is never close to native speed


@pytest.mark.parametrize("name, bf16_tflops", [
    ("NVIDIA H100 80GB HBM3", 989.5), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.5),
    ("NVIDIA H200", 989.5), ("NVIDIA GH200 480GB", 989.5), ("NVIDIA A100-SXM4-80GB", 312.0),
    ("NVIDIA B200", 2250.0), ("NVIDIA GeForce RTX 4090", 165.2),
])
def test_gpu_names_resolve_to_their_data_sheet_peaks(monkeypatch, name, bf16_tflops):
    monkeypatch.setattr(hardware, "device_name", lambda device: name)
    peak = peak_flops(torch.device("cuda", 0), torch.bfloat16, [(8, 8, 8)])
    assert peak.flops == bf16_tflops * 1e12 and peak.cache is None


def test_unknown_devices_measure_their_peak_per_device_model(monkeypatch, tmp_path):
    monkeypatch.setenv("PLAIT_CACHE", str(tmp_path))
    shapes = [(64, 32, 48)]
    measured = peak_flops(torch.device("cpu"), torch.float32, shapes)
    assert measured.flops > 0 and measured.cache.exists() and measured.cache.parent == tmp_path
    monkeypatch.setattr(hardware, "device_name", lambda device: "Another CPU")
    assert peak_flops(torch.device("cpu"), torch.float32, shapes).cache != measured.cache


def test_mfu_above_one_is_not_reported_and_the_stale_peak_is_dropped(tmp_path, capsys):
    cache = tmp_path / "peak.json"
    cache.write_text("1e9")
    utilisation = Utilisation(flops_per_token=1e6, peak=Peak(1e9, "test", cache), devices=1)
    assert utilisation.mfu(1, tokens_per_sec=500) == 0.5
    assert utilisation.mfu(2, tokens_per_sec=2000) is None and not cache.exists()
    assert "measured too low" in capsys.readouterr().out
    assert utilisation.mfu(3, tokens_per_sec=500) is None  # the whole run's MFU shares one untrusted peak


IN_HEAP = """
import sys, torch
from plait import host_memory
retained = host_memory.configure(sys.argv[1], torch.device(sys.argv[2]))
def heap():
    line = next(line for line in open("/proc/self/maps") if line.rstrip().endswith("[heap]"))
    return [int(end, 16) for end in line.split()[0].split("-")]
activation = torch.empty(2**24)  # 64 MiB: glibc maps a block this large on its own by default
start, end = heap()
inside = start <= activation.data_ptr() < end
del activation  # freed at the heap's top: trimmed by default, kept when retained
print(retained, inside, heap()[1] == end)
"""


@pytest.mark.skipif(sys.platform != "linux" or os.confstr("CS_GNU_LIBC_VERSION") is None, reason="glibc's malloc")
@pytest.mark.parametrize("choice, device, retained", [("auto", "cpu", True), ("retain", "cuda", True),
                                                      ("release", "cpu", False), ("auto", "cuda", False)])
def test_host_memory_retain_serves_large_blocks_from_the_heap_and_keeps_them(choice, device, retained):
    """training.host_memory: retained, a 64 MiB block comes from the heap and stays there when
    freed, so the next step reuses its pages (the faults it saves are measured in
    docs/performance.md); released, glibc maps it on its own, outside the heap."""
    out = subprocess.run([sys.executable, "-c", IN_HEAP, choice, device], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout.split()
    assert out == [str(retained)] * 3 if retained else out[:2] == ["False", "False"]
