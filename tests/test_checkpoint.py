"""Seed checkpoints, exact resume (also across layouts), crash safety, bad checkpoints, HF interchange."""

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading

import pytest
import torch

from conftest import ROOT, TINY, descendants, environ, launch, losses, max_abs_diff, plait_forked, run_plait

pytestmark = pytest.mark.slow


def plait(*args, check=True):
    """`plait ARGS`; with `check`, a command whose results the test reads (forked: its imports done),
    else one whose refusal it reads, from a fresh process as a user's."""
    if check:
        proc = plait_forked(*args)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc
    return subprocess.run([sys.executable, "-m", "plait", *args], capture_output=True, text=True, timeout=300, cwd=ROOT)


@pytest.fixture(scope="module")
def seed_ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("seed") / "seed-5"
    plait("seed-checkpoint", *TINY, "--training.seed", "5", "--out", str(out))
    return out


def test_seed_checkpoint_starts_every_layout_identically(tmp_path, seed_ckpt):
    """The seed checkpoint holds exactly the seed-5 init, and replaces a run's own init (seed 0):
    every layout's step-1 loss equals the single process started from it — bitwise for data
    parallelism, within TP's fp32 reduction-order difference for TP."""
    from plait.checkpoint.offline import load_full_state_dict
    from plait.checkpoint.manifest import read_manifest
    from plait.models.args import ModelArgs
    from plait.models.transformer import Transformer
    from plait.models.weights import init_weights

    args = ModelArgs(**read_manifest(seed_ckpt)["model_args"])
    model = Transformer(args)
    init_weights(model, seed=5)
    saved = load_full_state_dict(seed_ckpt, args, "seed")
    assert all(torch.equal(saved[name], value) for name, value in model.state_dict().items())

    load = ["--training.steps", "2", "--checkpoint.load", str(seed_ckpt)]
    # The single process accumulates the two rank slices of world 2 (see test_parity).
    reference, _ = run_plait(tmp_path, *load, "--training.micro_batch_size", "2")
    own_init, _ = run_plait(tmp_path, "--training.steps", "2", "--training.micro_batch_size", "2")
    assert losses(own_init)[0] != losses(reference)[0]
    for world, layout in [(2, ["--parallelism.dp_replicate", "2"]), (2, ["--parallelism.dp_shard", "2"]),
                          (2, ["--parallelism.pp", "2"])]:
        rows, _ = run_plait(tmp_path, *load, *layout, nproc=world)
        assert losses(rows) == losses(reference), layout
    for world, layout in [(4, ["--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "2"]),
                          (2, ["--parallelism.tp", "2"])]:
        rows, _ = run_plait(tmp_path, *load, *layout, nproc=world)
        assert max_abs_diff(losses(rows), losses(reference)) <= 1e-6, layout


def _run_and_kill_after(args, step_line, nproc=1, only_rank=None):
    """Start `plait train`; once `step_line` ("step     N") is printed, SIGKILL rank `only_rank`
    (the others must then end by themselves) or, if None, the whole job, which halts at the start
    of step N + 1 (tests/inject: however late this reads the line, the job has saved nothing after
    step N)."""
    command = [sys.executable, "-m", "plait", "train", "--nproc", str(nproc), *TINY, *args, "--metrics.log_interval", "1"]
    env = os.environ if only_rank is not None else os.environ | {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "tests" / "inject"), os.environ.get("PYTHONPATH")])),
        "PLAIT_FAULT": f"halt:{int(step_line.split()[-1]) + 1}"}
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=env)
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
    metrics = tmp_path / "b.jsonl"  # shared by the killed run and its resumption
    _run_and_kill_after([*args, "--checkpoint.folder", str(tmp_path / "b"), "--metrics.jsonl", str(metrics)],
                        "step     7")
    assert sorted(os.listdir(tmp_path / "b")) == ["plait-job.json", "step-5"]
    # Step 6 is past the checkpoint: it is lost and will be trained (and logged) again.
    assert [r["step"] for r in map(json.loads, metrics.read_text().splitlines())][:6] == list(range(1, 7))
    resumed, proc = run_plait(tmp_path, *args, "--checkpoint.folder", str(tmp_path / "b"), metrics=metrics)
    assert "resumed from" in proc.stdout
    # One row per step: the resumed run replaced the rows of the steps the kill lost (6, 7, ...).
    assert [r["step"] for r in resumed] == list(range(1, 11))
    assert losses(resumed) == losses(full)


