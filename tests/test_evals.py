"""Evaluation during training and `plait eval` (plait/evals): bad task files are refused in one
line, the scores equal lm-evaluation-harness's on an export, the default job learns the bundled
task, and the named validation sets are the validation loss's code. (The scores of every layout
against the single device are columns of the parity matrix: tests/test_parity.py.)"""

import json
import subprocess
import sys

import pytest
from conftest import ROOT, TINY, plait_forked, run_plait, validation_text
from plait.config import ConfigError, Eval
from plait.data.tokenizer import train_bpe
from plait.evals import TaskSuite
from plait.evals.tasks import encode_pair, load_task, prompt

PLAIT = [sys.executable, "-m", "plait"]
GOOD = {"context": "The sum of", "choices": ["two numbers", "a tree"], "gold": 0}


@pytest.mark.parametrize("row, message", [
    ({"context": "x", "choices": ["a", "b"]}, "has no gold"),
    ({"choices": ["a", "b"], "gold": 0}, "has no context"),
    ({"context": "x", "choices": ["a", " "], "gold": 0}, "choice 1 is empty"),
    ({"context": "x", "choices": ["a", "b"], "gold": 2}, "gold 2 is not an index into its 2 choices"),
    ({"context": "x", "choices": ["a", "b"], "gold": True}, "gold True is not an index"),
    ({"context": "x", "choices": ["a"], "gold": 0}, "choices must be a list of at least 2 strings"),
    ("not json", "is not valid JSON"),
])
def test_a_bad_task_file_is_refused_naming_its_line(tmp_path, row, message):
    task = tmp_path / "task.jsonl"
    task.write_text(json.dumps(GOOD) + "\n" + (row if isinstance(row, str) else json.dumps(row)) + "\n")
    with pytest.raises(ConfigError) as error:
        load_task(str(task))
    assert f"eval.tasks: {task}:2" in str(error.value) and message in str(error.value)
    assert "\n" not in str(error.value)


def test_a_task_file_s_strings_may_hold_line_separators(tmp_path):
    """Lines end at \\n only: U+2028 and U+0085 are characters in a JSON string, which
    json.dumps(ensure_ascii=False) writes as they are."""
    examples = [{**GOOD, "context": "one\u2028two"}, {**GOOD, "choices": ["a\x85b", "c"]}]
    task = tmp_path / "task.jsonl"
    task.write_text("".join(json.dumps(e, ensure_ascii=False) + "\n" for e in examples), encoding="utf-8")
    assert [e.context for e in load_task(str(task)).examples] == ["one\u2028two", GOOD["context"]]
    assert load_task(str(task)).examples[1].choices == ("a\x85b", "c")


