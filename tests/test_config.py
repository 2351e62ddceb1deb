"""Options: typed defaults, TOML + command line (CLI wins), and one-line errors before any process group."""

import subprocess
import sys
import typing

import pytest

from plait.cli import main
from plait.arguments import parse_args
from plait.checks import check_options
from plait.config import ConfigError, grad_accumulation_steps
from plait.flavor_names import ModelFlavor

FLAVOR_CHOICES = typing.get_args(ModelFlavor)  # ("auto", then every flavor)


def test_defaults_and_named_config():
    cfg = parse_args([])
    assert cfg.model.flavor == "auto" and cfg.parallelism.dp_shard == -1
    assert check_options(cfg, 1).model.flavor == "debug"  # auto: debug, without a Hugging Face folder to read
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
    (["--parallelism.pp", "3"], "does not divide the world size 4"),
    # pipelines (world 4): fewer blocks than stages, a split that does not divide, too few for 1f1b, wrong placements
    (["--parallelism.pp", "4", "--parallelism.dp_shard", "1"], "4 stages need at least 4 blocks, the model has 2"),
    (["--parallelism.pp", "2", "--parallelism.pp_microbatches", "3"], "pp_microbatches: 3 does not divide the local batch 8"),
    (["--parallelism.pp", "4", "--model.n_layers", "4", "--parallelism.pp_microbatches", "2"],
     r"1f1b needs at least one micro-batch per stage \(4\), got 2"),
    (["--parallelism.pp", "2", "--parallelism.pp_schedule", "zbv", "--parallelism.pp_stages_per_rank", "3"],
     "zbv places exactly 2 stages per rank"),
    (["--parallelism.pp", "2", "--parallelism.pp_schedule", "interleaved_1f1b", "--parallelism.pp_stages_per_rank", "1"],
     "interleaved_1f1b interleaves several stages per rank"),
    (["--parallelism.pp", "2", "--parallelism.pp_stages_per_rank", "2"], "1f1b runs one stage per rank"),
    (["--parallelism.pp", "2", "--model.n_layers", "4", "--parallelism.pp_split_points", "3", "1"],
     r"pp_split_points: \[3, 1\] is not 1 increasing"),
    (["--parallelism.pp", "2", "--parallelism.dp_backend", "simple_fsdp"], "simple_fsdp cannot run under pipeline"),
    (["--parallelism.pp", "2", "--training.micro_batch_size", "2"], "micro-batches are the accumulation"),
    (["--parallelism.pp", "2", "--parallelism.pp_schedule", "zbv", "--model.n_layers", "4", "--compile.enable"],
     "compile.enable: zbv"),
    (["--data.path", "/no/such/file.txt"], "data.path"),
    (["--data.tokenizer", "/no/such/tokenizer.json"], "data.tokenizer"),
    (["--profiling.steps", "0"], "profiling.steps: must be >= 1"),
    (["--activation_checkpoint.every", "0"], "activation_checkpoint.every: must be >= 1"),
    (["--model.max_seq_len", "-1"], "model.max_seq_len: must be >= 0"),
    (["--activation_checkpoint.mode", "full", "--parallelism.dp_backend", "simple_fsdp", "--compile.enable"],
     "activation_checkpoint.mode: full under simple_fsdp with compile.enable"),
    (["--profiling.enable", "--profiling.folder", ""], "profiling.folder"),
    (["--profiling.enable", "--training.steps", "2"], "needs training.steps >= 3"),
    (["--training.lr", "nan"], "training.lr: must be a finite number, got nan"),
    (["--training.max_norm", "inf"], "training.max_norm: must be a finite number"),
    # context parallelism and the attention kernel (world 4)
    (["--parallelism.cp", "3"], r"dp_replicate\*cp\*tp\*pp = 3 does not divide the world size 4"),
    (["--parallelism.cp", "2", "--training.seq_len", "126"], "training.seq_len: 126 does not split into 2 x cp = 4"),
    (["--parallelism.cp", "2", "--parallelism.dp_backend", "simple_fsdp"], "simple_fsdp cannot run with cp > 1"),
    (["--parallelism.cp", "2", "--parallelism.dp_backend", "ddp", "--parallelism.dp_replicate", "2"],
     "ddp cannot run with cp > 1"),
    (["--parallelism.cp", "4", "--parallelism.cp_kind", "hybrid", "--parallelism.cp_ulysses", "4"],
     r"cp_ulysses: 4 with cp_kind hybrid must divide cp 4 and lie strictly between 1 and it .*allowed: \[2\]"),
    (["--parallelism.cp", "2", "--parallelism.cp_ulysses", "2"], "cp_ulysses: 2 is the Ulysses degree of cp_kind hybrid"),
    (["--parallelism.cp_kind", "ring"], "parallelism.cp_kind"),
    (["--model.attention", "flex"], "flex cannot train on this device"),
    (["--model.attention", "flex", "--parallelism.cp", "2"], "flex is not proven with pp > 1 or cp > 1"),
    (["--model.attention", "flex", "--model.attention_mask", "causal"], "flex serves the document mask"),
    (["--model.attention", "flex", "--debug.dtype_probe", "p.json"], "debug.dtype_probe records eager ops"),
    (["--model.attention_mask", "sliding"], "model.attention_mask"),
    # optimizer offload: what the options alone refuse (plan prices a GPU's rows from any machine)
    (["--training.offload", "optimizer", "--parallelism.dp_backend", "ddp", "--parallelism.dp_replicate", "4",
      "--parallelism.dp_shard", "1", "--training.mixed_precision_mode", "autocast"],
     "training.offload: optimizer: it is FSDP2's CPU offload"),
    (["--training.offload", "optimizer", "--optimizer.name", "muon"], "training.offload: optimizer: the host steps"),
    (["--training.offload", "optimizer", "--training.float8", "rowwise"], "training.offload: optimizer: float8"),
    (["--training.offload", "host"], "training.offload"),
])
def test_validation_errors_name_the_option(argv, fragment):
    with pytest.raises(ConfigError, match=fragment):
        check_options(parse_args(argv), world=4)