def test_resume_takes_this_runs_lr_and_weight_decay(tmp_path):
    """Changed on resume, training.lr and weight_decay take effect like steps and warmup_steps do
    (they used to come back from the checkpoint silently): the logged lr is the new schedule's."""
    from plait.arguments import parse_args
    from plait.optim.schedule import factor as lr_factor

    folder = ["--checkpoint.folder", str(tmp_path / "ckpt"), "--checkpoint.interval", "3"]
    run_plait(tmp_path, "--training.steps", "3", *folder)
    new = ["--training.steps", "6", "--training.lr", "5e-4", "--training.weight_decay", "0.05", "--training.max_norm", "2"]
    resumed, proc = run_plait(tmp_path, *new, *folder)
    assert "resuming with training.lr 0.002 -> 0.0005, training.weight_decay 0.1 -> 0.05, training.max_norm 1 -> 2" \
        in proc.stdout
    factor = lr_factor(parse_args([*TINY, *new]))
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert [r["lr"] for r in resumed] == [5e-4 * factor(step - 1) for step in (4, 5, 6)]


STEP_GROUPS = '''
# Every rank appends, before each optimizer step, the options of every param group it steps with.
import json, os

if os.environ.get("PLAIT_TEST_GROUPS"):
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    def record(optimizer, args, kwargs):
        with open(f"{os.environ['PLAIT_TEST_GROUPS']}.{os.environ.get('RANK', '0')}", "a") as out:
            out.write(json.dumps([{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]) + "\\n")

    register_optimizer_step_pre_hook(record)
'''


def test_resume_steps_every_rank_with_this_runs_optimizer_options(tmp_path):
    """Resumed with other betas, eps and warmup, every rank (both pipeline stages: DCP keeps
    param-group values of rank 0's only) steps with this run's options, as a sitecustomize sees
    them before each optimizer step, and the start-up names each change."""
    folder = ["--parallelism.pp", "2", "--checkpoint.folder", str(tmp_path / "c"), "--checkpoint.interval", "2"]
    run_plait(tmp_path, "--training.steps", "2", *folder, nproc=2)
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(STEP_GROUPS)
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path / "site"), os.environ.get("PYTHONPATH")])),
           "PLAIT_TEST_GROUPS": str(tmp_path / "groups")}
    new = ["--training.steps", "4", "--optimizer.betas", "0.5", "0.6", "--optimizer.eps", "1e-3",
           "--training.warmup_steps", "1"]
    proc = launch(["train", *TINY, *new, *folder, "--metrics.jsonl", str(tmp_path / "m.jsonl")], 2, 300, env=env,
                  forked=True)  # (its sitecustomize registers a global hook: after the fork server's imports too)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lrs = [json.loads(line)["lr"] for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    for rank in (0, 1):
        # The last records are the resumed steps' (DCP first steps once at lr 0: the state it loads into).
        steps = [json.loads(line) for line in (tmp_path / f"groups.{rank}").read_text().splitlines()][-len(lrs):]
        seen = [[(g["betas"], g["eps"], g["weight_decay"], g["lr"]) for g in groups] for groups in steps]
        assert seen == [[([0.5, 0.6], 1e-3, 0.1, lr), ([0.5, 0.6], 1e-3, 0.0, lr)] for lr in lrs], (rank, seen)
    assert ("resuming with training.steps 2 -> 4, training.warmup_steps 2 -> 1, optimizer.betas (0.9, 0.95) -> "
            "(0.5, 0.6), optimizer.eps 1e-08 -> 0.001 (this run's options") in proc.stdout, proc.stdout


