"""Seed checkpoints, exact resume (also across layouts), crash safety, bad checkpoints, HF interchange."""

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading

import pytest
import torch

from conftest import ROOT, TINY, descendants, environ, losses, max_abs_diff, run_plait

pytestmark = pytest.mark.slow
FP32 = ["--training.mixed_precision_param", "float32"]


def plait(*args, check=True):
    proc = subprocess.run([sys.executable, "-m", "plait", *args], capture_output=True, text=True, timeout=300, cwd=ROOT)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def seed_ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("seed") / "seed-5"
    plait("seed-checkpoint", *TINY, "--training.seed", "5", "--out", str(out))
    return out


def test_seed_checkpoint_starts_every_layout_identically(tmp_path, seed_ckpt):
    """The seed checkpoint holds exactly the seed-5 init, and replaces a run's own init (seed 0):
    every layout's step-1 loss equals the single process started from it — bitwise for data
    parallelism, within TP's fp32 reduction-order difference for TP."""
    from plait.checkpoint import load_full_state_dict, read_manifest
    from plait.model import ModelArgs, Transformer
    from plait.weights import init_weights

    args = ModelArgs(**read_manifest(seed_ckpt)["model_args"])
    model = Transformer(args)
    init_weights(model, seed=5)
    saved = load_full_state_dict(seed_ckpt, args)
    assert all(torch.equal(saved[name], value) for name, value in model.state_dict().items())

    load = ["--training.steps", "2", "--checkpoint.load", str(seed_ckpt), *FP32]
    # The single process accumulates the two rank slices of world 2 (see test_parity).
    reference, _ = run_plait(tmp_path, *load, "--training.micro_batch_size", "2")
    own_init, _ = run_plait(tmp_path, "--training.steps", "2", "--training.micro_batch_size", "2", *FP32)
    assert losses(own_init)[0] != losses(reference)[0]
    for world, layout in [(2, ["--parallelism.dp_replicate", "2"]), (2, ["--parallelism.dp_shard", "2"])]:
        rows, _ = run_plait(tmp_path, *load, *layout, nproc=world)
        assert losses(rows) == losses(reference), layout
    for world, layout in [(4, ["--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "2"]),
                          (2, ["--parallelism.tp", "2"])]:
        rows, _ = run_plait(tmp_path, *load, *layout, nproc=world)
        assert max_abs_diff(losses(rows), losses(reference)) <= 1e-6, layout


def _run_and_kill_after(args, step_line, nproc=1, only_rank=None):
    """Start `plait train`; once `step_line` is printed, SIGKILL rank `only_rank` (the others
    must then end by themselves) or, if None, the whole job."""
    command = [sys.executable, "-m", "plait", "train", "--nproc", str(nproc), *TINY, *args, "--metrics.log_interval", "1"]
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    watchdog = threading.Timer(180, os.killpg, (proc.pid, signal.SIGKILL))  # a hung job fails, not hangs, the test
    watchdog.start()
    try:
        for line in proc.stdout:
            if line.startswith(step_line):
                break
        else:
            raise AssertionError(f"the job ended or hung before printing {step_line!r}")
        if only_rank is not None:
            victim = [pid for pid in descendants(proc.pid) if f"\0RANK={only_rank}\0" in environ(pid)]
            assert len(victim) == 1, victim
            os.kill(victim[0], signal.SIGKILL)
            assert proc.wait(timeout=120) != 0
    finally:
        watchdog.cancel()
        with contextlib.suppress(ProcessLookupError):  # the job may already have ended by itself
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_kill_and_resume_is_bitwise_exact(tmp_path, precision):
    args = ["--training.steps", "10", "--checkpoint.interval", "5", "--training.mixed_precision_param", precision]
    full, _ = run_plait(tmp_path, *args, "--checkpoint.folder", str(tmp_path / "a"))
    _run_and_kill_after([*args, "--checkpoint.folder", str(tmp_path / "b")], "step     7")
    assert sorted(os.listdir(tmp_path / "b")) == ["step-5"]
    resumed, proc = run_plait(tmp_path, *args, "--checkpoint.folder", str(tmp_path / "b"))
    assert "resumed from" in proc.stdout and [r["step"] for r in resumed] == list(range(6, 11))
    assert losses(resumed) == losses(full)[5:]


def test_resume_under_another_layout(tmp_path):
    """Saved by FSDP2 at world 2, resumed (weights, AdamW state, data position) by a single
    process, TP2 and DDP2+TP2: steps 6-10 agree with the uninterrupted run within the fp32 layout
    tolerance (measured ~1e-6)."""
    args = ["--training.steps", "10", "--checkpoint.interval", "5", *FP32]
    full, _ = run_plait(tmp_path, *args, "--checkpoint.folder", str(tmp_path / "fsdp"), "--parallelism.dp_shard", "2",
                        nproc=2)
    for name, world, layout in [("single", 1, []), ("tp", 2, ["--parallelism.tp", "2"]),
                                ("ddp_tp", 4, ["--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "1",
                                               "--parallelism.tp", "2"])]:
        shutil.copytree(tmp_path / "fsdp" / "step-5", tmp_path / name / "step-5")
        resumed, _ = run_plait(tmp_path, *args, "--checkpoint.folder", str(tmp_path / name), *layout, nproc=world)
        diff = max_abs_diff(losses(resumed), losses(full)[5:])
        print(f"\nresumed under {name}: max |loss diff| vs uninterrupted FSDP2 {diff:.2e}")
        assert diff <= 1e-5


def test_kill_during_async_save_resumes_from_last_complete(tmp_path):
    folder = tmp_path / "ckpt"
    args = ["--training.steps", "200", "--checkpoint.interval", "2", "--checkpoint.async_mode", "async",
            "--checkpoint.folder", str(folder)]
    _run_and_kill_after(args, "step     9", nproc=2, only_rank=1)
    complete = sorted(int(p.name[5:]) for p in folder.iterdir() if (p / "plait.json").exists())
    assert complete and complete[-1] >= 4
    # Debris of a save that never completed, newer than anything complete: must be ignored.
    (folder / "step-150").mkdir()
    (folder / "step-150" / "__0_0.distcp").write_bytes(b"partial")
    rows, proc = run_plait(tmp_path, *args[:1], "202", *args[2:], nproc=2)
    assert f"resumed from {folder / f'step-{complete[-1]}'}" in proc.stdout
    assert rows[0]["step"] == complete[-1] + 1


def test_bad_checkpoints_fail_clearly_and_leave_good_ones_alone(tmp_path, seed_ckpt):
    # Another model shape (vocabulary 4096 vs the seed's 512).
    rows, proc = run_plait(tmp_path, "--checkpoint.load", str(seed_ckpt), "--data.vocab_size", "4096", check=False)
    assert proc.returncode == 2 and rows == [] and "holds another model" in proc.stderr and "vocab_size" in proc.stderr
    # Not a checkpoint at all.
    (tmp_path / "empty").mkdir()
    _, proc = run_plait(tmp_path, "--checkpoint.load", str(tmp_path / "empty"), check=False)
    assert proc.returncode == 2 and "has no plait.json" in proc.stderr
    # Corrupt shard data: a clear error, and the checkpoint is still there untouched.
    broken = tmp_path / "broken"
    shutil.copytree(seed_ckpt, broken)
    data_file = next(broken.glob("*.distcp"))
    data_file.write_bytes(data_file.read_bytes()[:1000])
    _, proc = run_plait(tmp_path, "--checkpoint.load", str(broken), check=False)
    assert proc.returncode == 2 and "loading" in proc.stderr.splitlines()[-1] and data_file.stat().st_size == 1000
    # seed-checkpoint never overwrites.
    proc = plait("seed-checkpoint", *TINY, "--out", str(seed_ckpt), check=False)
    assert proc.returncode == 2 and "refusing to overwrite" in proc.stderr


def test_hf_export_matches_transformers_and_imports_back_bitwise(tmp_path, seed_ckpt):
    transformers = pytest.importorskip("transformers")
    from plait.checkpoint import load_full_state_dict, read_manifest
    from plait.hf import load as load_hf
    from plait.model import ModelArgs, Transformer

    out = tmp_path / "hf"
    plait("export", "--checkpoint", str(seed_ckpt), "--out", str(out), "--dtype", "float32")
    args = ModelArgs(**read_manifest(seed_ckpt)["model_args"])
    ours = Transformer(args)
    ours.load_state_dict(load_full_state_dict(seed_ckpt, args))
    theirs = transformers.LlamaForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    tokens = torch.randint(0, args.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (ours(tokens) - theirs(tokens).logits).abs().max().item()
    print(f"\nplait vs transformers logits: max |diff| {diff:.2e}")
    assert diff <= 1e-5
    back = load_hf(out, args, "checkpoint.load")
    assert all(torch.equal(back[name], value) for name, value in ours.state_dict().items())
    # And as initial weights of a run: identical step-1 loss to starting from the seed checkpoint.
    from_hf, _ = run_plait(tmp_path, "--training.steps", "1", "--checkpoint.load", str(out), *FP32)
    from_seed, _ = run_plait(tmp_path, "--training.steps", "1", "--checkpoint.load", str(seed_ckpt), *FP32)
    assert losses(from_hf) == losses(from_seed)