def test_context_parallel_sequence_must_split_over_tp_too():
    with pytest.raises(ConfigError, match="each cp rank's 10 tokens do not split over tp 4 .*allowed: a multiple of 8"):
        check_options(parse_args(["--parallelism.cp", "2", "--parallelism.tp", "4", "--training.seq_len", "20"]), world=8)


def test_ulysses_must_split_the_heads_each_tp_rank_holds():
    from plait.parallel.context_parallel import check_heads
    from plait.plan import model_shape

    cfg = check_options(parse_args(["--parallelism.cp", "4", "--parallelism.tp", "2", "--parallelism.cp_kind",
                                    "ulysses", "--training.seq_len", "64"]), world=8)
    with pytest.raises(ConfigError, match="parallelism.cp: 4 does not divide the 2 query heads each tp rank holds"):
        check_heads(model_shape(cfg), cfg)  # debug: 4 heads, 2 per tp rank
    cfg.parallelism.cp_kind, cfg.parallelism.cp_ulysses = "hybrid", 2
    check_heads(model_shape(cfg), cfg)  # Ulysses over pairs, the rest all-gathered: runs


def test_pipeline_stages_are_balanced_or_split_where_asked():
    from plait.parallel.stages import split_blocks, stage_indices

    # The embedding and the output count as a block each: the end stages get fewer blocks.
    assert split_blocks(2, 2) == [range(0, 1), range(1, 2)]
    assert split_blocks(16, 2) == [range(0, 8), range(8, 16)]
    assert split_blocks(12, 4) == [range(0, 3), range(3, 6), range(6, 10), range(10, 12)]
    assert split_blocks(4, 4) == [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]
    assert split_blocks(6, 2, (2,)) == [range(0, 2), range(2, 6)]
    assert stage_indices(0, 2, 2, "interleaved_1f1b") == [0, 2] and stage_indices(0, 2, 2, "zbv") == [0, 3]