def test_pipeline_checkpoints_resume_bitwise_under_pp_and_without(tmp_path):
    """PP2 killed after step 7 resumes from step 5 bitwise; its step-5 checkpoint (stage shards
    under the whole model's names) also resumes a single process accumulating the same two
    micro-batches, bitwise: PP2 and that single device compute the same (tests/test_parity.py)."""
    args = ["--training.steps", "10", "--checkpoint.interval", "5"]
    pp = ["--parallelism.pp", "2"]
    full, _ = run_plait(tmp_path, *args, *pp, "--checkpoint.folder", str(tmp_path / "full"), nproc=2)
    _run_and_kill_after([*args, *pp, "--checkpoint.folder", str(tmp_path / "pp")], "step     7", nproc=2)
    assert sorted(os.listdir(tmp_path / "pp")) == ["plait-job.json", "step-5"]
    shutil.copytree(tmp_path / "pp", tmp_path / "single")
    resumed, proc = run_plait(tmp_path, *args, *pp, "--checkpoint.folder", str(tmp_path / "pp"), nproc=2)
    assert "resumed from" in proc.stdout and losses(resumed) == losses(full)[5:]
    single, _ = run_plait(tmp_path, *args, "--training.micro_batch_size", "2", "--checkpoint.folder",
                          str(tmp_path / "single"))
    assert losses(single) == losses(full)[5:]


def test_two_jobs_cannot_share_a_checkpoint_folder(tmp_path):
    """Another seed or another corpus is another job: it is refused before it touches the folder
    (it would have deleted saves in flight as debris, pruned, or resumed the other's state).
    The owner itself resumes, also with another layout or more steps."""
    folder = tmp_path / "ckpt"
    ckpt = ["--checkpoint.folder", str(folder), "--checkpoint.interval", "2"]
    run_plait(tmp_path, "--training.steps", "4", *ckpt)
    before = sorted((p.name, p.stat().st_mtime_ns) for p in folder.rglob("*"))
    corpus = tmp_path / "other.txt"
    corpus.write_text("another corpus, another job. " * 3000)
    for other, named in [(["--training.seed", "1"], "training.seed 0 vs 1"),
                         (["--data.path", str(corpus)], "tokens_sha256"),
                         # another model: each field that differs, with both values (issue 62)
                         (["--model.n_layers", "3"], "(model n_layers 2 vs 3 in this run)")]:
        rows, proc = run_plait(tmp_path, "--training.steps", "6", *ckpt, *other, check=False)
        message = proc.stderr.strip().splitlines()[-1]
        assert proc.returncode == 2 and rows == [] and "belongs to another job" in message and named in message
    assert sorted((p.name, p.stat().st_mtime_ns) for p in folder.rglob("*")) == before
    rows, proc = run_plait(tmp_path, "--training.steps", "6", *ckpt, "--parallelism.dp_shard", "2", nproc=2)
    assert "resumed from" in proc.stdout and [r["step"] for r in rows] == [5, 6]


def test_resume_under_another_layout(tmp_path):
    """Saved by FSDP2 at world 2, resumed (weights, AdamW state, data position) by a single
    process, TP2, DDP2+TP2 and PP2+FSDP2: steps 6-10 agree with the uninterrupted run within the fp32 layout
    tolerance (measured ~1e-6). Their step-10 checkpoints are then merged (merge_of_three_layouts)."""
    args = ["--training.steps", "10", "--checkpoint.interval", "5"]
    full, _ = run_plait(tmp_path, *args, "--checkpoint.folder", str(tmp_path / "fsdp"), "--parallelism.dp_shard", "2",
                        nproc=2)
    for name, world, layout in [("single", 1, []), ("tp", 2, ["--parallelism.tp", "2"]),
                                ("ddp_tp", 4, ["--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "1",
                                               "--parallelism.tp", "2"]),
                                ("pp_fsdp2", 4, ["--parallelism.pp", "2", "--parallelism.dp_shard", "2"])]:
        shutil.copytree(tmp_path / "fsdp" / "step-5", tmp_path / name / "step-5")
        resumed, _ = run_plait(tmp_path, *args, "--checkpoint.folder", str(tmp_path / name), *layout, nproc=world)
        diff = max_abs_diff(losses(resumed), losses(full)[5:])
        print(f"\nresumed under {name}: max |loss diff| vs uninterrupted FSDP2 {diff:.2e}")
        assert diff <= 1e-5
    merge_of_three_layouts(tmp_path, [tmp_path / name / "step-10" for name in ("fsdp", "tp", "single")])


