"""Options: typed defaults, TOML + command line (CLI wins), and one-line errors before any process group."""

import subprocess
import sys

import pytest

from plait.cli import main
from plait.config import ConfigError, grad_accumulation_steps, parse_args, validate


def test_defaults_and_named_config():
    cfg = parse_args([])
    assert cfg.model.flavor == "debug" and cfg.parallelism.dp_shard == -1
    assert parse_args(["--config", "small"]).model.flavor == "small"


def test_toml_then_cli_wins(tmp_path):
    toml = tmp_path / "job.toml"
    toml.write_text('[training]\nsteps = 7\nlr = 0.5\n[debug]\ndeterministic = true\n')
    cfg = parse_args(["--config", str(toml), "--training.steps", "9"])
    assert (cfg.training.steps, cfg.training.lr, cfg.debug.deterministic) == (9, 0.5, True)


@pytest.mark.parametrize("toml, fragment", [
    ("[training]\nstepz = 3\n", "training.stepz"),
    ("[trainer]\nsteps = 3\n", "[trainer]"),
    ("[training\n", "not valid TOML"),
])
def test_bad_toml_names_the_problem(tmp_path, toml, fragment):
    path = tmp_path / "bad.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError, match=fragment.replace("[", r"\[")):
        parse_args(["--config", str(path)])


def test_unknown_config_name_lists_named_configs():
    with pytest.raises(ConfigError, match="debug"):
        parse_args(["--config", "nonexistent"])


@pytest.mark.parametrize("argv, fragment", [
    (["--parallelism.dp_shard", "3"], "must equal the world size 4"),
    (["--parallelism.dp_replicate", "3"], "does not divide the world size 4"),
    (["--training.global_batch_size", "6"], "training.global_batch_size"),
    (["--training.global_batch_size", "8", "--training.micro_batch_size", "3"], "micro_batch_size"),
    (["--parallelism.tp", "0"], "parallelism.tp"),
    (["--parallelism.pp", "2"], "parallelism.pp"),
    (["--data.path", "/no/such/file.txt"], "data.path"),
    (["--data.tokenizer", "/no/such/tokenizer.json"], "data.tokenizer"),
    (["--profiling.steps", "0"], "profiling.steps: must be >= 1"),
    (["--profiling.enable", "--profiling.folder", ""], "profiling.folder"),
    (["--profiling.enable", "--training.steps", "2"], "needs training.steps >= 3"),
])
def test_validation_errors_name_the_option(argv, fragment):
    with pytest.raises(ConfigError, match=fragment):
        validate(parse_args(argv), world=4)


def test_batch_arithmetic():
    cfg = validate(parse_args(["--training.global_batch_size", "16", "--parallelism.dp_replicate", "2"]), world=4)
    assert (cfg.parallelism.dp_shard, cfg.training.micro_batch_size) == (2, 4)
    cfg = validate(parse_args(["--training.global_batch_size", "16", "--training.micro_batch_size", "2"]), world=2)
    assert grad_accumulation_steps(cfg) == 4


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "plait", *args], capture_output=True, text=True, timeout=120)


def test_cli_rejects_unknown_option_and_bad_choice():
    proc = run_cli("train", "--training.stepz", "3")
    assert proc.returncode != 0 and "--training.stepz" in proc.stderr
    proc = run_cli("train", "--model.flavor", "huge")
    assert proc.returncode != 0 and "llama3_8b" in proc.stderr  # the allowed values are listed


def test_cli_validation_error_is_one_line_before_launch(tmp_path):
    # With --nproc the launcher validates first: one line, no torchrun, non-zero exit.
    proc = run_cli("train", "--nproc", "2", "--parallelism.dp_shard", "3")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["plait: error: parallelism: dp_replicate(1) x dp_shard(3) x tp(1) x pp(1) "
                                                "= 3 must equal the world size 2"]


def test_help_lists_every_option(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    for name in ("--config", "--nproc", "--model.flavor", "--training.global_batch_size", "--parallelism.dp_replicate", "--data.tokenizer",
                 "--metrics.jsonl", "--metrics.tensorboard", "--comm.timeout_seconds", "--debug.deterministic"):
        assert name in out
