"""A user's first day, as the README tells it: its commands run as written, in a folder of their
own, on a tiny Qwen3 made by transformers (sizes made tiny by documented flags added to the
train command). Around them, what that day hit: a checkpoint.folder without an interval saves at
the end; a run from a Hugging Face folder says its hyper-parameters and which are still the debug
job's; tokens of another tokenizer are refused with the exact tokenize command; a job folder
where a checkpoint is expected means its newest complete checkpoint, or is refused listing what
it holds."""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT, TINY, run_plait
from plait.cli import main

transformers = pytest.importorskip("transformers")

# README.md, "continue a Hugging Face model": tokenize with the folder's tokenizer, continue its
# pre-training (a checkpoint.folder saves at the end), export the newest checkpoint for transformers.
HF_RECIPE = [
    "plait tokenize --data.path corpus/ --out qwen3-tokens/ --data.tokenizer Qwen3-0.6B/tokenizer.json",
    "plait train --checkpoint.load Qwen3-0.6B/ --data.path qwen3-tokens/ --checkpoint.folder ckpt/",
    "plait export --checkpoint ckpt/ --out qwen3-continued/",
]
# README.md, "your first model": tokenize a folder of documents, train with validation and a
# checkpoint folder, plot the run, resume it with more steps, export, generate, score the bundled task.
FIRST_MODEL = [
    "plait tokenize --data.path my_corpus/ --out my_tokens/",
    "plait train --data.path my_tokens/ --data.val_path my_val.jsonl --checkpoint.folder my_run/ "
    "--metrics.jsonl my_run/metrics.jsonl",
    "plait plot my_run/metrics.jsonl",
    "plait train --data.path my_tokens/ --data.val_path my_val.jsonl --checkpoint.folder my_run/ "
    "--metrics.jsonl my_run/metrics.jsonl --training.steps 80",
    "plait export --checkpoint my_run/ --out my_model/",
    'plait generate --checkpoint my_run/ --prompt "The checkpoint" --temperature 0',
    "plait eval --checkpoint my_run/",
    "plait recipes",  # (a recipe's two steps on a CPU, as the README shows them: tests/test_recipes.py)
]
# W&B as the README's step 4 adds it (offline: no account, no network)
WANDB = ["--metrics.wandb_project", "my-first-model", "--metrics.wandb_offline"]
STEPS = 3
TINY_TRAIN = [*TINY, "--training.steps", str(STEPS)]  # what the README leaves at the defaults, made tiny
DEBUG_CHOICES = ["training.lr", "training.warmup_steps", "training.steps", "training.seq_len",
                 "training.global_batch_size"]


def plait(command: str, cwd, check: bool = True) -> subprocess.CompletedProcess:
    """`command` (a README line) run as written in `cwd`; train gets TINY_TRAIN's sizes."""
    argv = shlex.split(command)
    assert argv[0] == "plait"
    extra = TINY_TRAIN if argv[1] == "train" else []
    proc = subprocess.run([sys.executable, "-m", "plait", *argv[1:], *extra], cwd=cwd, capture_output=True,
                          text=True, timeout=300)
    assert not check or proc.returncode == 0, f"{command} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc


def tiny_qwen3(folder):
    """A random Qwen3 in the debug shape, saved by transformers, with a tokenizer of its own."""
    from test_families import make_hf_model

    from plait.data.tokenizer import train_bpe

    make_hf_model("qwen3").save_pretrained(folder)
    train_bpe([(ROOT / "README.md").read_text()] * 4, 300).save(str(folder / "tokenizer.json"))


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    """The README's recipe run in a folder holding Qwen3-0.6B/ (tiny) and corpus/: each command's output."""
    root = tmp_path_factory.mktemp("first-day")
    tiny_qwen3(root / "Qwen3-0.6B")
    (root / "corpus").mkdir()
    for page in ("checkpoints", "families", "clusters"):
        shutil.copy(ROOT / "docs" / f"{page}.md", root / "corpus" / f"{page}.txt")
    return root, [plait(command, root) for command in HF_RECIPE]