def merge_of_three_layouts(tmp_path, folders):
    """`plait merge` of step 10 as saved by FSDP2 (world 2), TP2 and one device: bitwise the mean of
    their weights loaded on one device (float64, rounded once), as is a weighted merge; the merge
    loads and starts a run; a merge with another model is refused in one line."""
    from plait.checkpoint.offline import load_full_state_dict
    from plait.checkpoint.manifest import manifest_model, read_manifest
    from plait.cli import main
    from plait.config import ConfigError

    args = manifest_model(read_manifest(folders[0]), folders[0], "checkpoint")
    states = [load_full_state_dict(folder, args, "checkpoint") for folder in folders]
    for weights in ([], ["1", "2", "5"]):
        out = tmp_path / f"merged{len(weights)}"
        assert main(["merge", *map(str, folders), "--out", str(out), *(["--weights", *weights] if weights else [])]) == 0
        share = [float(w) / 8.0 for w in weights] if weights else [1 / 3] * 3  # (1 + 2 + 5 = 8)
        merged = load_full_state_dict(out, args, "checkpoint")
        for name, tensor in merged.items():
            mean = sum((state[name].double() * w for state, w in zip(states, share)), torch.zeros((), dtype=torch.float64))
            assert tensor.equal(mean.float()), name
        assert any(not merged[name].equal(states[0][name]) for name in merged)  # (they differ: a mean was taken)
    rows, _ = run_plait(tmp_path, "--training.steps", "1", "--checkpoint.load", str(tmp_path / "merged0"))
    assert len(rows) == 1
    other = tmp_path / "other"
    assert main(["seed-checkpoint", *TINY, "--model.n_layers", "1", "--out", str(other)]) == 0
    with pytest.raises(ConfigError, match=r"^checkpoints: .*other holds another model than .* \(n_layers "):
        from plait.checkpoint.merge import main as merge_main

        merge_main([str(folders[0]), str(other), "--out", str(tmp_path / "never")])


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
    rows, proc = run_plait(tmp_path, *args[:1], str(complete[-1] + 2), *args[2:], nproc=2)  # two steps more
    assert f"resumed from {folder / f'step-{complete[-1]}'}" in proc.stdout
    assert rows[0]["step"] == complete[-1] + 1


def test_a_failing_run_completes_the_async_save_in_flight(tmp_path):
    """The loss turns non-finite at step 2 while step 1's save is being written in the background:
    the run stops, and step-1 is complete (DCP metadata and manifest), ready to resume from."""
    folder = tmp_path / "ckpt"
    rows, proc = run_plait(tmp_path, "--training.steps", "30", "--training.lr", "1e12", "--training.warmup_steps", "0",
                           "--training.max_norm", "0", "--checkpoint.interval", "1", "--checkpoint.async_mode", "async",
                           "--checkpoint.folder", str(folder), check=False)
    assert proc.returncode == 1 and "not finite" in proc.stderr
    last_good = len(rows)
    assert last_good >= 1 and f"weights are from step {last_good}" in proc.stderr
    assert (folder / f"step-{last_good}" / ".metadata").exists() and (folder / f"step-{last_good}" / "plait.json").exists()


