"""What a Hugging Face config.json means by a field it leaves out: the default of transformers'
config class for its model_type (and, NULLABLE, by a field set to null), which differs by family
(OLMo 2's rms_norm_eps is 1e-5, Qwen3-MoE does not renormalise its top k, SmolLM3 is tied with
rope_theta 2e6). plait reads folders without transformers installed, so the defaults are written
down here; tests/test_families.py checks every entry against transformers' classes, so the table
cannot drift from them.
"""

# The fields plait fills in when left out. A family's table holds those its transformers config
# class has, with the class's default; a field it lacks is one that family does not have (None:
# off). A default of None is derived as transformers derives it: num_key_value_heads =
# num_attention_heads, head_dim = hidden_size // num_attention_heads, mlp_only_layers = [],
# no_rope_layers = every no_rope_layer_interval-th block without RoPE, layer_types = sliding from
# max_window_layers on (Qwen) or in the blocks without RoPE (SmolLM3), with use_sliding_window;
# every other block from the first (gpt-oss).
# Sizes that no rule derives (hidden_size, intermediate_size, layers, heads, vocabulary, experts)
# are not here: their default is one published checkpoint's, so a config.json without them is
# refused by name.
READ = ("hidden_act", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "max_position_embeddings",
        "tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window", "sliding_window",
        "max_window_layers", "layer_types",
        "no_rope_layers", "no_rope_layer_interval", "decoder_sparse_step", "mlp_only_layers", "num_experts_per_tok",
        "norm_topk_prob", "router_jitter_noise", "final_logit_softcapping", "attn_logit_softcapping", "swiglu_limit",
        "swiglu_alpha", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
        "n_shared_experts", "routed_scaling_factor", "n_group", "topk_group", "first_k_dense_replace", "rope_interleave",
        "use_qk_norm", "hidden_activation", "query_pre_attn_scalar", "interleave_moe_layer_step", "moe_layers",
        "attn_temperature_tuning", "attn_scale", "floor_scale", "attention_chunk_size", "linear_conv_kernel_dim",
        "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads",
        "linear_allow_neg_eigval", "linear_a_log_min", "linear_a_log_max", "linear_dt_min", "linear_dt_max",
        "linear_dt_init_floor", "linear_num_heads", "linear_head_dim", "mlp_layer_types")

COMMON = {"hidden_act": "silu", "num_key_value_heads": None, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
          "tie_word_embeddings": False}
# (Qwen's sliding_window only counts with use_sliding_window.)
QWEN = {"num_key_value_heads": 32, "max_position_embeddings": 32768, "use_sliding_window": False,
        "sliding_window": 4096}
QWEN_DENSE = {"max_window_layers": 28, "layer_types": None}
# Qwen3-Next's and Qwen3.5's (their linear attention's sizes are one model's: Qwen3-Next-80B-A3B's)
QWEN_HYBRID = COMMON | {"head_dim": 256, "max_position_embeddings": 32768, "attention_bias": False, "layer_types": None,
                        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                        "linear_num_key_heads": 16, "linear_num_value_heads": 32}

