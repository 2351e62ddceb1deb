"""The names of the model flavors (plait/models/flavors.py holds their shapes), as the type an
option that takes one has: the CLI and a TOML config refuse any other name at start-up, listing
these. tests/test_config.py checks the two lists are one."""

from typing import Literal

Flavor = Literal["debug", "small", "llama3_1b", "llama3_8b", "llama3_70b", "llama3_405b", "debug_qwen3", "debug_qwen2",
                 "debug_olmo2", "debug_olmo3", "debug_gemma3", "debug_sliding", "qwen3_0_6b", "qwen2_5_0_5b",
                 "mistral_7b", "olmo2_1b", "olmo3_7b", "olmo3_32b", "gemma3_27b", "smollm3_3b", "debug_moe",
                 "debug_moe_sigmoid", "small_moe", "small_moe_dense", "qwen3_30b_a3b", "qwen3_235b_a22b",
                 "debug_gpt_oss", "gpt_oss_20b", "gpt_oss_120b", "debug_mla", "debug_glm4_moe", "glm4_5_air", "glm4_5",
                 "debug_llama4", "llama4_scout", "debug_hybrid", "debug_hybrid_moe", "qwen3_next_80b_a3b",
                 "qwen3_5_9b", "qwen3_5_35b_a3b", "debug_olmo_hybrid", "olmo_hybrid_7b",
                 "debug_kimi", "kimi_linear_48b_a3b",
                 "small_mla", "small_mla_gqa", "deepseek_v3_16b", "deepseek_v3_671b",
                 "kimi_k2_1t"]
ModelFlavor = Literal["auto", Flavor]