# Staging (the copy of the state that a background save writes) made late on purpose: training
# goes on meanwhile and must not change the parameters or AdamW state under the copy.
SLOW_STAGING = """
import sys, time
from torch.distributed.checkpoint.staging import DefaultStager
stage = DefaultStager._stage
def slow_stage(self, state_dict, **kwargs):
    time.sleep(1)
    return stage(self, state_dict, **kwargs)
DefaultStager._stage = slow_stage
from plait.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_async_save_with_slow_staging_equals_sync_save_bitwise(tmp_path):
    import torch.distributed.checkpoint as dcp

    args = [*TINY, "--training.steps", "6", "--checkpoint.interval", "2", "--metrics.log_interval", "1"]
    for mode in ("disabled", "async"):
        proc = subprocess.run([sys.executable, "-c", SLOW_STAGING, "train", *args, "--checkpoint.async_mode", mode,
                               "--checkpoint.folder", str(tmp_path / mode)], capture_output=True, text=True, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr[-3000:]
    for step in (2, 4, 6):
        states = []
        for mode in ("disabled", "async"):
            folder = tmp_path / mode / f"step-{step}"
            metadata = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
            state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in metadata.items()
                     if hasattr(m, "size") and len(m.size)}  # weights and AdamW moments
            dcp.load(state, checkpoint_id=str(folder), no_dist=True)
            states.append(state)
        assert states[0].keys() == states[1].keys() and len(states[0]) > 40
        torn = [k for k in states[0] if not torch.equal(states[0][k], states[1][k])]
        assert not torn, f"step {step}: {torn[:3]}"


def test_bad_checkpoints_fail_clearly_and_leave_good_ones_alone(tmp_path, seed_ckpt):
    # Another model shape asked for (the checkpoint's model is the run's unless an option says otherwise).
    rows, proc = run_plait(tmp_path, "--checkpoint.load", str(seed_ckpt), "--model.n_layers", "3", check=False)
    assert proc.returncode == 2 and rows == [] and proc.stderr.strip().splitlines() == [
        f"plait: error: model.n_layers: 3, but {seed_ckpt} has 2 blocks; allowed: 0 or 2"]
    # Not a checkpoint at all.
    (tmp_path / "empty").mkdir()
    _, proc = run_plait(tmp_path, "--checkpoint.load", str(tmp_path / "empty"), check=False)
    assert proc.returncode == 2 and "has no plait.json" in proc.stderr
    # Truncated shard data: one line before any process group, and the checkpoint is still there untouched.
    broken = tmp_path / "broken"
    shutil.copytree(seed_ckpt, broken)
    data_file = next(broken.glob("*.distcp"))
    data_file.write_bytes(data_file.read_bytes()[:1000])
    _, proc = run_plait(tmp_path, "--checkpoint.load", str(broken), check=False)
    assert proc.returncode == 2 and data_file.stat().st_size == 1000
    assert proc.stderr.strip().splitlines()[-1].startswith(f"plait: error: checkpoint.load: {data_file} is truncated "
                                                           "(1000 bytes), its checkpoint's metadata needs ")
    # One flipped bit: found by its digest before any weight is read, in one line.
    flipped = tmp_path / "flipped"
    shutil.copytree(seed_ckpt, flipped)
    data_file = next(flipped.glob("*.distcp"))
    data = bytearray(data_file.read_bytes())
    data[-1] ^= 0x80
    data_file.write_bytes(bytes(data))
    _, proc = run_plait(tmp_path, "--checkpoint.load", str(flipped), check=False)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"plait: error: checkpoint.load: {data_file} does not match the sha256 its manifest recorded at save time: "
        f"the checkpoint is damaged; move {flipped} away to resume from the one before it"]
    # seed-checkpoint never overwrites.
    proc = plait("seed-checkpoint", *TINY, "--out", str(seed_ckpt), check=False)
    assert proc.returncode == 2 and "refusing to overwrite" in proc.stderr


def test_a_manifest_naming_files_outside_its_folder_is_refused(tmp_path, seed_ckpt):
    """The digests' names come from disk: a device (which never ends: `generate` hung hashing it), an
    absolute or ../ path, a folder or a link are refused in one line, by every command that reads a
    checkpoint, before anything is hashed."""
    from plait.checkpoint.manifest import check_compatible, read_manifest, saved_model
    from plait.config import ConfigError
    from plait.models.args import ModelArgs

    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"not the checkpoint's")
    cases = {"/dev/zero": None, "../outside.bin": None, str(outside): None, "sub/x": None, ".": None,
             "link": lambda f: (f / "link").symlink_to(outside), "folder": lambda f: (f / "folder").mkdir()}
    for i, (name, make) in enumerate(cases.items()):
        forged = tmp_path / f"forged-{i}"
        shutil.copytree(seed_ckpt, forged)
        if make:
            make(forged)
        manifest = read_manifest(forged)
        manifest["digests"][name] = "0" * 64
        (forged / "plait.json").write_text(json.dumps(manifest))
        with pytest.raises(ConfigError, match=re.escape(f"checkpoint: {forged}: its manifest names {name!r}, which is not a")):
            check_compatible(forged, ModelArgs(**saved_model(manifest, forged, "checkpoint")), "checkpoint")
    # Through the CLI: one line and exit 2, promptly (today's main hung here reading /dev/zero).
    proc = subprocess.run([sys.executable, "-m", "plait", "generate", "--checkpoint", str(tmp_path / "forged-0"),
                           "--prompt", "a", "--max_new_tokens", "2"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"plait: error: checkpoint: {tmp_path / 'forged-0'}: its manifest names '/dev/zero', which is not a file "
        f"name inside the folder; the checkpoint is damaged; move {tmp_path / 'forged-0'} away to resume from the one "
        "before it"]


def test_dcp_metadata_naming_a_link_is_refused_as_the_manifest_is(tmp_path, seed_ckpt):
    """DCP metadata's file names follow the manifest's rule (plait/file_names.py): a link to a file
    outside the folder is refused before anything is read through it."""
    import dataclasses
    import pickle

    from plait.checkpoint.manifest import check_compatible, read_manifest
    from plait.checkpoint.safe_dcp import read_metadata
    from plait.config import ConfigError
    from plait.models.args import ModelArgs

    forged = tmp_path / "forged"
    shutil.copytree(seed_ckpt, forged)
    outside = tmp_path / "outside.distcp"
    shutil.copy(next(forged.glob("*.distcp")), outside)
    (forged / "link").symlink_to(outside)
    metadata = read_metadata(forged)
    metadata.storage_data = {k: dataclasses.replace(v, relative_path="link") for k, v in metadata.storage_data.items()}
    (forged / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(ConfigError, match=re.escape(f"checkpoint: {forged}'s DCP metadata names 'link', which is not a "
                                                    "plain file (a link, a device or a folder)")):
        check_compatible(forged, ModelArgs(**read_manifest(forged)["model_args"]), "checkpoint")


def test_a_manifest_from_a_newer_plait_is_one_line_naming_its_unknown_field(tmp_path, seed_ckpt):
    """A field a newer plait added to model_args (what an older plait meets in a newer checkpoint)
    is named in one line, with the version that wrote it, by every reader of a manifest: load and
    resume, generate, eval, export, and a job folder's owner file."""
    from plait.checkpoint.manifest import OWNER, check_compatible, check_owner, read_manifest
    from plait.config import ConfigError
    from plait.generate import load
    from plait.hf.export import export_checkpoint
    from plait.models.args import ModelArgs

    newer = tmp_path / "newer"
    shutil.copytree(seed_ckpt, newer)
    manifest = read_manifest(newer)
    args = ModelArgs(**manifest["model_args"])
    manifest["model_args"]["future_field"] = 1
    manifest["plait"] = "99.0"
    (newer / "plait.json").write_text(json.dumps(manifest))
    said = re.escape(f"checkpoint: {newer} records the model field(s) future_field, which this plait (") + r"[^)]+" + \
        re.escape(") does not know: the checkpoint was written by a newer plait (99.0); upgrade plait to read it")
    for reader in (lambda: check_compatible(newer, args, "checkpoint"), lambda: load(newer),
                   lambda: export_checkpoint(newer, tmp_path / "out", torch.float32, 2**30)):
        with pytest.raises(ConfigError, match=f"^{said}$"):
            reader()
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / OWNER).write_text(json.dumps({"model_args": manifest["model_args"]}))
    with pytest.raises(ConfigError, match=re.escape(f"checkpoint.folder: {tmp_path / 'job' / OWNER} records the model "
                                                    "field(s) future_field")):
        check_owner(str(tmp_path / "job"), {})


