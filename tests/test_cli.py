"""The command line as a newcomer meets it: each subcommand's --help, --version, and what the
commands print when they are done (in-process, so each check takes well under a second)."""

import os
from importlib.metadata import version

import pytest

from conftest import TINY
from plait import cli
from plait.cli import COMMANDS, main

# subcommand -> an option only its own --help lists (a subcommand missing here is still checked for
# its own usage line and exit code 0)
OWN_OPTION = {"train": "--training.steps", "tokenize": "--workers", "seed-checkpoint": "--out", "export": "--shard_mb",
              "generate": "--max_new_tokens", "bench": "--rounds", "bench-context": "--seq_lens", "compare": "--run",
              "trace": "--expect", "plan": "--device_memory_gib", "doctor": "--budget_seconds",
              "lighthouse": "--min_replicas"}


@pytest.mark.parametrize("command", COMMANDS)
def test_every_subcommand_has_its_own_help(command, capsys):
    try:
        code = main([command, "--help"])
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr().out
    assert code in (0, None) and out.startswith(f"usage: plait {command} "), out[-2000:]
    assert OWN_OPTION.get(command, "") in out


def test_help_lists_only_what_a_command_accepts(capsys):
    with pytest.raises(SystemExit):
        main(["tokenize", "--help"])
    out = capsys.readouterr().out
    assert "--data.path" in out and "--data.mix" not in out and "--data.val_path" not in out
    assert main(["tokenize", "--data.mix", "a:1", "--out", "x"]) == 2
    assert capsys.readouterr().err.startswith("plait: error: data.mix: plait tokenize takes one data.path")
    # plan takes train's options for the job: its help points there instead of repeating them
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    out = capsys.readouterr().out
    assert "--world" in out and "plait train --help" in out and "--training.steps" not in out


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"plait {version('plait')}\n"


@pytest.fixture(scope="module")
def qwen3_seed(tmp_path_factory):
    out = tmp_path_factory.mktemp("seed") / "qwen3"
    assert main(["seed-checkpoint", *TINY, "--model.flavor", "debug_qwen3", "--out", str(out)]) == 0
    return out


def test_export_names_the_models_family(qwen3_seed, tmp_path, capsys):
    assert main(["export", "--checkpoint", str(qwen3_seed), "--out", str(tmp_path / "hf")]) == 0
    line = capsys.readouterr().out
    assert "as Hugging Face Qwen3ForCausalLM, bfloat16" in line and "Llama" not in line


def test_generate_ends_its_text_with_a_newline(qwen3_seed, capsys):
    assert main(["generate", "--checkpoint", str(qwen3_seed), "--prompt", "Tensor", "--max_new_tokens", "3",
                 "--temperature", "0"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("Tensor") and out.endswith("\n") and out.count("\n") == 1
    assert err.startswith("plait: 3 tokens in ")  # the timing line follows the text, not a blank line


def test_a_second_tokenize_says_it_had_nothing_to_do(tmp_path, capsys):
    (tmp_path / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog\n\n" * 200)
    argv = ["tokenize", "--data.path", str(tmp_path / "corpus.txt"), "--data.vocab_size", "300",
            "--out", str(tmp_path / "tokens"), "--workers", "1"]
    assert main(argv) == 0
    first = capsys.readouterr().out
    assert "tokens/s with 1 workers" in first
    assert main(argv) == 0
    again = capsys.readouterr().out
    assert "tokens/s" not in again and f"{tmp_path / 'tokens'} already holds" in again, again


@pytest.fixture
def launched(monkeypatch):
    """`plait train --nproc N` up to the launch: the torchrun command it would run is recorded instead."""
    calls = []
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(cli, "launch_local", lambda argv, nproc, *rest: calls.append(nproc) or 0)
    return calls


def test_more_ranks_than_cores_is_said_once(launched, monkeypatch, capsys):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})  # a one-core machine
    argv = ["train", *TINY, "--training.device", "cpu", "--parallelism.dp_shard", "2"]
    assert main([*argv, "--nproc", "2"]) == 0 and launched == [2]
    assert capsys.readouterr().err.splitlines() == [
        "plait: warning: nproc: 2 ranks on 1 CPU core share it: fine for a test, slower than 1 rank for training"]
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert main([*argv, "--nproc", "2"]) == 0 and capsys.readouterr().err == ""


def test_more_ranks_than_gpus_cannot_start(launched, monkeypatch, capsys):
    import torch

    from plait import precision

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(precision, "native_bf16", lambda device: (True, "a GPU with bf16"))  # a GPU that is not here
    assert main(["train", *TINY, "--training.device", "cuda", "--parallelism.dp_shard", "2", "--nproc", "2"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "plait: error: nproc: 2 ranks need a GPU each, this machine has 1 (training.device cpu runs them on CPU cores)"]
    assert launched == []


def test_a_refusal_from_the_ranks_is_their_line_without_torchrun_s_traceback(tmp_path):
    """What only the ranks can check (here: a validation file too short for one batch) ends the
    job with exit 2 and the ranks' one line; torchrun's ChildFailedError report of it is left out
    (found by the options generator, docs/proofs.md). A crash keeps torchrun's report."""
    import subprocess
    import sys

    val = tmp_path / "val.txt"
    val.write_text("too short a validation text\n")
    proc = subprocess.run([sys.executable, "-m", "plait", "train", "--nproc", "2", *TINY, "--training.steps", "1",
                           "--data.val_path", str(val), "--training.eval_interval", "1"],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr, proc.stderr[-3000:]
    assert {line for line in proc.stderr.splitlines() if line.startswith("plait:")} == {
        f"plait: error: data.val_path: {val} has 0 sequences of training.seq_len=64, not even one global batch of 4: "
        "more validation text, or a smaller "
        "training.global_batch_size or seq_len"}


def test_what_the_model_refuses_is_one_line_from_the_launcher(tmp_path):
    """ep on a dense model: the launcher checks the options against the job's model before it
    starts a rank (found by the options generator: every rank refused it, after start-up)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "plait", "train", "--nproc", "2", *TINY, "--parallelism.ep", "2"],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        "plait: error: parallelism.ep: 2 needs a mixture-of-experts model (e.g. --model.flavor debug_moe); this model "
        "is dense"], proc.stderr[-3000:]


def test_a_mistyped_command_or_choice_is_one_line_with_the_closest_names(capsys):
    """issue 62: `plait trian` printed the usage without an error line; a flavor not among the
    choices (31 then) listed them all instead of the names it is close to."""
    import typing

    from plait.flavor_names import ModelFlavor

    assert main(["trian"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "plait: error: 'trian' is not a command; did you mean train? (the commands are below)"
    assert err[1].startswith("usage: plait {train,")
    assert main(["train", "--model.flavor", "llama3_7b"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"plait: error: model.flavor: 'llama3_7b' is not one of its {len(typing.get_args(ModelFlavor))} choices; did "
        "you mean llama3_70b or llama3_8b or llama3_1b? (plait train --help lists them)"]
    assert main(["train", "--training.float8", "xx"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "plait: error: training.float8: 'xx' is not one of its 5 choices; allowed: none, tensorwise, rowwise, mxfp8, "
        "mxfp8_wgrad_hp (plait train --help lists them)"]
