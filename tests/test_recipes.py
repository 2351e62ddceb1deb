"""The shipped recipes (plait/configs): each real run's config passes the start-up checks at its
world, `plait plan` says it fits its stated hardware in the layout the recipe holds, and it trains
two steps on a CPU with its model cut to two small blocks (model.shrink)."""

import json

import pytest

from conftest import ROOT, plait_forked
from plait.arguments import CONFIG_DIR, parse_args
from plait.checks import check_model, check_options
from plait.cli import main

# recipe -> (ranks, ranks per node, extra options: the Qwen3 continuation planned for Qwen3-0.6B's shape)
RECIPES = {"llama3_8b": (8, 8, []), "llama3_70b": (64, 8, []), "qwen3_30b_a3b": (8, 8, []),
           "deepseek_v3_16b": (8, 8, []), "gpt_oss_20b": (8, 8, []),
           "qwen3_continue": (8, 8, ["--model.flavor", "qwen3_0_6b"])}
DEGREES = ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep")


def test_every_shipped_config_is_listed_and_tested(capsys):
    assert main(["recipes"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()[1:]]
    assert listed == sorted(p.stem for p in CONFIG_DIR.glob("*.toml"))
    assert set(listed) == {*RECIPES, "debug", "small"}


@pytest.mark.parametrize("name", RECIPES)
def test_a_recipe_passes_start_up_at_its_world_and_plan_says_it_fits_as_it_is_laid_out(name, capsys):
    world, node, extra = RECIPES[name]
    cfg = check_options(parse_args(["--config", name, *extra]), world)
    check_model(cfg)
    text = (CONFIG_DIR / f"{name}.toml").read_text()
    assert "# Sources, per hyper-parameter:" in text and f"{world} x H100 80 GiB" in text.splitlines()[0]
    assert main(["plan", "--config", name, *extra, "--world", str(world), "--node_size", str(node), "--device",
                 "h100", "--device_memory_gib", "80", "--json"]) == 0
    best = json.loads(capsys.readouterr().out)["rows"][0]
    p = cfg.parallelism
    assert best["fits"] and best["activation_checkpoint"] == cfg.activation_checkpoint.mode
    assert best["micro_batch_size"] == cfg.training.micro_batch_size
    layout = dict(part.split("=") for part in best["layout"].split(","))
    assert {k: int(layout.get(k, 1)) for k in DEGREES} == {k: getattr(p, k) for k in DEGREES}
    # the header states plan's row: its memory, tokens/s per GPU and MFU
    header = " ".join(line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#"))
    assert f"{best['total_gib']:.1f} GiB of 80" in header and \
        f"{best['tokens_per_second_per_device']:,.0f} tokens/s" in header and f"MFU {100 * best['mfu']:.1f}%" in header


# One CPU rank, the model shrunk; what a CPU cannot take in a test changed and nothing else: the
# layout (its ranks are the hardware's), one sequence a step of the recipe's length (a recipe's
# batch is up to 2.3M tokens), two steps with one warmup step (the schedule's shape kept).
README = ["--training.steps", "2", "--training.warmup_steps", "1", "--training.decay_fraction", "0.5",
          "--training.global_batch_size", "1", "--training.micro_batch_size", "1"]
CPU = [*README, "--training.threads", "1", *(f"--parallelism.{name}={-1 if name == 'dp_shard' else 1}"
                                             for name in DEGREES)]


def test_the_readme_tries_a_recipe_as_these_tests_do():
    assert f"plait train --config llama3_8b --model.shrink {' '.join(README)} --parallelism.dp_shard 1\n" in \
        (ROOT / "README.md").read_text()


@pytest.mark.parametrize("name", RECIPES)
def test_a_recipe_trains_two_steps_on_a_cpu_shrunk(name, tmp_path):
    start = []
    if name == "qwen3_continue":  # a Qwen3 Hugging Face folder of the debug shape, as it is continued
        seed, hf = tmp_path / "seed", tmp_path / "qwen3"
        for argv in (["seed-checkpoint", "--model.flavor", "debug_qwen3", "--out", str(seed)],
                     ["export", "--checkpoint", str(seed), "--out", str(hf), "--dtype", "float32"]):
            assert plait_forked(*argv).returncode == 0
        start = ["--checkpoint.load", str(hf)]
    else:
        start = ["--model.shrink"]
    metrics = tmp_path / "metrics.jsonl"
    proc = plait_forked("train", "--config", name, *start, *CPU, "--metrics.jsonl", str(metrics))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["loss"] > 0 for r in rows)
