"""Real Llama checkpoints in and out: tiny models in the shapes of Llama 3.2, SmolLM2, TinyLlama
and one whose head_dim is not hidden/heads, made offline by transformers itself.

plait builds each from its config.json alone and computes transformers' logits; the RoPE
frequencies (with llama3 and linear scaling) are transformers' bitwise; import then export is
bitwise, sharded or not, tied or not; and a folder plait trained and exported generates, in
`pipeline("text-generation")`, the tokens `plait generate` does.
"""

import json
import re
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, TINY, plait_forked, run_plait

from plait.hf.config import FAMILIES

transformers = pytest.importorskip("transformers")

VOCAB = 320
SHAPES = {  # config.json fields of each tiny model
    # Llama 3.2 1B/3B: tied, head_dim given, llama3 RoPE scaling (its original context shrunk to
    # 64 positions, so the test's 200 positions reach past the low-frequency wavelength).
    "llama3.2": dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, tie_word_embeddings=True, rope_theta=500000.0,
                     rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                     max_position_embeddings=512, rms_norm_eps=1e-5),
    # SmolLM2: tied, 9 heads over 3 kv heads.
    "smollm2": dict(hidden_size=72, intermediate_size=192, num_hidden_layers=2, num_attention_heads=9,
                    num_key_value_heads=3, tie_word_embeddings=True, rope_theta=100000.0, max_position_embeddings=256,
                    rms_norm_eps=1e-5),
    # TinyLlama: untied, no scaling, Llama 2's eps.
    "tinyllama": dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=1, tie_word_embeddings=False, rope_theta=10000.0,
                      max_position_embeddings=256, rms_norm_eps=1e-5),
    # head_dim 32 while hidden/heads is 16, with linear RoPE scaling.
    "head_dim_32": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=32, tie_word_embeddings=False,
                        rope_scaling={"rope_type": "linear", "factor": 2.0}, max_position_embeddings=256),
}