DEFAULTS = {
    "llama": COMMON | {"head_dim": None, "max_position_embeddings": 2048, "attention_bias": False, "mlp_bias": False},
    "mistral": COMMON | {"num_key_value_heads": 8, "head_dim": None, "max_position_embeddings": 131072,
                         "sliding_window": 4096},
    "qwen2": COMMON | QWEN | QWEN_DENSE,
    "qwen3": COMMON | QWEN | QWEN_DENSE | {"head_dim": 128, "attention_bias": False},
    "olmo2": COMMON | {"rms_norm_eps": 1e-5, "max_position_embeddings": 2048, "attention_bias": False},
    "olmo3": COMMON | {"rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 2048,
                       "attention_bias": False, "sliding_window": 4096, "layer_types": None},
    "smollm3": COMMON | {"num_key_value_heads": 4, "rope_theta": 2000000.0, "max_position_embeddings": 32768,
                         "tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False,
                         "use_sliding_window": False, "sliding_window": None, "layer_types": None, "no_rope_layers": None,
                         "no_rope_layer_interval": 4},
    "qwen3_moe": COMMON | QWEN | {"num_key_value_heads": 4, "attention_bias": False, "decoder_sparse_step": 1,
                                  "mlp_only_layers": None, "num_experts_per_tok": 8, "norm_topk_prob": False},
    "gpt_oss": COMMON | {"num_key_value_heads": 8, "head_dim": 64, "rms_norm_eps": 1e-5, "rope_theta": 150000.0,
                         "max_position_embeddings": 131072, "attention_bias": True, "sliding_window": 128,
                         "layer_types": None, "num_experts_per_tok": 4, "swiglu_limit": 7.0, "swiglu_alpha": 1.702},
    "deepseek_v3": COMMON | {"num_key_value_heads": 128, "max_position_embeddings": 4096,
                             "attention_bias": False, "num_experts_per_tok": 8, "norm_topk_prob": True,
                             "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                             "v_head_dim": 128, "n_shared_experts": 1, "routed_scaling_factor": 2.5, "n_group": 8,
                             "topk_group": 4, "first_k_dense_replace": 3, "rope_interleave": True},
    "glm4_moe": COMMON | {"num_key_value_heads": 8, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
                          "attention_bias": False, "num_experts_per_tok": 8, "norm_topk_prob": True,
                          "n_shared_experts": 1, "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1,
                          "first_k_dense_replace": 1, "use_qk_norm": False},
    "gemma3_text": {"hidden_activation": "gelu_pytorch_tanh", "num_key_value_heads": 4, "head_dim": 256,
                    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 131072,
                    "tie_word_embeddings": True, "attention_bias": False, "sliding_window": 4096, "layer_types": None,
                    "final_logit_softcapping": None, "attn_logit_softcapping": None, "query_pre_attn_scalar": 256},
    "llama4_text": COMMON | {"num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
                             "max_position_embeddings": 131072, "attention_bias": False, "num_experts_per_tok": 1,
                             "router_jitter_noise": 0.0, "layer_types": None, "no_rope_layers": None,
                             "no_rope_layer_interval": 4, "use_qk_norm": True, "interleave_moe_layer_step": 1,
                             "moe_layers": None, "attn_temperature_tuning": True, "attn_scale": 0.1,
                             "floor_scale": 8192, "attention_chunk_size": 8192},
    "qwen3_next": QWEN_HYBRID | {"num_key_value_heads": 2, "decoder_sparse_step": 1, "mlp_only_layers": None,
                                 "num_experts_per_tok": 10, "norm_topk_prob": True},
    "qwen3_5_text": QWEN_HYBRID | {"num_key_value_heads": 4},
    "qwen3_5_moe_text": QWEN_HYBRID | {"num_key_value_heads": 2, "num_experts_per_tok": 8},
    # (its linear heads and sizes: None, derived from the attention heads and the width)
    "olmo_hybrid": COMMON | {"max_position_embeddings": 65536, "attention_bias": False, "layer_types": None,
                             "linear_num_key_heads": None, "linear_num_value_heads": None, "linear_key_head_dim": None,
                             "linear_value_head_dim": None, "linear_conv_kernel_dim": 4,
                             "linear_allow_neg_eigval": True, "linear_a_log_min": 0.0, "linear_a_log_max": 16.0,
                             "linear_dt_min": 0.001, "linear_dt_max": 0.1, "linear_dt_init_floor": 1e-4},
    # (its expert fields by the class's names; config.json may use the attribute map's: plait/hf/kimi.py)
    "kimi_linear": COMMON | {"num_key_value_heads": 32, "rms_norm_eps": 1e-5, "max_position_embeddings": 1048576,
                             "attention_bias": False, "num_experts_per_tok": 8, "norm_topk_prob": True,
                             "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
                             "qk_rope_head_dim": 64, "v_head_dim": 128, "n_shared_experts": 1,
                             "routed_scaling_factor": 2.446, "n_group": 1, "topk_group": 1, "layer_types": None,
                             "mlp_layer_types": None, "linear_conv_kernel_dim": 4, "linear_num_heads": 32,
                             "linear_head_dim": 128},
    "mixtral": COMMON | {"num_key_value_heads": 8, "head_dim": None, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0,
                         "max_position_embeddings": 131072, "sliding_window": None, "num_experts_per_tok": 2,
                         "router_jitter_noise": 0.0},
}


# The RoPE scaling a family's config class gives a config.json that sets neither rope_scaling nor
# rope_parameters (gpt-oss: YaRN, 32x an original 4096, untruncated).
ROPE_SCALING = {"gpt_oss": {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                            "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}}

# The fields whose null a family's config class takes (typed `X | None`) and its model runs on:
# null there is unset, derived as above or off (norm_topk_prob, rope_interleave: false; q_lora_rank:
# one query projection; sliding_window: no window). Null anywhere else is refused (plait/hf/fields.py):
# transformers refuses it, or fails on it (gpt-oss's sliding_window; DeepSeek-V3's num_experts_per_tok,
# v_head_dim, n_group, topk_group, first_k_dense_replace). tests/test_families.py checks the table
# against transformers' classes. (rope_scaling and rope_parameters: null is left out in every family.)
QWEN_NULLABLE = {"num_key_value_heads", "sliding_window", "layer_types"}
NULLABLE = {
    "llama": {"num_key_value_heads", "head_dim"}, "mistral": {"head_dim", "sliding_window"},
    "qwen2": QWEN_NULLABLE, "qwen3": QWEN_NULLABLE, "olmo2": {"num_key_value_heads"},
    "olmo3": {"num_key_value_heads", "layer_types"},
    "smollm3": QWEN_NULLABLE | {"no_rope_layers"}, "qwen3_moe": {"sliding_window", "mlp_only_layers"},
    "gpt_oss": {"layer_types"},
    "deepseek_v3": {"num_key_value_heads", "norm_topk_prob", "q_lora_rank", "rope_interleave"},
    "glm4_moe": set(), "llama4_text": {"moe_layers", "no_rope_layers", "layer_types"},
    "gemma3_text": {"layer_types", "final_logit_softcapping", "attn_logit_softcapping"},
    "mixtral": {"head_dim", "sliding_window"}, "qwen3_next": {"mlp_only_layers", "layer_types"},
    "qwen3_5_text": {"layer_types"}, "qwen3_5_moe_text": {"layer_types"},
    "kimi_linear": {"num_key_value_heads", "q_lora_rank", "layer_types", "mlp_layer_types"},
    "olmo_hybrid": {"num_key_value_heads", "layer_types", "linear_num_key_heads", "linear_num_value_heads",
                    "linear_key_head_dim", "linear_value_head_dim"},
}
