"""The generated proofs (plait/proof/fuzz), each with a fixed seed and a fixed budget of cases
(about a minute each on the slower CPU kind), the cases that once failed pinned and run first.
A failure prints the shrunk case and how to reproduce it; long runs:
`python -m plait.proof.fuzz NAME --examples N --seed S`."""

import pytest

pytest.importorskip("hypothesis")


def prove(name: str, examples: int, expected: set[str], generator=None):
    from plait.proof.fuzz import run

    module = __import__(f"plait.proof.fuzz.{name}", fromlist=["GENERATOR"])
    outcomes = run(generator or module.GENERATOR, examples, seed_value=2026)
    print(f"\nfuzz {name}: {dict(outcomes)}")
    # (the budget is spent on cases that reach plait's code, not only on refusals; an outcome is
    # named by its start: "(fp32)" or "(low)" after it is the precision the CPU's auto picked)
    assert all(any(o.startswith(e) for o in outcomes) for e in expected), outcomes
    return outcomes


# Cases per family: DeepSeek-V3 has the most fields (latent attention, groups, RoPE scalings its
# softmax scale reads), gpt-oss the next (sinks, windows, its default YaRN), then OLMo 3 (windows,
# RoPE by layer type), Gemma 3 (the same, and its norms, scales and GeGLU), GLM-4.5 (DeepSeek-V3's
# router, RoPE on part of each head), Llama 4 (its router, blocks without RoPE, temperature, chunks) and
# Qwen3-Next (linear-attention blocks and their heads, gates, experts or none, a quarter of each head rotated);
# Qwen3.5's two share its code but their tensors on disk; OLMo hybrid (its linear heads and sizes derived
# or given, RoPE or none, the step doubled or not); Kimi Linear (its kinds of block and of feed-forward,
# latent attention's sizes, the router). (A hybrid's case costs ~1.5 s: transformers' rule.)
FAMILY_BUDGET = {"deepseek_v3": 60, "gpt_oss": 20, "llama": 10, "mistral": 10, "qwen2": 10, "qwen3": 10, "olmo2": 10,
                 "olmo3": 20, "glm4_moe": 20, "gemma3_text": 20, "llama4_text": 20, "smollm3": 10, "qwen3_moe": 10,
                 "mixtral": 10, "qwen3_next": 12, "qwen3_5_text": 6, "qwen3_5_moe_text": 6, "olmo_hybrid": 10,
                 "kimi_linear": 10}


@pytest.mark.parametrize("family", FAMILY_BUDGET)
def test_hugging_face_configs_equal_transformers_or_are_refused_in_one_line(family):
    pytest.importorskip("transformers")
    from plait.proof.fuzz.hf_configs import family_generator

    prove("hf_configs", FAMILY_BUDGET[family], {"equal"}, family_generator(family))


def test_every_file_plait_reads_mutated_gives_its_result_or_one_line():
    prove("files", 120, {"same output", "refused"})


def test_every_train_option_near_and_past_its_limits_is_accepted_or_refused_in_one_line():
    from plait.proof.fuzz.options import STARTUP

    prove("options", 150, {"accepted", "refused"}, STARTUP)


def test_a_job_the_start_up_accepts_trains_at_its_one_device_reference_s_loss():
    # (each case trains two steps twice: the pinned cases and two generated ones)
    prove("options", 2, {"trained at the reference's loss"})


def test_a_run_stopped_anywhere_and_resumed_equals_the_run_uninterrupted():
    # (each case is two or three runs of one or two ranks, a minute here: CI runs the pinned case,
    # two replica groups restarted from a save; long runs: `python -m plait.proof.fuzz restart`)
    prove("restart", 0, {"bitwise (interval)", "refused at start-up"})