def make_hf_model(shape: str):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**SHAPES[shape], vocab_size=VOCAB)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(shape, sharded) -> a folder saved by transformers, with a tokenizer for the first."""
    made = {}

    def folder(shape: str, sharded: bool = False):
        if (shape, sharded) not in made:
            out = tmp_path_factory.mktemp(f"{shape}-{'sharded' if sharded else 'single'}")
            make_hf_model(shape).save_pretrained(out, max_shard_size="60KB" if sharded else "1GB")
            made[shape, sharded] = out
        return made[shape, sharded]

    return folder


def plait_model(folder):
    from plait import hf
    from plait.models.transformer import Transformer
    from plait.models.weights import fill_weights

    args = hf.model_args(folder, "checkpoint.load")
    weights = hf.HFWeights(folder, args, "checkpoint.load")
    model = Transformer(args)
    fill_weights(model, lambda name, shape: weights[name], weights.buffers)
    return model.eval(), weights


@pytest.mark.parametrize("shape", SHAPES)
def test_logits_and_rope_frequencies_equal_transformers(folders, shape):
    from plait.models.rope import rope_frequencies

    theirs = make_hf_model(shape)
    ours, _ = plait_model(folders(shape, sharded=shape == "llama3.2"))
    a = ours.args
    assert torch.equal(rope_frequencies(a.head_dim, a.rope_theta, a.rope_scaling), theirs.model.rotary_emb.inv_freq)
    tokens = torch.randint(0, VOCAB, (2, 200), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (ours(tokens) - theirs(tokens).logits).abs().max().item()
    print(f"\n{shape}: max |logits - transformers'| {diff:.2e} over 200 positions")
    assert diff <= 1e-5  # fp32; measured 2.1e-7 to 4.8e-7 (equivalent RoPE layouts, other kernel orders): 20x margin


@pytest.mark.parametrize("shape,sharded", [("llama3.2", True), ("llama3.2", False), ("tinyllama", True),
                                           ("tinyllama", False)])
def test_import_then_export_is_bitwise(folders, tmp_path, shape, sharded):
    from safetensors import safe_open

    from plait.hf.weights import INDEX, write_weights

    source = folders(shape, sharded)
    model, weights = plait_model(source)
    written = write_weights(dict(weights.items()), model.args, tmp_path, torch.float32, 60 << 10 if sharded else 1 << 30)
    assert (len(written) > 1) == sharded and (tmp_path / INDEX).exists() == sharded

    def tensors(folder):
        out = {}
        for f in folder.glob("*.safetensors"):
            with safe_open(str(f), "pt") as st:
                out.update({k: st.get_tensor(k) for k in st.keys()})
        return out

    before, after = tensors(source), tensors(tmp_path)
    assert before.keys() == after.keys() and ("lm_head.weight" in after) == (shape == "tinyllama")
    assert all(torch.equal(before[k], after[k]) for k in before)
    if sharded:
        index = json.loads((tmp_path / INDEX).read_text())["weight_map"]
        assert set(index) == set(after) and set(index.values()) == set(written)


def generated_ids(stderr: str) -> list[int]:
    return json.loads(re.search(r"ids (\[[\d, ]*\])", stderr).group(1))


def test_a_trained_and_exported_folder_generates_in_transformers_as_plait_generate_does(tmp_path):
    """Start from a Llama 3.2-shaped folder with a tokenizer, train it (tied) for 2 steps,
    export the checkpoint: transformers' pipeline and `plait generate` (greedy, with and without
    the KV cache, from the export and from the checkpoint itself) give the same tokens."""
    from plait.data.tokenizer import train_bpe

    source = tmp_path / "llama"
    make_hf_model("llama3.2").save_pretrained(source)
    train_bpe([(ROOT / "README.md").read_text()] * 4, 300).save(str(source / "tokenizer.json"))
    folder = ["--checkpoint.folder", str(tmp_path / "c"), "--checkpoint.interval", "2"]
    rows, _ = run_plait(tmp_path, "--training.steps", "2", "--checkpoint.load", str(source), *folder)
    # The run took the folder's tokenizer, and its checkpoint keeps it.
    kept = tmp_path / "c" / "step-2" / "tokenizer.json"
    assert len(rows) == 2 and kept.read_text() == (source / "tokenizer.json").read_text()
    exported = tmp_path / "exported"
    assert plait_forked("export", "--checkpoint", str(tmp_path / "c" / "step-2"), "--out", str(exported),
                        "--dtype", "float32").returncode == 0
    prompt = "Tensor parallelism splits"

    def plait_generate(checkpoint, *extra):
        proc = plait_forked("generate", "--checkpoint", str(checkpoint), "--prompt", prompt, "--max_new_tokens", "12",
                            "--temperature", "0", "--ids", *extra)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout.startswith(prompt)
        return generated_ids(proc.stderr)

    tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    model = transformers.AutoModelForCausalLM.from_pretrained(exported)
    pipe = transformers.pipeline("text-generation", model=model, tokenizer=tokenizer)
    full = pipe(prompt, max_new_tokens=12, do_sample=False, return_tensors=True)[0]["generated_token_ids"]
    theirs = full[len(tokenizer(prompt)["input_ids"]):]
    ours = plait_generate(exported)
    assert ours == theirs and len(ours) >= 1
    assert plait_generate(exported, "--no-kv-cache") == ours
    assert plait_generate(tmp_path / "c" / "step-2") == ours
    # An empty prompt samples from the end-of-text token, which every training document followed.
    prompt = ""
    from_nothing = plait_generate(exported)
    prompt = "<|eos|>"  # the token itself, as text
    assert len(from_nothing) >= 1 and from_nothing == plait_generate(exported)


def one_line(*args) -> str:
    proc = subprocess.run([sys.executable, "-m", "plait", *args], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_bad_folders_are_one_line_each(folders, tmp_path):
    import shutil

    def variant(name, shape="tinyllama", sharded=False, **config):
        out = tmp_path / name
        shutil.copytree(folders(shape, sharded), out)
        saved = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**saved, **config}))
        return out

    train = ["train", *TINY, "--training.steps", "1", "--checkpoint.load"]
    longrope = variant("longrope", rope_scaling={"rope_type": "longrope", "factor": 4.0})
    assert one_line(*train, str(longrope)) == (
        f"plait: error: checkpoint.load: {longrope / 'config.json'} sets rope_scaling.rope_type \"longrope\"; allowed: "
        "default, linear, llama3, yarn (the RoPE scalings plait implements)")
    gemma = variant("gemma", model_type="gemma2")
    assert one_line(*train, str(gemma)) == (
        f"plait: error: checkpoint.load: {gemma / 'config.json'} holds a model_type 'gemma2' model; plait reads "
        f"{', '.join(FAMILIES)}")
    # Fields of a family plait reads that change the model in a way plait does not compute (the
    # same ConfigError as above, read in this process: no run each).
    from plait import hf
    from plait.config import ConfigError

    for fields, named in [({"model_type": "qwen3", "final_logit_softcapping": 30.0},
                           "sets final_logit_softcapping (logit soft-capping), which plait does not compute; allowed: "
                           "unset, null or false"),
                          ({"model_type": "qwen2", "num_experts": 8}, "sets num_experts (mixture of experts)"),
                          ({"hidden_act": "gelu"}, "sets hidden_act 'gelu'; allowed: 'silu'"),
                          ({"rms_norm_eps": None}, "sets rms_norm_eps null; allowed: a number"),
                          ({"quantization_config": {"quant_method": "mxfp4"}}, "holds quantized weights (mxfp4)"),
                          ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
                           ": RoPE scaling 'yarn' lacks original_max_position_embeddings"),
                          ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                             "partial_rotary_factor": 0.5}},
                           ": partial_rotary_factor 0.5: llama's model rotates every pair")]:
        with pytest.raises(ConfigError, match="config.json" + ("" if named.startswith(":") else " ") + re.escape(named)):
            hf.model_args(variant("_".join(map(str, fields.values())), **fields), "checkpoint.load")
    # A vision-language folder: how to save its language model alone
    with pytest.raises(ConfigError, match=re.escape("(Qwen3.5's multimodal folder: save its language model with "
                                                    "transformers' Qwen3_5ForCausalLM, a qwen3_5_text folder)") + "$"):
        hf.model_args(variant("vision_language", model_type="qwen3_5"), "checkpoint.load")
    missing = variant("missing", sharded=True)
    shard = sorted(missing.glob("model-*.safetensors"))[-1]
    shard.unlink()
    assert one_line(*train, str(missing), "--data.vocab_size", "300") == (
        f"plait: error: checkpoint.load: {missing / 'model.safetensors.index.json'} lists 1 shard(s) that are not in "
        f"the folder: {shard.name}")
    # The trained BPE of the run (data.vocab_size 512) has more tokens than these models' 320 embeddings.
    assert one_line(*train, str(variant("small_vocab"))).startswith(
        "plait: error: data.tokenizer: has 512 tokens, more than the 320 embeddings of")
    # A folder's own tokenizer that its embedding cannot hold: found at start-up, and by generate.
    from plait.data.tokenizer import train_bpe

    big = variant("big_tokenizer")
    train_bpe([(ROOT / "README.md").read_text()], 400).save(str(big / "tokenizer.json"))
    assert one_line("train", "--training.steps", "1", "--checkpoint.load", str(big)).startswith(
        "plait: error: data.tokenizer: has 400 tokens, more than the 320 embeddings of")
    assert one_line("generate", "--checkpoint", str(big), "--prompt", "x") == (
        f"plait: error: checkpoint: {big}'s tokenizer has 400 tokens, more than the model's 320 embeddings")


def test_a_tied_model_refuses_pipeline_parallelism():
    line = one_line("train", *TINY, "--model.tie_embeddings", "--parallelism.pp", "2", "--nproc", "2")
    assert line.startswith("plait: error: parallelism.pp: the model ties its output layer to its embedding")


def test_plan_takes_a_folders_tokenizer_and_tokenizes_nothing(folders, tmp_path):
    """With the folder's own tokenizer (300 tokens, its embeddings 320) and no data option, plan
    predicts from shapes alone: no BPE is trained (the cache stays empty), no error about a
    vocabulary the run would never have."""
    import shutil

    from plait.data.tokenizer import train_bpe

    folder = tmp_path / "with_tokenizer"
    shutil.copytree(folders("tinyllama"), folder)
    train_bpe([(ROOT / "README.md").read_text()], 300).save(str(folder / "tokenizer.json"))
    cache = tmp_path / "cache"
    proc = plait_forked("plan", "--world", "2", "--device_memory_gib", "1", "--checkpoint.load", str(folder),
                        env={"PLAIT_CACHE": str(cache)})
    assert proc.returncode == 0 and "plan: best: " in proc.stdout, proc.stderr[-2000:]
    assert not cache.exists() or not list(cache.iterdir())


def test_plan_reads_the_model_of_a_hugging_face_folder(folders):
    """plait plan builds the folder's model (tied, llama3-scaled RoPE: its shape must hash) and
    plans it without a pipeline, which a tied model refuses."""
    proc = plait_forked("plan", "--world", "2", "--device_memory_gib", "1", "--checkpoint.load",
                        str(folders("llama3.2")), *TINY, "--data.vocab_size", "300")
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("dp_replicate=")]
    assert rows and "plan: best: " in proc.stdout and not any("pp=2" in row for row in rows)


def test_an_index_naming_files_outside_its_folder_is_refused(folders, tmp_path):
    """model.safetensors.index.json is data from disk: a weight_map naming an absolute path, ../, a
    sub-folder's file, a device or a folder is refused in one line before anything is opened (the
    rule of a checkpoint's manifest and DCP metadata). Shards that are links to plain files (the
    Hugging Face hub's cache is made of them) still load."""
    import shutil

    from plait.config import ConfigError
    from plait.hf.weights import INDEX, weight_files

    source = folders("tinyllama", True)
    outside = tmp_path / "outside.safetensors"
    shutil.copy(sorted(source.glob("model-*.safetensors"))[0], outside)
    for i, name in enumerate([str(outside), "../outside.safetensors", "sub/x.safetensors", "/dev/zero", "..", "a_folder"]):
        forged = tmp_path / f"forged-{i}"
        shutil.copytree(source, forged)
        (forged / "a_folder").mkdir()
        index = json.loads((forged / INDEX).read_text())
        index["weight_map"][next(iter(index["weight_map"]))] = name
        (forged / INDEX).write_text(json.dumps(index))
        with pytest.raises(ConfigError, match=re.escape(f"checkpoint.load: {forged / INDEX} names {name!r}, which is not a")):
            weight_files(forged, "checkpoint.load")
    linked = tmp_path / "linked"
    linked.mkdir()
    for f in source.iterdir():
        (linked / f.name).symlink_to(f)
    assert set(weight_files(linked, "checkpoint.load")) == set(json.loads((source / INDEX).read_text())["weight_map"])


def test_weights_the_model_does_not_use_are_refused_not_dropped(folders, tmp_path):
    """A tensor in the folder that the model of its config.json has no place for is refused in one
    line: loading the rest would train another model than the folder's. RoPE tables some older
    folders hold (transformers ignores them too; plait computes its own) are no weights."""
    import shutil

    from safetensors.torch import load_file, save_file

    from plait import hf
    from plait.config import ConfigError

    for extra, refused in (("model.layers.0.mlp.extra_proj.weight", True),
                           ("model.layers.0.self_attn.rotary_emb.inv_freq", False)):
        folder = tmp_path / extra
        shutil.copytree(folders("tinyllama"), folder)
        tensors = load_file(folder / "model.safetensors") | {extra: torch.ones(8)}
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        args = hf.model_args(folder, "checkpoint.load")
        if refused:
            with pytest.raises(ConfigError, match=re.escape(f"checkpoint.load: {folder} holds 1 tensor(s) that the "
                                                            f"model of its config.json does not use: ['{extra}']")):
                hf.HFWeights(folder, args, "checkpoint.load")
        else:
            hf.HFWeights(folder, args, "checkpoint.load")