def test_plait_eval_refuses_a_max_length_beyond_the_model_s_positions(tmp_path, capsys):
    """A window longer than the model's RoPE table is one line naming the limit, not a shape error
    from the first long request."""
    from plait.cli import main

    checkpoint = tmp_path / "seed"
    assert plait_forked("seed-checkpoint", *TINY, "--model.max_seq_len", "64", "--out", str(checkpoint)).returncode == 0
    task = tmp_path / "long.jsonl"
    task.write_text(json.dumps({**GOOD, "context": "word " * 150}) + "\n")
    assert main(["eval", "--checkpoint", str(checkpoint), "--tasks", str(task), "--max_length", "100"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "plait: error: max_length: 100 is beyond the model's 64 positions; allowed: 1..64 (0 = the model's)"]


def test_a_run_with_a_bad_task_fails_at_start_up_in_one_line(tmp_path):
    task = tmp_path / "task.jsonl"
    task.write_text(json.dumps({**GOOD, "gold": 5}) + "\n")
    proc = subprocess.run([*PLAIT, "train", *TINY, "--eval.interval", "2", "--eval.tasks", str(task)],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [f"plait: error: eval.tasks: {task}:1: gold 5 is not an index into its "
                                                "2 choices (0..1)"]
    with pytest.raises(ConfigError, match=r"'nowhere' is neither a .jsonl file nor a bundled task \['sample'\]"):
        load_task("nowhere")


def test_requests_follow_lm_evaluation_harness_s_rules():
    """Trailing spaces of a context move to its continuation, the continuation's tokens are the
    whole's after the context's, few-shot examples are the task's first others, solved."""
    tokenizer = train_bpe([validation_text()], 300)
    head, tail = encode_pair(tokenizer, "The sum of ", "two", 0)
    assert tokenizer.decode(tail) == " two" and tokenizer.decode(head) == "The sum of"
    assert head + tail == tokenizer.encode("The sum of two").ids
    assert encode_pair(tokenizer, "", "two", 7)[0] == [7]
    task = load_task("sample")
    first, second, third = task.examples[:3]
    assert prompt(task, 1, 2, " ", "\n\n") == (f"{first.context} {first.choices[first.gold]}\n\n"
                                                f"{third.context} {third.choices[third.gold]}\n\n{second.context}")


def test_a_long_request_keeps_its_last_tokens():
    tokenizer = train_bpe([validation_text()], 300)
    suite = TaskSuite(Eval(limit=2, num_fewshot=3), 48, tokenizer, 0)
    for request in suite.requests[0]:
        assert len(request.inputs) == 48 and 1 <= len(request.targets) <= 48


def lm_eval_scores(export, task, limit_tokens, fewshot):
    """lm-evaluation-harness 0.4's HF backend on `export`: per-example log-likelihoods and metrics."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    config = task.parent / "lm_eval_tasks"
    config.mkdir()
    (config / "plait_task.yaml").write_text(
        f"task: plait_task\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {task}\n"
        "test_split: test\nfewshot_split: test\nfewshot_config:\n  sampler: first_n\noutput_type: multiple_choice\n"
        "doc_to_text: context\ndoc_to_choice: choices\ndoc_to_target: gold\n"
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n  - metric: acc_bytes\n")
    result = simple_evaluate(model="hf", model_args=f"pretrained={export},dtype=float32,max_length={limit_tokens}",
                             tasks=["plait_task"], task_manager=TaskManager(include_path=str(config)),
                             num_fewshot=fewshot, log_samples=True, device="cpu", batch_size=4)
    samples = sorted(result["samples"]["plait_task"], key=lambda s: s["doc_id"])
    lls = [[r[0] for r in s["filtered_resps"]] for s in samples]
    metrics = result["results"]["plait_task"]
    return lls, {name: metrics[f"{name},none"] for name in ("acc", "acc_norm", "acc_bytes")}


def loss_of_each_document_alone(checkpoint, path) -> float:
    """The validation loss of `path`'s first global batch (4 sequences of 64 tokens) with each
    document of a sequence forwarded alone, plainly causal from position 0 (an end-of-text token
    opens the next one); the mention of the end-of-text string checked to be text."""
    import torch
    import torch.nn.functional as F
    from plait.config import Data
    from plait.data import eos_id, open_source
    from plait.data.loader import eval_batches
    from plait.generate import load

    model, tokenizer = load(checkpoint)
    eos = eos_id(tokenizer)
    (inputs, labels), = eval_batches(open_source(str(path), Data(), tokenizer, "test"), 64, 4, 4, 0, 1, 1)
    assert "<|eos|>" in tokenizer.decode(inputs.flatten().tolist()) and (inputs == eos).sum() >= 2
    total = 0.0
    with torch.no_grad():
        for row, target in zip(inputs, labels):
            starts = [0, *(i for i in range(1, len(row)) if row[i] == eos)]
            for a, b in zip(starts, [*starts[1:], len(row)]):
                total += F.cross_entropy(model(row[None, a:b])[0].float(), target[a:b], reduction="sum").item()
    return total / labels.numel()


@pytest.mark.slow
def test_plait_eval_scores_as_lm_evaluation_harness_does_on_the_export(tmp_path, monkeypatch):
    """A trained checkpoint, exported: plait's per-example log-likelihoods (the same from the
    checkpoint and from the export) equal lm-evaluation-harness's within 1e-4 (fp32; the sums differ in order only) and acc, acc_norm, acc_bytes are equal. The
    task has 2-shot contexts longer than the 64-token window (left truncation), a context with a
    trailing space, choices whose lengths in characters and bytes rank differently, and a context
    holding the end-of-text token's text (both tokenizers make it the token).

    The same run scores the task in the loop at its last step (window training.seq_len = 64, the
    run's document mask): the same scores as `plait eval`, the end-of-text in a context included:
    a request is scored plainly causal, as one text (issue 60, defect 4: under the training's
    document mask it restarted attention and RoPE there, gold_loss 8.58295 vs 8.58483). And a named
    validation set whose text mentions the end-of-text string is scored as training scores data:
    the mention stays text, each document of a sequence attends within itself (the reference: each
    forwarded alone from the checkpoint)."""
    examples = [json.loads(line) for line in (ROOT / "plait/evals/sample.jsonl").read_text().splitlines()[:6]]
    examples.append({"context": "A name refers to ", "choices": ["an object", "a value", "the same"], "gold": 0})
    examples.append({"context": "The result is", "choices": ["größer", "larger", "bigger", "same"], "gold": 1})
    examples.append({"context": "A function definition is an executable statement.<|eos|>Its execution binds",
                     "choices": ["the function name", "a loop", "the file"], "gold": 0})
    task = tmp_path / "task.jsonl"
    task.write_text("".join(json.dumps(e, ensure_ascii=False) + "\n" for e in examples))
    documents = [text for text in validation_text().split("\n\n") if text.strip()]
    documents.insert(1, "The separator is <|eos|> here, as text.")
    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps({"text": text}) + "\n" for text in documents))
    rows, _ = run_plait(tmp_path, "--training.steps", "8", "--checkpoint.folder", str(tmp_path / "run"),
                        "--eval.interval", "8", "--eval.tasks", str(task), "--eval.num_fewshot", "2",
                        "--data.val_path", str(val), "--training.eval_steps", "1", "--eval.loss_sets", f"prose:{val}")
    in_loop = rows[-1]
    export = tmp_path / "export"
    assert plait_forked("export", "--checkpoint", str(tmp_path / "run"), "--out", str(export), "--dtype",
                        "float32").returncode == 0
    samples = tmp_path / "samples.jsonl"

    def plait_eval(checkpoint):
        proc = plait_forked("eval", "--checkpoint", str(checkpoint), "--tasks", str(task), "--num_fewshot", "2",
                            "--max_length", "64", "--samples", str(samples), "--json")
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout), [json.loads(line)["log_likelihoods"] for line in samples.read_text().splitlines()]

    ours, ours_lls = plait_eval(tmp_path / "run")  # the job folder: its newest checkpoint
    assert plait_eval(export)[1] == ours_lls  # the Hugging Face folder of the same weights
    scores = ("acc", "acc_norm", "acc_bytes", "gold_loss")
    print("in the loop vs plait eval:", {name: (in_loop[f"eval_task_{name}"], ours[f"eval_task_{name}"]) for name in scores})
    assert {name: in_loop[f"eval_task_{name}"] for name in scores} == {name: ours[f"eval_task_{name}"] for name in scores}
    assert in_loop["val_loss_prose"] == in_loop["val_loss"]  # the same code and batches
    reference = loss_of_each_document_alone(tmp_path / "run", val)
    print("val_loss_prose vs each document alone:", in_loop["val_loss_prose"], reference)
    # within one float32 step at 6.6 (4.8e-7: val_loss is a float32 mean, the reference a float64 sum; measured 3e-8)
    assert abs(in_loop["val_loss_prose"] - reference) <= 5e-7, (in_loop["val_loss_prose"], reference)
    for variable in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(variable, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    theirs_lls, theirs = lm_eval_scores(export, task, 64, 2)
    assert len(ours_lls) == len(theirs_lls) == len(examples)
    worst = max(abs(a - b) for mine, other in zip(ours_lls, theirs_lls) for a, b in zip(mine, other, strict=True))
    assert worst <= 1e-4, worst
    assert {name: ours[f"eval_task_{name}"] for name in theirs} == theirs


@pytest.mark.slow
def test_the_default_job_learns_the_bundled_task_and_scores_named_validation_sets(tmp_path):
    """The default job (plait train's defaults) with --eval.interval: the bundled task scores
    above chance (4 choices: 0.25; measured 0.5-0.6 after 60 steps), and a named validation set
    that is data.val_path's file has its loss to the bit. The evaluations' time is logged apart
    from the steps' and summed in the summary."""
    val = tmp_path / "val.txt"
    val.write_text(validation_text())
    metrics = tmp_path / "metrics.jsonl"
    # (in the test's own session, not forked: the fork server's children get sessions of their own, and
    # where the kernel shares CPU by session (autogroups) this job's thread per core trained 6x slower
    # beside a busy process, 548 against 3,371 tok/s)
    proc = subprocess.run([*PLAIT, "train", "--eval.interval", "30", "--eval.loss_sets", f"prose:{val}",
                           "--data.val_path", str(val), "--training.eval_steps", "1", "--metrics.jsonl", str(metrics)],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    scored = [row for row in rows if "eval_sample_acc" in row]
    assert [row["step"] for row in scored] == [30, 60]
    assert scored[-1]["eval_sample_acc"] >= 0.4, scored[-1]
    assert all(row["val_loss_prose"] == row["val_loss"] and row["eval_time"] > 0 for row in scored)
    assert f"eval    60 | sample acc {scored[-1]['eval_sample_acc']:.3f}" in proc.stdout
    summary = json.loads(metrics.with_suffix(".summary.json").read_text())
    assert summary["evals"]["eval_sample_acc"] == scored[-1]["eval_sample_acc"] and summary["eval_step"] == 60
    assert summary["eval_time_s"] == pytest.approx(sum(row.get("eval_time", 0) for row in rows))


def test_plot_draws_the_task_scores_and_named_losses_of_runs_that_have_them(tmp_path):
    from plait.metrics.plot import PANELS, panels, plot_runs

    plain = [{"step": 1, "loss": 2.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_sec": 10.0}]
    assert panels([plain]) == PANELS
    scored = [*plain, {**plain[0], "step": 2, "val_loss_web": 2.5, "eval_sample_acc": 0.5, "eval_acc": 0.5}]
    drawn = panels([plain, scored])
    assert drawn[0][2] == ("loss", "val_loss", "val_loss_web")
    assert drawn[-1] == ("downstream tasks (plait/evals)", "acc", ("eval_sample_acc",))
    metrics = tmp_path / "run.jsonl"
    metrics.write_text("".join(json.dumps(row) + "\n" for row in scored))
    plot_runs([metrics], tmp_path / "run.png")
    assert (tmp_path / "run.png").read_bytes()[:4] == b"\x89PNG"
