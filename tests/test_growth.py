"""A run that grows (plait/data/batch_schedule.py): the batch ramps up, the sequence length warms
up; and a run in phases (plait/data/phases.py). Proven: each step's shape is what the options say
and the layout allows; a ramp draws the data stream a fixed batch draws, a warm-up the very tokens
the run without one trains on; a ramped run equals, bitwise, the fixed-batch jobs it is made of
run one after another from each other's checkpoints; a warm-up under context parallelism and the
document mask equals one device within the parity matrix's cp bound, and resumes mid-warm-up
bitwise; a phase draws from its mixture (binomial bounds), decays the lr its way, and a phased run
resumed before or inside a phase, or given its phase only when resumed, is the uninterrupted run."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from conftest import run_plait, validation_text
from plait.arguments import parse_args
from plait.checks import check_options
from plait.config import ConfigError
from plait.data import BatchLoader
from plait.data.batch_schedule import BatchSchedule, batch_schedule
from plait.data.phases import Phases
from plait.optim.schedule import factor


class Counting:
    """A token stream where token t = first + t: every token read tells where it was read."""

    def __init__(self, tokens: int, first: int = 0):
        self.tokens = np.arange(first, first + tokens, dtype=np.int64)

    def __len__(self):
        return len(self.tokens)

    def read(self, start, count):
        return self.tokens[start:start + count]


def job(*options: str, world: int = 2):
    return check_options(parse_args(["--training.seq_len", "64", "--training.global_batch_size", "16", *options]),
                         world)


def test_each_step_s_shape_follows_the_tokens_before_it_in_steps_the_layout_allows():
    cfg = job("--training.micro_batch_size", "2", "--training.batch_rampup", "4", "100000",
              "--training.seq_len_warmup", "8", "50000", "--parallelism.cp", "2", "--parallelism.dp_shard", "1")
    schedule = batch_schedule(cfg)  # lengths: the divisors of 64 that split into 2 x cp chunks
    shapes = [schedule.shape(step) for step in range(1, 400)]
    assert [s.rows for s in shapes[:3]] == [4, 4, 4] and shapes[-1].rows == 16 and shapes[-1].length == 64
    for step, shape in enumerate(shapes, 1):
        before = schedule.tokens_before(step)
        assert before == sum(s.tokens for s in shapes[:step - 1])
        assert shape.rows == (16 if before >= 100000 else (4 + 12 * before // 100000) // 4 * 4)
        assert shape.length == (64 if before >= 50000 else max(n for n in (8, 16, 32, 64)
                                                                 if n <= 8 + 56 * before // 50000))
        assert shape.sequences * shape.length == shape.tokens == shape.rows * 64
    assert [s.rows for s in shapes] == sorted(s.rows for s in shapes)
    assert schedule.tokens_before(1000) == schedule.tokens_before(400) + 600 * 16 * 64  # full steps after


@pytest.mark.parametrize("options, message", [
    (["--training.batch_rampup", "3", "1000"], "batch_rampup: a start batch of 3 sequences; allowed: a multiple "
                                               "of micro_batch_size x dp degree = 16"),
    (["--training.batch_rampup", "4", "0"], "batch_rampup: START TOKENS, both > 0"),
    (["--training.seq_len_warmup", "24", "1000"], r"seq_len_warmup: a start length of 24 tokens; allowed: .*\[1, "
                                                  r"2, 4, 8, 16, 32\]"),
    (["--training.seq_len_warmup", "2", "1000", "--parallelism.cp", "2", "--parallelism.dp_shard", "1"],
     r"seq_len_warmup: .*allowed: .*\[4, 8, 16, 32\]"),
    (["--training.batch_rampup", "8", "1000", "--parallelism.pp", "2", "--parallelism.dp_shard", "1"],
     "batch_rampup: not with parallelism.pp > 1")])
def test_a_schedule_the_layout_cannot_run_is_one_line(options, message):
    with pytest.raises(ConfigError, match=f"^training.{message}"):
        job(*options)


def test_a_ramp_draws_the_stream_a_fixed_batch_draws_and_a_warm_up_the_same_tokens_cut_shorter():
    source = Counting(64 * 300 + 1)
    grown = BatchSchedule(64, 16, rampup=(4, 4096))
    fixed = BatchLoader([source], [1.0], 64, 4, 2, 0, 1, seed=3)  # dp 1, micro 2: the stream in draw order
    ramped = BatchLoader([source], [1.0], 64, 16, 2, 0, 1, seed=3, schedule=grown)
    drawn = [torch.cat([x for x, _ in ramped.next_batches()]) for _ in range(8)]
    assert [len(rows) for rows in drawn] == [grown.shape(k).rows for k in range(1, 9)] != [16] * 8
    stream = torch.cat([x for _ in range(sum(map(len, drawn)) // 4) for x, _ in fixed.next_batches()])
    assert torch.equal(torch.cat(drawn), stream)

    warm = BatchSchedule(64, 16, warmup=(8, 4096), lengths=(8, 16, 32, 64))
    for rank in (0, 1):  # dp 2, two sources: the mixture's draws and each rank's share as without a warm-up
        plain = BatchLoader([source, Counting(64 * 50 + 1)], [0.7, 0.3], 64, 16, 2, rank, 2, seed=3)
        warmed = BatchLoader([source, Counting(64 * 50 + 1)], [0.7, 0.3], 64, 16, 2, rank, 2, seed=3, schedule=warm)
        for step in range(1, 7):
            length, cut = warm.shape(step).length, warmed.next_batches()
            assert all(x.shape == (2 * 64 // length, length) for x, _ in cut)
            for (x, y), (pieces, labels) in zip(plain.next_batches(), cut, strict=True):
                assert torch.equal(pieces.reshape(x.shape), x) and torch.equal(labels.reshape(y.shape), y)


def test_under_a_ramp_the_lr_schedule_counts_tokens():
    steady = job("--training.lr_schedule", "wsd", "--training.steps", "40", "--training.warmup_steps", "4")
    ramped = job("--training.lr_schedule", "wsd", "--training.steps", "40", "--training.warmup_steps", "4",
                 "--training.micro_batch_size", "2", "--training.batch_rampup", "4", "8192")
    schedule, full = batch_schedule(ramped), 16 * 64
    assert [schedule.shape(k).rows for k in (1, 2, 3)] == [4, 4, 4]
    at, steady_at = factor(ramped), factor(steady)
    assert at(0) == 0.25 / 4 and at(2) == 0.75 / 4  # a quarter of a full step's tokens each: warmup's quarters
    total = schedule.tokens_before(41) / full
    for done in range(40):  # the stable phase and the decay: where the tokens put the run, as steps put it
        position = schedule.tokens_before(done + 2) / full
        if position > 4:
            stable = total - max(1, round(0.2 * total))
            expected = 1.0 if position <= stable else 1 - 0.9 * min(1.0, (position - stable) / (total - stable))
            assert at(done) == expected, done
    assert [steady_at(done) for done in (0, 3, 31, 39)] == pytest.approx([0.25, 1, 1, 0.1])  # no ramp: by steps


FIXED = ["--training.global_batch_size", "16", "--training.micro_batch_size", "2", "--parallelism.dp_shard", "2",
         "--training.lr_schedule", "constant", "--training.warmup_steps", "0"]


def test_a_ramped_run_equals_the_fixed_batch_jobs_it_is_made_of(tmp_path):
    """Batches 4, 4, 8, 12, 16, 16 (ramp 4 -> 16 over 1,536 tokens of 64-token sequences) against
    four jobs of one folder, each resumed from the one before with its batch: bitwise (the data
    stream goes on where the last job stopped, and the constant lr is the same in both)."""
    ramped, proc = run_plait(tmp_path, *FIXED, "--training.batch_rampup", "4", "1536", "--training.steps", "6",
                             "--checkpoint.folder", str(tmp_path / "ramped"), nproc=2)
    assert "batch ramp 4 -> 8 -> 12 -> 16 sequences over steps 1-4: 3,840 tokens in 6 steps" in proc.stdout
    assert [row["batch"] for row in ramped] == [4, 4, 8, 12, 16, 16]
    composed = []
    for batch, steps in ((4, 2), (8, 3), (12, 4), (16, 6)):
        rows, proc = run_plait(tmp_path, *FIXED, "--training.global_batch_size", str(batch), "--training.steps",
                               str(steps), "--checkpoint.folder", str(tmp_path / "composed"), nproc=2)
        composed += rows
        assert batch == 4 or f"training.global_batch_size {batch - 4 if batch > 8 else 4} -> {batch}" in proc.stdout
    assert [(r["loss"], r["grad_norm"]) for r in composed] == [(r["loss"], r["grad_norm"]) for r in ramped]
    assert json.loads((tmp_path / "metrics-0.summary.json").read_text())["tokens"] == 3840  # (the ramped run's)


WARM = ["--training.seq_len_warmup", "16", "512", "--training.steps", "4", "--training.global_batch_size", "4"]


def test_a_warm_up_under_cp_and_the_document_mask_is_one_device_s_and_resumes_mid_warm_up(tmp_path):
    """Sequences of 16, 32, then 64 tokens (16 -> 64 over 512 tokens; 256 a step). CP2 against one
    device: within the parity matrix's cp bound (tests/test_parity.py: CONTEXT, 1e-6 in fp32).
    Resumed from step 1, mid-warm-up: steps 2-4 bitwise. And bitwise the fixed-length jobs it is
    made of, each resumed from the last (a phase from step 1 fixes a job's length: 16, then 32)."""
    single, _ = run_plait(tmp_path, *WARM)
    folder = ["--checkpoint.folder", str(tmp_path / "cp"), "--checkpoint.interval", "1"]
    cp = ["--parallelism.cp", "2", "--parallelism.dp_shard", "1"]
    split, proc = run_plait(tmp_path, *WARM, *cp, *folder, nproc=2)
    assert "sequence warm-up 16 -> 32 -> 64 tokens over steps 1-2: 1,024 tokens in 4 steps" in proc.stdout
    assert [(row["batch"], row["seq_len"]) for row in split] == [(16, 16), (8, 32), (4, 64), (4, 64)]
    for key in ("loss", "grad_norm"):
        assert max(abs(a[key] - b[key]) for a, b in zip(single, split, strict=True)) <= 1e-6, key
    for step in (2, 3, 4):
        shutil.rmtree(tmp_path / "cp" / f"step-{step}")
    resumed, proc = run_plait(tmp_path, *WARM, *cp, *folder, nproc=2)
    assert "resumed from" in proc.stdout
    assert [(r["loss"], r["grad_norm"]) for r in resumed] == [(r["loss"], r["grad_norm"]) for r in split[1:]]
    composed, fixed = [], ["--checkpoint.folder", str(tmp_path / "fixed")]
    lengths = (["--training.phases", "step=1 seq_len=16"], ["--training.phases", "step=1 seq_len=32"], [])
    for steps, length in zip((1, 2, 4), lengths):
        rows, _ = run_plait(tmp_path, "--training.steps", str(steps), "--training.global_batch_size", "4", *length, *cp,
                            *fixed, nproc=2)
        composed += rows
    assert [(r["loss"], r["grad_norm"]) for r in composed] == [(r["loss"], r["grad_norm"]) for r in split]


@pytest.mark.parametrize("phases, message", [
    (["step=3 lr=linear"], "phase 1 .*: 'lr=linear' is not KEY=VALUE with a KEY of step, tokens, mix, decay"),
    (["step=3 tokens=100"], "phase 1 .*: give where it starts, step=N or tokens=N"),
    (["step=3 decay=exp"], "phase 1 .*: decay=exp; allowed: linear, sqrt, cosine"),
    (["step=3 to=0.5"], "phase 1 .*: to= is the lr a decay reaches"),
    (["step=5", "step=4"], "phase 2 starts at step 4, not after the phase before it"),
    (["step=61"], "phase 1 starts at step 61, after the run's last, 60"),
    (["step=3 seq_len=24"], r"phase 1's seq_len=24; allowed: .*\[1, 2, 4, 8, 16, 32, 64\]"),
    (["step=3 mix=/nonexistent:1"], "phase 1's mix: '/nonexistent' does not exist")])
def test_a_phase_that_cannot_run_is_one_line(phases, message):
    with pytest.raises(ConfigError, match=f"^training.phases: {message}"):
        job("--training.phases", *phases)


def test_a_phase_draws_from_its_mixture_and_decays_the_lr_its_own_way():
    main, extra = Counting(64 * 4000 + 1), Counting(64 * 4000 + 1, first=10**7)
    phases = Phases(("step=5 mix=main:0.25,extra:0.75",), 60, lambda step: (step - 1) * 64 * 64)
    schedule = BatchSchedule(64, 64)
    schedule.phases = phases
    loader = BatchLoader([main, extra], [1.0], 64, 64, 64, 0, 1, seed=3, schedule=schedule,
                         phase_weights={1: [0.25, 0.75]})
    drawn = [loader.next_batches()[0][0] for _ in range(54)]
    assert all((x < 10**7).all() for x in drawn[:4])  # before step 5: the run's own source alone
    extras = sum(int((x[:, 0] >= 10**7).sum()) for x in drawn[4:])  # steps 5-54: 50 x 64 draws at 0.75
    n, p = 50 * 64, 0.75
    assert abs(extras - n * p) <= 4 * (n * p * (1 - p)) ** 0.5, extras  # (4 standard deviations: 1 in 15,000)

    cfg = job("--training.steps", "40", "--training.warmup_steps", "4", "--training.phases",
              "step=31 decay=sqrt to=0.05")
    at, start = factor(cfg), factor(job("--training.steps", "40", "--training.warmup_steps", "4"))
    assert [at(done) for done in range(30)] == [start(done) for done in range(30)]  # the cosine until step 30
    for done in range(30, 40):  # steps 31-40: sqrt from the cosine's step-31 value to 0.05
        assert at(done) == start(30) + (0.05 - start(30)) * ((done - 29) / 10) ** 0.5, done
    assert at(39) == pytest.approx(0.05)


PHASED = ["--training.steps", "5", "--training.global_batch_size", "8", "--parallelism.dp_shard", "2",
          "--checkpoint.interval", "1"]


def test_a_phased_run_resumes_before_and_inside_its_phase_and_a_phase_given_on_resume_is_the_same_run(tmp_path):
    """FSDP2 at world 2: phase 1 from step 3 draws from a second source (raw text, tokenized with
    the run's tokenizer), halves the sequences and decays the lr to 0. A run without the phase
    saved after step 2, resumed with it, repeats the phased run's steps 3-5 bitwise; that one resumed
    from step 3, inside the phase, its steps 4-5."""
    anneal = tmp_path / "anneal.txt"
    anneal.write_text(validation_text())
    phase = ["--training.phases", f"step=3 mix={anneal}:1 decay=linear seq_len=32"]
    phased, proc = run_plait(tmp_path, *PHASED, *phase, "--checkpoint.folder", str(tmp_path / "phased"), nproc=2)
    assert "phase 1: steps 3-5 (from step 3): mix" in proc.stdout
    assert [(r["phase"], r["seq_len"], r["batch"]) for r in phased] == [(0, 64, 8)] * 2 + [(1, 32, 16)] * 3
    assert phased[-1]["lr"] == 0 and phased[2]["lr"] < phased[1]["lr"]
    folder = ["--checkpoint.folder", str(tmp_path / "added")]
    run_plait(tmp_path, *PHASED, "--training.steps", "2", *folder, nproc=2)
    added, proc = run_plait(tmp_path, *PHASED, *phase, *folder, nproc=2)
    assert "resumed from" in proc.stdout and "training.phases () -> (" in proc.stdout
    assert [(r["loss"], r["grad_norm"], r["lr"]) for r in added] == [(r["loss"], r["grad_norm"], r["lr"])
                                                                      for r in phased[2:]]
    for step in (4, 5):
        shutil.rmtree(tmp_path / "added" / f"step-{step}")
    inside, _ = run_plait(tmp_path, *PHASED, *phase, *folder, nproc=2)
    assert [(r["loss"], r["grad_norm"]) for r in inside] == [(r["loss"], r["grad_norm"]) for r in phased[3:]]


def test_toml_phase_tables_are_training_phases(tmp_path):
    config = tmp_path / "anneal.toml"
    config.write_text('[training]\nsteps = 40\n\n[[phase]]\nstep = 31\ndecay = "linear"\nto = 0\n\n'
                      '[[phase]]\ntokens = 100000\nseq_len = 32\n')
    phases = ("step=31 decay=linear to=0", "tokens=100000 seq_len=32")
    assert parse_args(["--config", str(config)]).training.phases == phases
    config.write_text('phase = "step=3"\n')
    with pytest.raises(ConfigError, match=r"phase is a list of \[\[phase\]\] tables"):
        parse_args(["--config", str(config)])