def test_hf_export_matches_transformers_and_imports_back_bitwise(tmp_path, seed_ckpt):
    transformers = pytest.importorskip("transformers")
    from plait.checkpoint.offline import load_full_state_dict
    from plait.checkpoint.manifest import read_manifest
    from plait.hf import HFWeights
    from plait.models.args import ModelArgs
    from plait.models.transformer import Transformer

    out = tmp_path / "hf"
    plait("export", "--checkpoint", str(seed_ckpt), "--out", str(out), "--dtype", "float32")
    args = ModelArgs(**read_manifest(seed_ckpt)["model_args"])
    ours = Transformer(args)
    ours.load_state_dict(load_full_state_dict(seed_ckpt, args, "seed"))
    theirs = transformers.LlamaForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    tokens = torch.randint(0, args.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (ours(tokens) - theirs(tokens).logits).abs().max().item()
    print(f"\nplait vs transformers logits: max |diff| {diff:.2e}")
    assert diff <= 1e-5
    back = HFWeights(out, args, "checkpoint.load")
    assert all(torch.equal(back[name], value) for name, value in ours.state_dict().items())
    # And as initial weights of a run: identical step-1 loss to starting from the seed checkpoint.
    from_hf, _ = run_plait(tmp_path, "--training.steps", "1", "--checkpoint.load", str(out))
    from_seed, _ = run_plait(tmp_path, "--training.steps", "1", "--checkpoint.load", str(seed_ckpt))
    assert losses(from_hf) == losses(from_seed)


def test_hf_folders_that_compute_differently_are_refused(tmp_path, seed_ckpt):
    """Same shape is not same model: Llama 3.1 8B's scaled RoPE taken for llama3_8b would run
    with the wrong frequencies. Checked against the run's model with one line naming the field;
    a config.json whose biases the weights lack is refused naming them."""
    from plait.checkpoint.manifest import read_manifest
    from plait.config import ConfigError
    from plait.hf import check
    from plait.models.args import ModelArgs

    out = tmp_path / "hf"
    plait("export", "--checkpoint", str(seed_ckpt), "--out", str(out), "--dtype", "float32")
    exported = json.loads((out / "config.json").read_text())
    args = ModelArgs(**read_manifest(seed_ckpt)["model_args"])
    check(out, args, "checkpoint.load")  # as exported: the same model
    for change, named in HF_MATH_CHANGES:
        config = {k: v for k, v in {**exported, **change}.items() if v is not None}
        (out / "config.json").write_text(json.dumps(config))
        with pytest.raises(ConfigError, match="holds another model") as refused:
            check(out, args, "checkpoint.load")
        assert named in str(refused.value)
    # End to end, with the flavor given: the flavor and the folder disagree, in one line.
    rows, proc = run_plait(tmp_path, "--checkpoint.load", str(out), "--model.flavor", "debug", check=False)
    assert proc.returncode == 2 and rows == [] and proc.stderr.strip().splitlines() == [
        f"plait: error: model.flavor: debug is not the model of {out} (rope_theta 10000.0 vs 500000.0 in its "
        "config.json); leave model.flavor out to train the folder's model"]
    # A config.json that promises biases its weights do not hold.
    (out / "config.json").write_text(json.dumps({**exported, "attention_bias": True}))
    rows, proc = run_plait(tmp_path, "--checkpoint.load", str(out), check=False)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"plait: error: checkpoint.load: {out} lacks ['model.layers.0.self_attn.q_proj.bias', "
        "'model.layers.0.self_attn.k_proj.bias', 'model.layers.0.self_attn.v_proj.bias'] ..."]