def test_the_readme_recipe_continues_a_hugging_face_model_as_written(recipe):
    root, _ = recipe
    readme = (ROOT / "README.md").read_text()
    assert [command for command in HF_RECIPE if command not in readme] == []
    assert (root / "ckpt" / f"step-{STEPS}" / "plait.json").is_file()
    exported = root / "qwen3-continued"
    model = transformers.AutoModelForCausalLM.from_pretrained(exported)
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    logits = model(**tokenizer("Checkpoints are folders", return_tensors="pt")).logits
    assert logits.shape[-1] == model.config.vocab_size and logits.isfinite().all()


def test_the_readme_walks_a_first_model_through_as_written(tmp_path):
    """The README's first-model commands, as written, in a folder of their own: documents of the
    docs pages, tiny sizes put in front of each train command's own options (so its
    --training.steps 80 still wins), and W&B offline added as its step 4 says."""
    pytest.importorskip("wandb")
    from test_watching import read_wandb_run

    readme = (ROOT / "README.md").read_text()
    assert [command for command in FIRST_MODEL if command not in readme] == []
    (tmp_path / "my_corpus").mkdir()
    for page in ("checkpoints", "families", "clusters", "moe"):
        shutil.copy(ROOT / "docs" / f"{page}.md", tmp_path / "my_corpus" / f"{page}.txt")
    paragraphs = [p for page in ("data", "layouts") for p in (ROOT / "docs" / f"{page}.md").read_text().split("\n\n")]
    (tmp_path / "my_val.jsonl").write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs if p.strip()))
    env = {**os.environ, **{name: str(tmp_path / "wandb" / name.lower())
                            for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR")}}
    out = {}
    for command in FIRST_MODEL:
        argv = shlex.split(command)
        if argv[1] == "train":
            argv = [*argv[:2], *TINY_TRAIN, *argv[2:], *WANDB]
        proc = subprocess.run([sys.executable, "-m", "plait", *argv[1:]], cwd=tmp_path, capture_output=True,
                              text=True, timeout=300, env=env)
        assert proc.returncode == 0, f"{command} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
        out[command] = proc
    first, plot, resumed, export, generate, scored, recipes = (out[c] for c in FIRST_MODEL[1:])
    assert "  llama3_8b        Llama 3.1 8B pre-training on 8 x H100 80 GiB (one node)." in recipes.stdout
    run = tmp_path / "my_run"
    assert (run / f"step-{STEPS}" / "plait.json").is_file() and (run / "step-80" / "plait.json").is_file()
    assert f"plait: done: step {STEPS} | loss " in first.stdout and "val_loss" in first.stdout
    assert "plait: resuming with training.steps 3 -> 80" in resumed.stdout
    assert "plait: done: step 80 | loss " in resumed.stdout
    assert (run / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == list(range(1, 81))
    wandb_runs = [read_wandb_run(f) for f in (tmp_path / "wandb" / "wandb_dir" / "wandb").glob("offline-run-*")]
    assert len(wandb_runs) == 2 and {r["id"] for r in wandb_runs} == {(run / "wandb-run-id").read_text().strip()}
    assert sorted(row["_step"] for r in wandb_runs for row in r["history"]) == list(range(1, 81))
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "my_model")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "my_model")
    assert model(**tokenizer("The checkpoint", return_tensors="pt")).logits.isfinite().all()
    assert generate.stdout.startswith("The checkpoint") and generate.stdout.endswith("\n")
    assert scored.stdout.splitlines()[1].split()[:2] == ["sample", "86"]


def test_a_run_from_a_hugging_face_folder_says_its_hyperparameters_and_the_debug_defaults(recipe):
    _, (_, train, _) = recipe
    lines = train.stdout.splitlines()
    [said] = [line for line in lines if line.startswith("plait: hyper-parameters:")]
    assert "lr 0.002" in said and f"{STEPS} steps" in said and "seq_len 64" in said and "global batch 4" in said, said
    [warning] = [line for line in lines if "the debug job's defaults" in line]
    named = [option for option in DEBUG_CHOICES if option in warning]
    assert warning.startswith("plait: warning:") and named == ["training.lr"], warning  # the others were given
    # what was loaded, once: the folder, its family, its size and the tensors read (issue 62)
    [loaded] = [line for line in lines if line.startswith("plait: loaded Qwen3-0.6B")]
    assert re.fullmatch(r"plait: loaded Qwen3-0\.6B/?: qwen3, [\d.]+M parameters, \d+ tensors from 1 safetensors "
                        r"file\(s\)", loaded), loaded
    # the recipe gives its data: no warning of the bundled corpus
    assert not [line for line in lines if "trains on the bundled corpus" in line]


def test_a_checkpoint_folder_without_an_interval_saves_the_last_step(debug_job):
    folder, proc = debug_job
    assert sorted(p.name for p in folder.iterdir()) == ["plait-job.json", f"step-{STEPS}"]
    assert (folder / f"step-{STEPS}" / "plait.json").is_file()
    assert f"plait: checkpoint {folder / f'step-{STEPS}'} complete" in proc.stdout


def test_tokens_of_another_tokenizer_are_refused_with_the_tokenize_command(tmp_path):
    """Tokens made with the corpus's own BPE, trained from a Hugging Face folder (whose embeddings are
    its tokenizer's): the message is the command that makes the right ones. With data.tokenizer given
    (no Hugging Face folder), training with the folder's own tokenizer is the other way out."""
    from plait.data.tokenize import main as tokenize_main

    source = tmp_path / "Qwen3-0.6B"
    tiny_qwen3(source)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text((ROOT / "docs" / "checkpoints.md").read_text())
    tokens = tmp_path / "tokens"
    assert tokenize_main(["--data.path", str(corpus), "--out", str(tokens), "--data.vocab_size", "300",
                          "--workers", "1"]) == 0
    _, proc = run_plait(tmp_path, "--checkpoint.load", str(source), "--data.path", str(tokens), check=False)
    [line] = proc.stderr.strip().splitlines()
    command = (f"plait tokenize --data.path {corpus} --out {tmp_path / 'tokens-Qwen3-0.6B'} --data.tokenizer "
               f"{source / 'tokenizer.json'}")
    assert proc.returncode == 2 and command in line and "drop data.tokenizer" not in line, line
    _, proc = run_plait(tmp_path, "--data.tokenizer", str(source / "tokenizer.json"), "--data.path", str(tokens),
                        check=False)
    [line] = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and command in line and "drop data.tokenizer" in line, line


@pytest.fixture(scope="module")
def debug_job(tmp_path_factory):
    """A debug job's checkpoint.folder, trained STEPS steps with no checkpoint.interval: (folder, run)."""
    tmp = tmp_path_factory.mktemp("job")
    _, proc = run_plait(tmp, "--training.steps", str(STEPS), "--checkpoint.folder", str(tmp / "ckpt"))
    return tmp / "ckpt", proc


def generated(capsys, checkpoint) -> tuple[int, str, str]:
    code = main(["generate", "--checkpoint", str(checkpoint), "--prompt", "Checkpoints", "--max_new_tokens", "4",
                 "--temperature", "0", "--ids"])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_a_job_folder_means_its_newest_complete_checkpoint(debug_job, tmp_path, capsys):
    folder, _ = debug_job
    newest = folder / f"step-{STEPS}"
    said = f"plait: {folder} is a job folder: using its newest complete checkpoint {newest}"
    code, text, err = generated(capsys, folder)
    assert code == 0 and said in err.splitlines(), err
    assert (code, text) == generated(capsys, newest)[:2]
    assert main(["export", "--checkpoint", str(folder), "--out", str(tmp_path / "hf"), "--dtype", "float32"]) == 0
    assert said in capsys.readouterr().err.splitlines()
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "llama"
    rows, proc = run_plait(tmp_path, "--training.steps", "1", "--checkpoint.load", str(folder))
    assert len(rows) == 1 and said in (proc.stdout + proc.stderr).splitlines(), proc.stdout + proc.stderr


def test_a_job_folder_without_a_complete_checkpoint_is_refused_listing_what_it_holds(debug_job, tmp_path, capsys):
    folder = tmp_path / "ckpt"
    (folder / f"step-{STEPS}").mkdir(parents=True)
    shutil.copy(debug_job[0] / "plait-job.json", folder)
    (folder / f"step-{STEPS}" / "__0_0.distcp").write_bytes(b"partial")  # a save that never completed
    held = f"it holds plait-job.json, step-{STEPS} (unfinished: no plait.json)"
    for command in (["generate", "--checkpoint", str(folder), "--prompt", "x"],
                    ["export", "--checkpoint", str(folder), "--out", str(tmp_path / "hf")]):
        assert main(command) == 2
        [line] = capsys.readouterr().err.strip().splitlines()
        assert line.startswith(f"plait: error: checkpoint: {folder} is a job folder") and held in line, line
    _, proc = run_plait(tmp_path, "--training.steps", "1", "--checkpoint.load", str(folder), check=False)
    [line] = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and line.startswith(f"plait: error: checkpoint.load: {folder} is a job folder") \
        and held in line, line


def test_a_job_from_a_continued_hugging_face_checkpoint_trains_that_model(recipe, capsys):
    """A plait checkpoint of a job that started from a Hugging Face folder (ckpt/ of the recipe) is
    the model its manifest records, with the tokenizer it holds: a new job started from it (with no
    model.flavor and no data.tokenizer: the model is decided once, from what checkpoint.load names)
    and that job's export. A learning rate of 1e-30 moves no weight of this size (each update is
    below half an ulp of it), so the three hold one model: the two checkpoints score a text
    bitwise alike, transformers within fp32 kernel order (1e-5, as test_families measures)."""
    import torch

    from plait.generate import load

    root, _ = recipe
    plait("plait train --checkpoint.load ckpt/ --data.path qwen3-tokens/ --checkpoint.folder again/ "
          "--training.lr 1e-30", root)
    plait("plait export --checkpoint again/ --out again-hf/ --dtype float32", root)
    (continued, tokenizer), (again, _) = load(root / "ckpt"), load(root / "again")
    assert again.args == continued.args and again.args.family == "qwen3"
    tokens = torch.tensor([tokenizer.encode("Checkpoints are folders of the weights").ids])
    with torch.no_grad():
        ours = continued(tokens)
        assert torch.equal(again(tokens), ours)
        theirs = transformers.AutoModelForCausalLM.from_pretrained(root / "again-hf")(tokens).logits
    assert (theirs - ours).abs().max().item() <= 1e-5
    # The pipeline's check reads the same decision: this Qwen3 ties its output layer to its embedding.
    capsys.readouterr()
    assert main(["train", "--checkpoint.load", str(root / "ckpt"), "--parallelism.pp", "2", "--nproc", "2"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("plait: error: parallelism.pp: the model ties its output layer") and "ckpt" in line, line


def test_a_hugging_face_model_without_data_of_its_own_is_warned_of_the_bundled_corpus(recipe):
    from plait.arguments import parse_args
    from plait.hyperparameters import hf_start_lines

    root, _ = recipe
    folder = str(root / "Qwen3-0.6B")
    lines = hf_start_lines(parse_args(["--checkpoint.load", folder]))
    assert lines[-1] == (f"plait: warning: no data.path: {folder} trains on the bundled corpus (Python's "
                         "documentation, for trying plait), not on data of its own; give --data.path (a tokenized "
                         "folder or text)")
    assert not any("bundled corpus (Python" in line
                   for line in hf_start_lines(parse_args(["--checkpoint.load", folder, "--data.path", folder])))
