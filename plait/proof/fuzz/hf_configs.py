"""Hugging Face config.json files against transformers, generated: for every model_type plait
reads, each field of transformers' config class left out, null, or one of its legal values (every
RoPE type transformers defines, windows and layer_types patterns, router options, ties, biases,
norms). transformers reads the folder and builds a tiny random model (fp32); plait reads the same
folder as `plait train --checkpoint.load` does. Property: plait's logits equal transformers' (fp32,
<= 1e-5 over a batch longer than any window) and plait's export, re-read by transformers, equals
both; or plait refuses in one line that names a field. Never a traceback, never accepted-and-
different. A config.json transformers itself cannot run is skipped and counted.
"""

from __future__ import annotations

import inspect
import json
import logging
import tempfile
import warnings
from functools import cache
from pathlib import Path

import torch
from hypothesis import strategies as st

from plait.config import ConfigError
from plait.hf.hybrid import HYBRIDS, QWEN_HYBRIDS
from plait.hf.rope_fields import LAYERED
from plait.proof.fuzz import Counterexample, Generator

VOCAB, SEQ = 320, 40  # (windows are at most 16 keys, attention chunks of 8 or 24 cut it or 8192 not)
LOGITS_BOUND = 1e-5  # fp32, as tests/test_families.py: measured <= 5e-7, other kernel orders
EXPERTS = {"qwen3_moe": "num_experts", "mixtral": "num_local_experts", "gpt_oss": "num_local_experts",
           "deepseek_v3": "n_routed_experts", "glm4_moe": "n_routed_experts", "llama4_text": "num_local_experts",
           "qwen3_next": "num_experts", "qwen3_5_moe_text": "num_experts", "kimi_linear": "num_local_experts"}
ABSENT = object()  # a field left out of config.json


def optional(values: st.SearchStrategy, nullable: bool = True) -> st.SearchStrategy:
    """A field left out, null, or a legal value."""
    return st.one_of(st.just(ABSENT), *([st.none()] if nullable else []), values)


@st.composite
def rope(draw, head_dim: int) -> dict:
    """A RoPE object of any type transformers defines, each optional field in or out."""
    # (the types plait implements twice as often as those it refuses: most cases should reach a model)
    kind = draw(st.sampled_from(["default", "linear", "linear", "yarn", "yarn", "llama3", "llama3", "dynamic",
                                 "longrope"]))
    fields = {"rope_type": kind, "rope_theta": draw(st.sampled_from([10000.0, 500000.0, 100.0]))}
    original = draw(st.sampled_from([8, 16, 32]))
    if kind in ("linear", "dynamic", "yarn", "llama3"):
        fields["factor"] = draw(st.sampled_from([2.0, 4.0, 8.0]))
    if kind == "yarn":
        fields["original_max_position_embeddings"] = original
        for name, values in {"attention_factor": [1.0, 1.3], "beta_fast": [32.0, 8.0], "beta_slow": [1.0, 2.0],
                             "mscale": [1.0, 0.5], "mscale_all_dim": [0.0, 1.0, 0.707], "truncate": [True, False]}.items():
            value = draw(optional(st.sampled_from(values)))
            if value is not ABSENT:
                fields[name] = value
    if kind == "llama3":
        fields |= {"low_freq_factor": draw(st.sampled_from([1.0, 2.0])), "high_freq_factor": 4.0,
                   "original_max_position_embeddings": original}
    if kind == "longrope":
        half = head_dim // 2
        fields |= {"short_factor": [1.0] * half, "long_factor": [float(1 + i % 3) for i in range(half)],
                   "original_max_position_embeddings": original}
    if kind != "yarn" and draw(st.booleans()):  # (DeepSeek-V3's softmax scale reads it under any type)
        fields["mscale_all_dim"] = draw(st.sampled_from([0.0, 1.0, 0.707]))
    if draw(st.integers(0, 5)) == 0:
        fields["partial_rotary_factor"] = draw(st.sampled_from([1.0, 0.5]))
    return fields