HF_MATH_CHANGES = [  # (config.json fields changed, the words that must name it); the last stays for the run
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192}}, "rope_scaling {'rope_type': 'llama3'"),
    ({"rope_theta": None, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "linear", "factor": 2.0}},
     "rope_scaling {'rope_type': 'linear', 'factor': 2.0} vs None"),
    ({"rms_norm_eps": 1e-6}, "norm_eps 1e-06 vs 1e-05"),
    ({"tie_word_embeddings": True}, "tie_embeddings True vs False"),
    ({"head_dim": 16}, "head_dim 16 vs 32"),
    ({"attention_bias": True}, "qkv_bias True vs False, out_bias True vs False"),
    ({"model_type": "qwen3"}, "family qwen3 vs llama, qk_norm head vs none"),
    ({"rope_theta": None, "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}},
     "rope_theta 500000.0 vs 10000.0"),
]


def test_a_checkpoint_folder_cannot_run_code(tmp_path):
    """DCP keeps its metadata as a pickle and loads non-tensor values with a full unpickler: a
    downloaded folder with a real plait.json (digests matching) and a crafted file would run code
    under generate, export, --checkpoint.load or a resume. Each is one line naming what the file
    asked for, and the payload never runs."""
    import hashlib
    import pickle

    from plait.checkpoint.safe_dcp import read_metadata

    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    def forge(folder, name, data):
        (folder / name).write_bytes(data)
        manifest = json.loads((folder / "plait.json").read_text())
        manifest["digests"][name] = hashlib.sha256(data).hexdigest()
        (folder / "plait.json").write_text(json.dumps(manifest))

    run_plait(tmp_path, "--training.steps", "2", "--checkpoint.folder", str(tmp_path / "c"), "--checkpoint.interval", "2")
    step = tmp_path / "c" / "step-2"
    evil = tmp_path / "evil"
    shutil.copytree(step, evil)
    forge(evil, ".metadata", pickle.dumps(Payload()))
    refused = "is unreadable: its .metadata asks to build posix.system, which is not part of DCP metadata"
    for command in (["generate", "--checkpoint", str(evil), "--prompt", "x"],
                    ["export", "--checkpoint", str(evil), "--out", str(tmp_path / "out")],
                    ["train", *TINY, "--training.steps", "1", "--checkpoint.load", str(evil)]):
        proc = plait(*command, check=False)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and refused in proc.stderr, \
            proc.stderr[-2000:]
    # A param-group value (loaded as bytes, not as a tensor) replaced by the payload, in place.
    [info] = [v for k, v in read_metadata(step).storage_data.items() if k.fqn == "optimizer.param_groups.0.lr"]
    payload = pickle.dumps(Payload(), protocol=2)
    data = bytearray((step / info.relative_path).read_bytes())
    assert len(payload) <= info.length
    data[info.offset:info.offset + len(payload)] = payload
    forge(step, info.relative_path, bytes(data))
    _, proc = run_plait(tmp_path, "--training.steps", "4", "--checkpoint.folder", str(tmp_path / "c"), check=False)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"plait: error: checkpoint: loading {step} failed: optimizer.param_groups.0.lr is not checkpoint data (Trying "
        "to load unsupported GLOBAL posix.system whose module posix is blocked); refused, nothing from it was run"]
    assert not marker.exists()