def test_batch_arithmetic():
    cfg = check_options(parse_args(["--training.global_batch_size", "16", "--parallelism.dp_replicate", "2"]), world=4)
    assert (cfg.parallelism.dp_shard, cfg.training.micro_batch_size) == (2, 4)
    cfg = check_options(parse_args(["--training.global_batch_size", "16", "--training.micro_batch_size", "2"]), world=2)
    assert grad_accumulation_steps(cfg) == 4


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "plait", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("argv, line", [
    (["--training.stepz", "3"], "training.stepz: unknown option --training.stepz; did you mean --training.steps? "
                                "(plait train --help lists every option)"),
    # (the choices as the flavor list has them: a new flavor changes the line, not this test)
    (["--model.flavor", "huge"], f"model.flavor: 'huge' is not one of its {len(FLAVOR_CHOICES)} choices; allowed: "
                                 f"{', '.join(FLAVOR_CHOICES)} (plait train --help lists them)"),
    (["--training.steps", "x"], "training.steps: Error parsing --training.steps: invalid literal for int() with base 10: 'x'"),
    (["--compile.enable", "yes"], "arguments: unexpected value 'yes' (a boolean option takes none: --section.key sets "
                                  "it, --section.no_key clears it)"),
])
def test_cli_parse_errors_are_one_line_naming_the_option(argv, line, capsys):
    """tyro's error boxes (6-11 lines) become the one line the README promises, exit code 2."""
    assert main(["train", *argv]) == 2
    assert capsys.readouterr().err.splitlines() == [f"plait: error: {line}"]


@pytest.mark.parametrize("toml, expected", [
    ("[training]\nsteps = 'many'", 'training.steps = "many": expected an integer'),
    ("[training]\nlr = '1e-3'", 'training.lr = "1e-3": expected a number'),
    ("[training]\nfloat8 = 'fp8'", 'training.float8 = "fp8": expected one of "none", "tensorwise", "rowwise", "mxfp8", '
                                    '"mxfp8_wgrad_hp"'),
    ("[optimizer]\nbetas = [0.9, 'x']", 'optimizer.betas = [0.9, "x"]: expected a list of numbers'),
    ("[compile]\nenable = 1", "compile.enable = 1: expected true or false"),
])
def test_a_toml_value_of_the_wrong_type_names_the_file_the_key_and_what_it_expects(tmp_path, capsys, toml, expected):
    """issue 62: the message named the command-line flag the value became, not the file's key."""
    (tmp_path / "job.toml").write_text(toml + "\n")
    assert main(["train", "--config", str(tmp_path / "job.toml")]) == 2
    assert capsys.readouterr().err.splitlines() == [f"plait: error: config {tmp_path / 'job.toml'}: {expected}"]


def test_a_file_that_is_no_tokenizer_says_what_was_expected(tmp_path, capsys):
    (tmp_path / "tokenizer.txt").write_text("one word per line\n")
    assert main(["train", "--data.tokenizer", str(tmp_path / "tokenizer.txt")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"plait: error: data.tokenizer: '{tmp_path / 'tokenizer.txt'}' is not a tokenizer.json (a Hugging Face "
        "`tokenizers` file, as in a model's folder): expected value at line 1 column 1"]


def test_cli_validation_error_is_one_line_before_launch(tmp_path):
    # With --nproc the launcher validates first: one line, no torchrun, non-zero exit.
    proc = run_cli("train", "--nproc", "2", "--parallelism.dp_shard", "3")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["plait: error: parallelism: dp_replicate(1) x dp_shard(3) x cp(1) x tp(1) x pp(1) "
                                                "= 3 must equal the world size 2"]


def test_offloading_the_optimizer_on_a_cpu_is_one_line_before_launch():
    proc = run_cli("train", "--nproc", "2", "--training.offload", "optimizer", "--training.device", "cpu")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "plait: error: training.offload: optimizer: on a CPU device the host is the device: there is nothing to move; "
        "allowed: none"]


def test_help_lists_every_option(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    for name in ("--config", "--nproc", "--model.flavor", "--training.global_batch_size", "--parallelism.dp_replicate", "--data.tokenizer",
                 "--metrics.jsonl", "--metrics.tensorboard", "--comm.timeout_seconds", "--debug.deterministic"):
        assert name in out


def test_the_flavor_names_options_take_are_the_flavors_there_are():
    import typing

    from plait.flavor_names import Flavor
    from plait.models.flavors import FLAVORS

    assert sorted(typing.get_args(Flavor)) == sorted(FLAVORS)