@st.composite
def configs(draw, families: tuple[str, ...] | None = None) -> dict:
    """A config.json: the sizes (small, always given), then every other field the family's
    transformers config class has, each out, null or legal."""
    from plait.hf.config import FAMILIES

    family = draw(st.sampled_from(families or tuple(FAMILIES)))
    heads = draw(st.sampled_from([2, 4, 8]))  # (8: the default key/value heads of some families divide it)
    layers = draw(st.integers(1, 4))
    config = {"model_type": family, "architectures": [FAMILIES[family]], "vocab_size": VOCAB,
              "hidden_size": draw(st.sampled_from([32, 64])), "intermediate_size": draw(st.sampled_from([24, 48])),
              "num_hidden_layers": layers, "num_attention_heads": heads, "eos_token_id": 0, "pad_token_id": None}
    head_dim = draw(st.sampled_from([8, 16]))
    grouped = family in ("deepseek_v3", "glm4_moe", "kimi_linear")  # (DeepSeek-V3's router: groups of >= 2 experts)
    experts = draw(st.sampled_from([4, 8] if grouped else [2, 4, 8]))
    if family in EXPERTS:  # (sizes: a default is one published model's, hundreds of experts)
        config |= {EXPERTS[family]: experts, "moe_intermediate_size": draw(st.sampled_from([16, 32]))}
    if grouped:  # (their defaults, 128 or 8 key heads and 8 experts a token, fit no small model)
        config |= {"num_key_value_heads": heads if family == "deepseek_v3" else draw(st.sampled_from([1, heads])),
                   "num_experts_per_tok": draw(st.integers(1, 2))}
    if family == "llama4_text":  # (its dense blocks' size, which no default fits)
        config["intermediate_size_mlp"] = draw(st.sampled_from([32, 64]))
    if family == "qwen3_next":  # (a dense one too)
        config[EXPERTS[family]] = draw(st.sampled_from([0, experts]))
    if family in ("qwen3_next", "qwen3_5_moe_text"):  # (a shared expert 1 or 2 experts wide, as plait holds it)
        config["shared_expert_intermediate_size"] = config["moe_intermediate_size"] * draw(st.integers(1, 2))
    # (their defaults, 2-8 key heads of 128 or 256, fit no small model)
    if family in ("gemma3_text", "llama4_text", *QWEN_HYBRIDS):
        config |= {"num_key_value_heads": draw(st.sampled_from([k for k in (1, 2, 4) if heads % k == 0])),
                   "head_dim": head_dim}
    groups = draw(st.sampled_from([g for g in (1, 2, 4) if experts % g == 0 and experts // g >= 2]))
    kinds = ["linear_attention" if family in HYBRIDS else "sliding_attention", "full_attention"]
    layer_list = st.lists(st.sampled_from(kinds), min_size=layers, max_size=layers)
    legal = {
        "num_key_value_heads": st.sampled_from([k for k in (1, 2, 4) if heads % k == 0]),
        "head_dim": st.just(head_dim), "hidden_act": st.sampled_from(["silu", "silu", "silu", "gelu"]),
        "max_position_embeddings": st.sampled_from([64, 4096]), "rms_norm_eps": st.sampled_from([1e-6, 1e-5, 0.1]),
        "tie_word_embeddings": st.booleans(), "attention_bias": st.booleans(), "mlp_bias": st.booleans(),
        "pretraining_tp": st.sampled_from([1, 2]), "attention_dropout": st.sampled_from([0.0, 0.1]),
        "use_sliding_window": st.booleans(), "sliding_window": st.integers(1, 16),
        "max_window_layers": st.integers(0, layers), "layer_types": layer_list,
        "no_rope_layers": st.lists(st.sampled_from([0, 1]), min_size=layers, max_size=layers),
        "no_rope_layer_interval": st.integers(1, 4),
        "num_experts_per_tok": st.integers(1, min(experts, 4)),
        "decoder_sparse_step": st.integers(1, 3),
        "mlp_only_layers": st.lists(st.integers(0, layers - 1), unique=True, max_size=layers),
        "norm_topk_prob": st.booleans(), "router_jitter_noise": st.sampled_from([0.0, 0.1]),
        "swiglu_limit": st.sampled_from([7.0, 1.0]), "swiglu_alpha": st.sampled_from([1.702, 1.0]),
        "q_lora_rank": st.sampled_from([16, 32]), "kv_lora_rank": st.sampled_from([16, 32]),
        "qk_nope_head_dim": st.sampled_from([8, 16]), "qk_rope_head_dim": st.sampled_from([4, 8]),
        "v_head_dim": st.sampled_from([8, 24]), "n_shared_experts": st.integers(0, 2),
        "routed_scaling_factor": st.sampled_from([1.0, 2.5]), "n_group": st.just(groups),
        "topk_group": st.integers(1, groups), "first_k_dense_replace": st.integers(0, layers),
        "rope_interleave": st.sampled_from([True, True, True, False]), "use_qk_norm": st.booleans(),
        "hidden_activation": st.sampled_from(["gelu_pytorch_tanh"] * 3 + ["silu"]),
        "query_pre_attn_scalar": st.sampled_from([8, 16, 24]), "use_bidirectional_attention": st.just(False),
        "final_logit_softcapping": st.sampled_from([None, None, 30.0]),
        "attn_logit_softcapping": st.sampled_from([None, None, 50.0]),
        "interleave_moe_layer_step": st.integers(1, 2),
        "moe_layers": st.lists(st.integers(0, layers - 1), unique=True, max_size=layers),
        "attn_temperature_tuning": st.booleans(), "attn_scale": st.sampled_from([0.1, 0.5]),
        "floor_scale": st.sampled_from([4, 16, 8192]), "attention_chunk_size": st.sampled_from([8, 24, 8192]),
        "linear_conv_kernel_dim": st.integers(2, 4), "linear_key_head_dim": st.sampled_from([8, 16]),
        "linear_value_head_dim": st.sampled_from([8, 16]), "linear_num_key_heads": st.sampled_from([1, 2]),
        "linear_num_value_heads": st.sampled_from([2, 4]), "linear_allow_neg_eigval": st.booleans(),
        "linear_a_log_min": st.sampled_from([0.0, 1.0]), "linear_dt_min": st.sampled_from([0.001, 0.01]),
        "linear_num_heads": st.sampled_from([1, 2]), "linear_head_dim": st.sampled_from([8, 16]),
        "mlp_layer_types": st.lists(st.sampled_from(["dense", "sparse"]), min_size=layers, max_size=layers),
    }
    nullable = nullable_fields(family)
    for name in class_fields(family):
        if name in legal and name not in config:
            # (a null that plait refuses, drawn once in three cases, would refuse most DeepSeek-V3s)
            value = draw(optional(legal[name], nullable=name in nullable and name not in RARELY_NULL or
                                  name in RARELY_NULL and draw(st.integers(0, 5)) == 0))
            if value is not ABSENT:
                config[name] = value
    rotated = "qk_rope_head_dim" if family == "deepseek_v3" else "head_dim"
    rope_head = config.get(rotated, class_default(family, rotated)) or config["hidden_size"] // heads
    # (an object twice as often as none: most of what can go wrong is in one)
    layout = draw(st.sampled_from(["absent", "null", "rope_parameters", "rope_parameters", "rope_scaling",
                                   "rope_scaling"]))
    if layout == "null":
        config[draw(st.sampled_from(["rope_parameters", "rope_scaling"]))] = None
    elif layout == "rope_parameters" and family in LAYERED:  # (an object per layer type, either left out)
        kinds = draw(st.sets(st.sampled_from(["full_attention", "sliding_attention"])))
        config[layout] = {kind: draw(rope(rope_head)) for kind in sorted(kinds)}
    elif layout != "absent":
        config[layout] = draw(rope(rope_head))
        if layout == "rope_scaling":  # (the classic layout: rope_theta beside it)
            config["rope_theta"] = config[layout].pop("rope_theta")
    return config


@cache
def class_fields(family: str) -> tuple[str, ...]:
    """The fields transformers' config class for `family` takes."""
    import transformers

    parameters = inspect.signature(transformers.CONFIG_MAPPING[family].__init__).parameters
    return tuple(name for name in parameters if name not in ("self", "kwargs"))


@cache
def nullable_fields(family: str) -> frozenset[str]:
    """The fields the family's config class types `X | None` (a null elsewhere it refuses: a case
    transformers cannot run, which teaches nothing)."""
    import dataclasses

    import transformers

    typed = {f.name for f in dataclasses.fields(transformers.CONFIG_MAPPING[family]) if "None" in str(f.type)}
    return frozenset(typed - FAILS_ON_NULL.get(family, set()))


RARELY_NULL = {"rope_interleave"}
# Fields typed `X | None` whose null transformers' model then fails on (tests/test_families.py's
# table of nulls checks plait refuses them): cases spent on them are skipped, so none are drawn.
FAILS_ON_NULL = {"gpt_oss": {"sliding_window"}, "olmo3": {"sliding_window"},
                 "gemma3_text": {"sliding_window", "attention_dropout"}, "llama4_text": {"attention_chunk_size"},
                 "deepseek_v3": {"num_experts_per_tok", "v_head_dim", "n_group", "topk_group", "first_k_dense_replace",
                                 "qk_nope_head_dim", "qk_rope_head_dim", "kv_lora_rank"}}


def class_default(family: str, name: str):
    import transformers

    parameter = inspect.signature(transformers.CONFIG_MAPPING[family].__init__).parameters.get(name)
    return None if parameter is None else parameter.default


@cache
def tokenizer_json() -> str:
    from plait.data.tokenizer import train_bpe

    return train_bpe(["plait trains language models under every parallel layout. " * 8] * 4, 300).to_str()


def transformers_model(folder: Path):
    """transformers' model of the folder's config.json, its weights drawn at random (biases and
    norm weights away from 0 and 1, so that one mapped to the wrong place shows), saved in the
    folder; None if transformers cannot build or run it."""
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(folder)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
        with torch.no_grad():
            for name, p in [*model.named_parameters(), *model.named_buffers()]:
                if name.endswith(("bias", "sinks")):
                    p.normal_(0, 0.5 if "correction" not in name else 0.1)
                elif "norm" in name:  # (Gemma's and the Qwen hybrids' norms' gains are 1 + weight)
                    p.uniform_(0.5, 1.5).sub_(1 if config.model_type in ("gemma3_text", *QWEN_HYBRIDS) else 0)
            logits = model(batch(), use_cache=False).logits  # (a cache of linear blocks alone fails in it)
    except Exception:  # noqa: BLE001 (any failure of transformers' own: the case is not a model)
        return None, None
    raw = (folder / "config.json").read_text()
    model.save_pretrained(folder)
    (folder / "config.json").write_text(raw)  # (what plait reads is the generated file, not transformers' rewrite)
    return model, logits


def batch() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))


def plait_model(folder: Path):
    """The model `plait train --checkpoint.load FOLDER` builds: the model decided from the folder,
    its tokenizer, its weights checked and filled in."""
    from tokenizers import Tokenizer

    from plait import hf
    from plait.arguments import parse_args
    from plait.start_folder import job_tokenizer
    from plait.job_model import job_model
    from plait.models.transformer import Transformer
    from plait.models.weights import fill_weights

    cfg = parse_args(["--checkpoint.load", str(folder)])
    args = job_model(cfg, Tokenizer.from_file(job_tokenizer(cfg)).get_vocab_size())
    hf.check(folder, args, "checkpoint.load")
    weights = hf.HFWeights(folder, args, "checkpoint.load")
    model = Transformer(args)
    fill_weights(model, lambda name, shape: weights[name], weights.buffers)
    return model.eval()


def exported(model, folder: Path, out: Path):
    """transformers' model of plait's export of `model` (as `plait export` writes it)."""
    import transformers

    from plait.hf.config import hf_config
    from plait.hf.weights import write_weights

    source = json.loads((folder / "config.json").read_text())
    write_weights(model.state_dict(), model.args, out, torch.float32, 1 << 30)
    (out / "config.json").write_text(json.dumps(hf_config(model.args, torch.float32, None, 0, source=source)))
    theirs, loading = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    if any(loading.values()):
        raise Counterexample(f"transformers loads plait's export with {loading}")
    return theirs.eval()


def check(config: dict) -> str:
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings(), quiet():
        warnings.simplefilter("ignore")
        folder, out = Path(tmp) / "in", Path(tmp) / "out"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
        (folder / "tokenizer.json").write_text(tokenizer_json())
        theirs, logits = transformers_model(folder)
        if theirs is None:
            return "skipped: transformers cannot run it"
        case = f"config.json {json.dumps(config)}"
        try:
            ours = plait_model(folder)
        except ConfigError as e:
            refusal = str(e)
            if "\n" in refusal or not names_a_field(refusal, config):
                raise Counterexample(f"refused, but not in one line naming a field: {refusal!r}; {case}") from None
            return "refused"
        except Exception as e:
            raise Counterexample(f"{type(e).__name__}: {e}; {case}") from e
        with torch.no_grad():
            diff = (ours(batch()) - logits).abs().max().item()
            if not diff <= LOGITS_BOUND:
                raise Counterexample(f"accepted and different: max |logits - transformers'| {diff:.3g}; {case}")
            again = (exported(ours, folder, out)(batch(), use_cache=False).logits - logits).abs().max().item()
            if not again <= LOGITS_BOUND:
                raise Counterexample(f"export re-read by transformers differs by {again:.3g}; {case}")
    return "equal"


def names_a_field(refusal: str, config: dict) -> bool:
    """Whether `refusal` names a field of the config.json or its family's (one left out is its default)."""
    def fields(table: dict) -> set[str]:  # (its objects' too: RoPE by layer type nests two deep)
        return set(table) | {k for v in table.values() if isinstance(v, dict) for k in fields(v)}

    names = fields(config) | set(class_fields(config["model_type"]))
    return any(name in refusal for name in names)


class quiet:
    """transformers' and torch's log lines off while a case runs (thousands of cases)."""

    def __enter__(self):
        self.level = logging.getLogger("transformers").level
        logging.getLogger("transformers").setLevel(logging.ERROR)

    def __exit__(self, *exc):
        logging.getLogger("transformers").setLevel(self.level)


def sized(family: str, **fields) -> dict:
    """A pinned case: the smallest sizes the strategy draws, and `fields`."""
    from plait.hf.config import FAMILIES

    return {"model_type": family, "architectures": [FAMILIES[family]], "vocab_size": VOCAB, "hidden_size": 32,
            "intermediate_size": 24, "num_hidden_layers": 1, "num_attention_heads": 2, "eos_token_id": 0,
            "pad_token_id": None, **fields}


# The cases this generator once failed on (each fixed with it), run first every time.
PINNED = [
    # a window in no block (every block below max_window_layers): the export failed (ValueError)
    sized("qwen3", num_key_value_heads=None, use_sliding_window=True),
    # a RoPE type plait does not implement: refused without naming the field
    sized("llama", rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
                                    "long_factor": [1.0, 2.0, 3.0] * 2 + [1.0, 2.0],
                                    "original_max_position_embeddings": 8}),
    # SmolLM3 naming sliding blocks with use_sliding_window false: plait did not slide, transformers' sdpa does
    sized("smollm3", num_key_value_heads=None, sliding_window=1, layer_types=["sliding_attention"]),
    # no shared expert: transformers builds them 0 wide; read as none, then refused by the export
    sized("deepseek_v3", n_routed_experts=2, moe_intermediate_size=16, n_shared_experts=0, n_group=1, topk_group=1,
          num_experts_per_tok=1, first_k_dense_replace=0),
    # values wider than queries and keys (v_head_dim 128 > 8 + 64): SDPA's padding cut them (RuntimeError)
    sized("deepseek_v3", n_routed_experts=2, moe_intermediate_size=16, qk_nope_head_dim=8, n_group=1),
    # no block slides (layer_types): exported with a null window, which transformers' gpt-oss fails on
    sized("gpt_oss", num_local_experts=2, moe_intermediate_size=16, num_key_value_heads=1, num_experts_per_tok=1,
          layer_types=["full_attention"]),
    # a Mixtral with YaRN exported with head_dim null, which transformers' YaRN multiplies (TypeError)
    sized("mixtral", num_local_experts=2, moe_intermediate_size=16, num_key_value_heads=1, head_dim=16,
          rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0,
                           "original_max_position_embeddings": 8}),
    # DeepSeek-V3's default 8 groups for 2 experts: refused naming fields left out (their defaults)
    sized("deepseek_v3", n_routed_experts=2, moe_intermediate_size=16),
    # Kimi Linear saying tie_word_embeddings true, which its transformers class does not tie: read tied
    # (logits 1.6 apart); dense blocks after sparse ones: exported by mlp_layer_types, not refused
    sized("kimi_linear", num_local_experts=2, moe_intermediate_size=16, num_experts_per_tok=1, kv_lora_rank=16,
          q_lora_rank=16, qk_rope_head_dim=4, v_head_dim=8, tie_word_embeddings=True, num_hidden_layers=2,
          mlp_layer_types=["sparse", "dense"], layer_types=["linear_attention", "full_attention"],
          linear_head_dim=8, linear_num_heads=2),
]
GENERATOR = Generator(configs(), check, PINNED)


def family_generator(family: str) -> Generator:
    """The generator over one family's config.json files (CI gives each family its own budget)."""
    return Generator(configs((family,)), check, [case for case in PINNED if case["model_type"] == family])