STALE_VIEW = '''
# Rank 1 sees checkpoint.folder as a stale NFS client cache can: without its newest checkpoint.
import os
import re

if os.environ.get("RANK") == "1":
    import sys

    from plait.checkpoint import manifest  # before plait imports its latest_complete by name

    def stale(root, seen=manifest.latest_complete):
        newest = seen(root)
        older = [p for p in newest.parent.glob("step-*") if p != newest] if newest else []
        print(f"rank 1 sees {newest} as missing", file=sys.stderr)  # the test knows the fault was on
        return max(older, key=lambda p: int(p.name.removeprefix("step-")), default=None)

    manifest.latest_complete = stale
'''


def test_every_rank_resumes_the_checkpoint_rank_0_chose(tmp_path, monkeypatch):
    """On a shared filesystem a rank can miss the newest checkpoint (rank 1 here, by a
    sitecustomize): it resumes rank 0's choice all the same, and the run equals the straight one."""
    folder = ["--checkpoint.folder", str(tmp_path / "c"), "--checkpoint.interval", "2", "--parallelism.dp_shard", "2"]
    straight, _ = run_plait(tmp_path, "--training.steps", "6", *folder, nproc=2)
    shutil.rmtree(tmp_path / "c" / "step-6")
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(STALE_VIEW)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path / "site"), os.environ.get("PYTHONPATH")])))
    resumed, proc = run_plait(tmp_path, "--training.steps", "6", *folder, "--comm.timeout_seconds", "30", nproc=2,
                              check=False, timeout=180, forked=False)  # (fresh: it patches before plait's imports)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"rank 1 sees {tmp_path / 'c' / 'step-4'} as missing" in proc.stderr  # and would resume step 2
    assert f"resumed from {tmp_path / 'c' / 'step-4'}" in proc.stdout
    assert [r["step"] for r in resumed] == [5, 6] and losses(resumed) == losses(straight)[4:]
