"""The named model shapes (flavors): Llama 3's sizes, the small sizes of its relatives, and tiny
ones for tests. Plain data: the model is built from it in plait/models/.
"""

from __future__ import annotations

import math
from dataclasses import replace

from plait.models.args import ModelArgs

GPT_OSS_YARN = {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                "beta_slow": 1.0, "truncate": False}
DEEPSEEK_YARN = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                 "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
# OLMo 3's switches: OLMo 2's norms, three 4096-key sliding blocks to one full one, YaRN (8x an
# original 8192) on the full blocks alone
OLMO3 = dict(norm_eps=1e-6, max_seq_len=65536, qk_norm="projection", post_norm=True, sliding_window=4096,
             full_layers=tuple(range(3, 32, 4)), rope_theta=500000.0, local_rope_theta=500000.0, family="olmo3",
             rope_scaling={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192,
                           "attention_factor": 1.2079441541679836, "beta_fast": 32.0, "beta_slow": 1.0})
# GLM-4.5's switches, both sizes: half of each 128-entry head rotated, biases on q/k/v, 8 of the
# experts and a shared one, one MTP module
GLM4_5 = dict(vocab_size=151552, norm_eps=1e-5, rope_theta=1000000.0, max_seq_len=131072, rotary_dim=64,
              qkv_bias=True, top_k=8, n_shared_experts=1, router="sigmoid", mtp_layers=1, family="glm4_moe")
# Gemma 3's switches: norms around each sub-layer, zero-centred, the embedding scaled, GeGLU, q/k norms
GEMMA3 = dict(qk_norm="head", sandwich_norm=True, zero_centered_norms=True, embed_scale=True, activation="gelu_tanh",
              family="gemma3_text")
# Llama 4's switches
LLAMA4 = dict(norm_eps=1e-5, rope_theta=500000.0, n_shared_experts=1, router="sigmoid", balance_bias=False,
              normalize_top_k=False, route_inputs=True, qk_norm="l2", nope_temperature=0.5, attention_chunk=8192,
              rope_scaling={"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                            "original_max_position_embeddings": 8192}, family="llama4_text")
# Qwen3-Next's switches; the test sizes' heads (2 key heads of 16 to 4 value heads of 16)
QWEN3_NEXT = dict(norm_eps=1e-6, head_dim=32, rotary_dim=8, qk_norm="head", zero_centered_norms=True,
                  attention_gate=True, linear_layers=(0,), linear_key_heads=2, linear_value_heads=4,
                  linear_key_dim=16, linear_value_dim=16, family="qwen3_next")
QWEN3_NEXT_MOE = QWEN3_NEXT | dict(n_shared_experts=1, shared_expert_gate=True)
# OLMo hybrid's: OLMo 3's attention blocks, linear blocks that norm their inputs, the step doubled, Mamba's init
OLMO_HYBRID = dict(qk_norm="projection", post_norm=True, linear_norm_eps=1e-5, linear_negative_eigenvalues=True,
                   linear_a_init=(0.0, 16.0), linear_dt_init=(0.001, 0.1, 1e-4), family="olmo_hybrid")
# Qwen3.5's: Qwen3-Next's block, its real linear-attention sizes (16 key heads of 128 to 32 value heads)
QWEN3_5 = QWEN3_NEXT | dict(head_dim=256, rotary_dim=64, linear_layers=tuple(i for i in range(32) if i % 4 != 3),
                            linear_key_heads=16, linear_value_heads=32, linear_key_dim=128, linear_value_dim=128,
                            family="qwen3_5_text")
# Kimi Linear's: Kimi Delta Attention (gates per key channel, through bottlenecks; Mamba's init) among
# latent attention blocks without RoPE, DeepSeek-V3's router with a shared expert, the first block dense
KIMI_LINEAR = dict(linear_channel_gates=True, linear_a_init=(1.0, 16.0), linear_dt_init=(0.001, 0.1, 1e-4),
                   router="sigmoid", n_shared_experts=1, route_scale=2.446, dense_layers=(0,), family="kimi_linear")
FLAVORS = {
    "debug": ModelArgs(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=0, multiple_of=64),
    "small": ModelArgs(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, vocab_size=0, multiple_of=256),
    # Llama 3.2 1B's shape (FFN hidden 8192) with an untied output layer and a vocabulary
    # from the tokenizer: a model that fills a GPU where small would not.
    "llama3_1b": ModelArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=0,
                           multiple_of=256, ffn_dim_multiplier=1.5, rope_theta=500000.0),
    # Tiny relatives for CPU tests: debug's shape with each family's switches.
    "debug_qwen3": ModelArgs(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=0, multiple_of=64,
                             head_dim=64, qk_norm="head", family="qwen3"),
    "debug_qwen2": ModelArgs(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=0, multiple_of=64,
                             qkv_bias=True, family="qwen2"),
    "debug_olmo2": ModelArgs(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=0, multiple_of=64,
                             qk_norm="projection", post_norm=True, family="olmo2"),
    # OLMo 3: OLMo 2's norms with a sliding block (windows of 8) before a full one, YaRN on the full
    # block alone (the sliding one rotates by the base without it, as OLMo 3's do)
    "debug_olmo3": ModelArgs(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=0, multiple_of=64,
                             qk_norm="projection", post_norm=True, sliding_window=8, full_layers=(1,),
                             rope_theta=500000.0, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                                "original_max_position_embeddings": 32},
                             local_rope_theta=500000.0, family="olmo3"),
    # Gemma 3: norms around each sub-layer (zero-centred), the embedding scaled, GeGLU, per-head q/k
    # norms, the softmax at query_pre_attn_scalar (48, not head_dim 32), a sliding block (8 keys,
    # base 1e4) before a full one (base 1e6, linear 8x), tied
    "debug_gemma3": ModelArgs(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=0, multiple_of=64,
                              norm_eps=1e-6, sliding_window=8, full_layers=(1,), rope_theta=1000000.0,
                              rope_scaling={"rope_type": "linear", "factor": 8.0}, local_rope_theta=10000.0,
                              attention_scalar=48, tie_embeddings=True, **GEMMA3),
    # gpt-oss's attention on Qwen3's shape: a local block on a global one, a window of 8 keys
    # (shorter than the tests' documents and than a cp 2 chunk of their 64-token sequences), and
    # attention sinks. (Exported nowhere: Qwen3 has no sinks.)
    "debug_sliding": ModelArgs(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=0, multiple_of=64,
                               head_dim=64, qk_norm="head", sliding_window=8, full_layers=(0,), attention_sinks=True,
                               family="plait_sinks"),
    # Each family's small size (config.json of the published checkpoint), for benchmarks and plan.
    "qwen3_0_6b": ModelArgs(dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, vocab_size=151936, head_dim=128,
                            ffn_hidden=3072, norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=40960,
                            tie_embeddings=True, qk_norm="head", family="qwen3"),
    "qwen2_5_0_5b": ModelArgs(dim=896, n_layers=24, n_heads=14, n_kv_heads=2, vocab_size=151936, ffn_hidden=4864,
                              norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=32768, tie_embeddings=True,
                              qkv_bias=True, family="qwen2"),
    "mistral_7b": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=32768, ffn_hidden=14336,
                            rope_theta=1000000.0, max_seq_len=32768, family="mistral"),
    "olmo2_1b": ModelArgs(dim=2048, n_layers=16, n_heads=16, n_kv_heads=16, vocab_size=100352, ffn_hidden=8192,
                          norm_eps=1e-6, rope_theta=500000.0, max_seq_len=4096, qk_norm="projection", post_norm=True,
                          family="olmo2"),
    "olmo3_7b": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, vocab_size=100278, ffn_hidden=11008,
                          **OLMO3),
    "olmo3_32b": ModelArgs(dim=5120, n_layers=64, n_heads=40, n_kv_heads=8, vocab_size=100278, ffn_hidden=27648,
                           **OLMO3 | {"full_layers": tuple(range(3, 64, 4))}),
    # Gemma 3 27B's language model: 5 sliding blocks (1024 keys, base 1e4) to 1 full (base 1e6, linear 8x)
    "gemma3_27b": ModelArgs(dim=5376, n_layers=62, n_heads=32, n_kv_heads=16, vocab_size=262208, head_dim=128,
                            ffn_hidden=21504, norm_eps=1e-6, max_seq_len=131072, sliding_window=1024,
                            full_layers=tuple(range(5, 62, 6)), rope_theta=1000000.0,
                            rope_scaling={"rope_type": "linear", "factor": 8.0}, local_rope_theta=10000.0,
                            attention_scalar=168, tie_embeddings=True, **GEMMA3),
    "smollm3_3b": ModelArgs(dim=2048, n_layers=36, n_heads=16, n_kv_heads=4, vocab_size=128256, ffn_hidden=11008,
                            norm_eps=1e-6, rope_theta=5000000.0, max_seq_len=65536, tie_embeddings=True,
                            nope_layers=tuple(range(3, 36, 4)), family="smollm3"),
    # Mixtures of experts: debug's shape with 8 experts of which each token takes 2 (Qwen3-MoE's
    # switches), the same with DeepSeek-V3's router (sigmoid, a load-balancing bias, one shared
    # expert; exported nowhere: its attention is not DeepSeek's), a CPU benchmark size, and
    # Qwen3-MoE's published shapes for `plait plan`.
    "debug_moe": ModelArgs(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=0, multiple_of=64,
                           qk_norm="head", n_experts=8, top_k=2, moe_hidden=64, family="qwen3_moe"),
    "debug_moe_sigmoid": ModelArgs(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=0, multiple_of=64,
                                   n_experts=8, top_k=2, moe_hidden=64, n_shared_experts=1, router="sigmoid",
                                   family="plait_moe"),
    "small_moe": ModelArgs(dim=512, n_layers=8, n_heads=8, n_kv_heads=4, vocab_size=0, qk_norm="head",
                           n_experts=8, top_k=2, moe_hidden=512, family="qwen3_moe"),
    # small_moe's dense twin: the same active parameters per token (an FFN of top_k x moe_hidden)
    "small_moe_dense": ModelArgs(dim=512, n_layers=8, n_heads=8, n_kv_heads=4, vocab_size=0, qk_norm="head",
                                 ffn_hidden=1024, family="qwen3"),
    "qwen3_30b_a3b": ModelArgs(dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, vocab_size=151936, head_dim=128,
                               ffn_hidden=6144, norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=40960, qk_norm="head",
                               n_experts=128, top_k=8, moe_hidden=768, family="qwen3_moe"),
    "qwen3_235b_a22b": ModelArgs(dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, vocab_size=151936, head_dim=128,
                                 ffn_hidden=12288, norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=40960,
                                 qk_norm="head", n_experts=128, top_k=8, moe_hidden=1536, family="qwen3_moe"),
    # gpt-oss: alternating local (128-key windows) and global blocks with attention sinks, biased
    # attention and experts, the clamped SwiGLU, YaRN over an original context of 4096. The CPU
    # test size keeps every switch (windows of 8, YaRN over 32 positions).
    "debug_gpt_oss": ModelArgs(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=0, head_dim=32, ffn_hidden=64,
                               norm_eps=1e-5, rope_theta=150000.0, qkv_bias=True, out_bias=True, sliding_window=8,
                               full_layers=(1,), attention_sinks=True, n_experts=8, top_k=2, moe_hidden=64,
                               expert_bias=True, router_bias=True, swiglu_limit=7.0, family="gpt_oss",
                               rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                             "beta_fast": 32.0, "beta_slow": 1.0}),
    "gpt_oss_20b": ModelArgs(dim=2880, n_layers=24, n_heads=64, n_kv_heads=8, vocab_size=201088, head_dim=64,
                             ffn_hidden=2880, norm_eps=1e-5, rope_theta=150000.0, max_seq_len=131072, qkv_bias=True,
                             out_bias=True, sliding_window=128, full_layers=tuple(range(1, 24, 2)),
                             attention_sinks=True, n_experts=32, top_k=4, moe_hidden=2880, expert_bias=True,
                             router_bias=True, swiglu_limit=7.0, family="gpt_oss", rope_scaling=GPT_OSS_YARN),
    "gpt_oss_120b": ModelArgs(dim=2880, n_layers=36, n_heads=64, n_kv_heads=8, vocab_size=201088, head_dim=64,
                              ffn_hidden=2880, norm_eps=1e-5, rope_theta=150000.0, max_seq_len=131072, qkv_bias=True,
                              out_bias=True, sliding_window=128, full_layers=tuple(range(1, 36, 2)),
                              attention_sinks=True, n_experts=128, top_k=4, moe_hidden=2880, expert_bias=True,
                              router_bias=True, swiglu_limit=7.0, family="gpt_oss", rope_scaling=GPT_OSS_YARN),
    # DeepSeek-V3: multi-head latent attention (a low-rank query, keys and values from a latent,
    # a RoPE key shared by the heads), the sigmoid router over groups of experts with a shared
    # expert, the first blocks dense, YaRN with mscale. The CPU test size keeps every switch (8
    # experts in 4 groups, a value head unlike the query's); the 16B size is DeepSeek-V2-Lite's
    # sizes (torchtitan's 16B) with V3's router; Kimi K2 is V3's architecture at 1T.
    "debug_mla": ModelArgs(dim=128, n_layers=2, n_heads=4, n_kv_heads=4, vocab_size=0, ffn_hidden=256, norm_eps=1e-6,
                           q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=24,
                           n_experts=8, top_k=2, moe_hidden=64, n_shared_experts=1, router="sigmoid",
                           route_scale=2.5, n_groups=4, topk_groups=2, dense_layers=(0,), mtp_layers=1,
                           family="deepseek_v3",
                           rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}),
    # GLM-4.5: grouped-query attention with q/k/v biases and a per-head q/k norm, RoPE on half of
    # each head, DeepSeek-V3's router (groups, a balancing bias, a shared expert, the first blocks
    # dense, scaled weights) and its MTP module. The CPU test size keeps every switch but MTP (8
    # experts in 4 groups); GLM-4.5-Air and GLM-4.5 for plan.
    "debug_glm4_moe": ModelArgs(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=0, multiple_of=64,
                                rotary_dim=16, qkv_bias=True, qk_norm="head", n_experts=8, top_k=2, moe_hidden=64,
                                n_shared_experts=1, router="sigmoid", route_scale=2.5, n_groups=4, topk_groups=2,
                                dense_layers=(0,), family="glm4_moe"),
    "glm4_5_air": ModelArgs(dim=4096, n_layers=46, n_heads=96, n_kv_heads=8, head_dim=128, ffn_hidden=10944,
                            moe_hidden=1408, n_experts=128, dense_layers=(0,), **GLM4_5),
    "glm4_5": ModelArgs(dim=5120, n_layers=92, n_heads=96, n_kv_heads=8, head_dim=128, ffn_hidden=12288,
                        moe_hidden=1536, n_experts=160, dense_layers=(0, 1, 2), route_scale=2.5, qk_norm="head",
                        **GLM4_5),
    # Llama 4: experts weighed on their inputs by an unbiased sigmoid router with a shared expert, a
    # dense block, blocks without RoPE whose queries are temperature-tuned, L2 q/k norms, chunked
    # attention, Llama 3's RoPE scaling. The CPU test size: a dense block with RoPE, then a sparse
    # one without (floor 16: the tuning moves within a test's 64 positions; chunks of 12: a test's
    # sequences cut in 6, across cp 2's chunks of 16); Scout for plan (its 10M positions cut to
    # 131072: a RoPE table of 10M is 5 GB).
    "debug_llama4": ModelArgs(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=0, multiple_of=64,
                              n_experts=8, top_k=1, moe_hidden=64, dense_layers=(0,), nope_layers=(1,),
                              temperature_floor=16, **LLAMA4 | {"attention_chunk": 12}),
    "llama4_scout": ModelArgs(dim=5120, n_layers=48, n_heads=40, n_kv_heads=8, vocab_size=202048, head_dim=128,
                              ffn_hidden=16384, n_experts=16, top_k=1, moe_hidden=8192,
                              nope_layers=tuple(range(3, 48, 4)), max_seq_len=131072,
                              **LLAMA4 | {"nope_temperature": 0.1}),
    # Qwen3-Next: three linear-attention blocks (the gated delta rule) to one of gated attention
    # (an output gate, a quarter of each head rotated, zero-centred norms), the MoE's shared expert
    # gated. The CPU test sizes: a linear block then a full one, chunks of 16 (a test's 64-token
    # sequences cross chunks), dense and with experts; the 80B for plan.
    "debug_hybrid": ModelArgs(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=0, multiple_of=64,
                              linear_chunk=16, **QWEN3_NEXT),
    "debug_hybrid_moe": ModelArgs(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=0, multiple_of=64,
                                  linear_chunk=16, n_experts=8, top_k=2, moe_hidden=64, **QWEN3_NEXT_MOE),
    "qwen3_next_80b_a3b": ModelArgs(dim=2048, n_layers=48, n_heads=16, n_kv_heads=2, vocab_size=151936,
                                    ffn_hidden=5632, max_seq_len=262144, rope_theta=10000000.0, n_experts=512,
                                    top_k=10, moe_hidden=512, mtp_layers=1, **QWEN3_NEXT_MOE | {
                                        "head_dim": 256, "rotary_dim": 64, "linear_layers": tuple(
                                            i for i in range(48) if i % 4 != 3), "linear_key_heads": 16,
                                        "linear_value_heads": 32, "linear_key_dim": 128, "linear_value_dim": 128}),
    # OLMo hybrid: the CPU test size (a linear block of 2 key heads of 16 to 4 value heads of 16, then an
    # attention block without RoPE; chunks of 16) and Olmo-Hybrid-7B (every fourth block attention, no RoPE)
    "debug_olmo_hybrid": ModelArgs(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=0, multiple_of=64,
                                   norm_eps=1e-6, linear_layers=(0,), linear_key_heads=2, linear_value_heads=4,
                                   linear_key_dim=16, linear_value_dim=16, linear_chunk=16, nope_layers=(1,),
                                   **OLMO_HYBRID),
    "olmo_hybrid_7b": ModelArgs(dim=3840, n_layers=32, n_heads=30, n_kv_heads=30, vocab_size=100352, ffn_hidden=11008,
                                norm_eps=1e-6, max_seq_len=65536,
                                linear_layers=tuple(i for i in range(32) if i % 4 != 3),
                                linear_key_heads=30, linear_value_heads=30, linear_key_dim=96, linear_value_dim=192,
                                nope_layers=tuple(range(3, 32, 4)), **OLMO_HYBRID),
    # Kimi Linear: the CPU test size (a dense Kimi Delta Attention block of 2 heads of 16, then a sparse
    # latent attention block without RoPE; chunks of 16) and Kimi-Linear-48B-A3B (every fourth block
    # latent attention, and the last)
    "debug_kimi": ModelArgs(dim=128, n_layers=2, n_heads=4, n_kv_heads=4, vocab_size=0, multiple_of=64,
                            kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, n_experts=8,
                            top_k=2, moe_hidden=64, linear_layers=(0,), nope_layers=(1,), linear_key_heads=2,
                            linear_value_heads=2, linear_key_dim=16, linear_value_dim=16, linear_chunk=16,
                            **KIMI_LINEAR),
    "kimi_linear_48b_a3b": ModelArgs(dim=2304, n_layers=27, n_heads=32, n_kv_heads=32, vocab_size=163840,
                                     ffn_hidden=9216, max_seq_len=1048576, kv_lora_rank=512, qk_nope_head_dim=128,
                                     qk_rope_head_dim=64, v_head_dim=128, n_experts=256, top_k=8, moe_hidden=1024,
                                     linear_layers=tuple(i for i in range(27) if i % 4 != 3 and i != 26),
                                     nope_layers=(*range(3, 27, 4), 26), linear_key_heads=32, linear_value_heads=32,
                                     linear_key_dim=128, linear_value_dim=128, **KIMI_LINEAR),
    # Qwen3.5's language models, the shapes transformers' config classes name (Qwen3.5-9B, dense; and
    # Qwen3.5-35B-A3B, experts in every block): for plan
    "qwen3_5_9b": ModelArgs(dim=4096, n_layers=32, n_heads=16, n_kv_heads=4, vocab_size=248320, ffn_hidden=12288,
                            max_seq_len=262144, rope_theta=10000000.0, mtp_layers=1, **QWEN3_5),
    "qwen3_5_35b_a3b": ModelArgs(dim=2048, n_layers=40, n_heads=16, n_kv_heads=2, vocab_size=248320, ffn_hidden=512,
                                 max_seq_len=262144, rope_theta=10000000.0, n_experts=256, top_k=8, moe_hidden=512,
                                 mtp_layers=1, **QWEN3_5 | dict(n_shared_experts=1, shared_expert_gate=True,
                                                  linear_layers=tuple(i for i in range(40) if i % 4 != 3),
                                                  family="qwen3_5_moe_text")),
    # A CPU benchmark size (small_moe's width and experts) and its twin with grouped-query attention
    "small_mla": ModelArgs(dim=512, n_layers=8, n_heads=8, n_kv_heads=8, vocab_size=0, ffn_hidden=1024,
                           kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, n_experts=8,
                           top_k=2, moe_hidden=256, n_shared_experts=1, router="sigmoid", route_scale=2.5, n_groups=4,
                           topk_groups=2, dense_layers=(0,), mtp_layers=1, family="deepseek_v3"),
    "deepseek_v3_16b": ModelArgs(dim=2048, n_layers=27, n_heads=16, n_kv_heads=16, vocab_size=102400,
                                 ffn_hidden=10944, norm_eps=1e-6, max_seq_len=4096, kv_lora_rank=512,
                                 qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_experts=64, top_k=6,
                                 moe_hidden=1408, n_shared_experts=2, router="sigmoid", dense_layers=(0,),
                                 family="deepseek_v3"),
    "deepseek_v3_671b": ModelArgs(dim=7168, n_layers=61, n_heads=128, n_kv_heads=128, vocab_size=129280,
                                  ffn_hidden=18432, norm_eps=1e-6, max_seq_len=163840, q_lora_rank=1536,
                                  kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                                  n_experts=256, top_k=8, moe_hidden=2048, n_shared_experts=1, router="sigmoid",
                                  route_scale=2.5, n_groups=8, topk_groups=4, dense_layers=(0, 1, 2), mtp_layers=1,
                                  family="deepseek_v3", rope_scaling=DEEPSEEK_YARN),
    "kimi_k2_1t": ModelArgs(dim=7168, n_layers=61, n_heads=64, n_kv_heads=64, vocab_size=163840, ffn_hidden=18432,
                            norm_eps=1e-6, rope_theta=50000.0, max_seq_len=131072, q_lora_rank=1536, kv_lora_rank=512,
                            qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_experts=384, top_k=8,
                            moe_hidden=2048, n_shared_experts=1, router="sigmoid", route_scale=2.827,
                            dense_layers=(0,), family="deepseek_v3",
                            rope_scaling=DEEPSEEK_YARN | {"factor": 32.0, "beta_fast": 1.0, "beta_slow": 1.0}),
    "llama3_8b": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256,
                           multiple_of=1024, ffn_dim_multiplier=1.3, rope_theta=500000.0),
    "llama3_70b": ModelArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256,
                            multiple_of=4096, ffn_dim_multiplier=1.3, rope_theta=500000.0),
    "llama3_405b": ModelArgs(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, vocab_size=128256,
                             multiple_of=4096, ffn_dim_multiplier=1.2, rope_theta=500000.0),
}

# small_mla with grouped-query attention of its query heads' width (head_dim 64, 4 key/value heads)
FLAVORS["small_mla_gqa"] = replace(FLAVORS["small_mla"], n_kv_heads=4, head_dim=64, kv_lora_rank=0, qk_nope_head_dim=0,
                                   qk_rope_head_dim=0, v_head_dim=0, family="plait_moe")


def model_args(flavor: str, tokenizer_vocab: int, n_layers: int = 0) -> ModelArgs:
    """The flavor's shape (with `n_layers` blocks, if given) and its vocabulary settled against
    the tokenizer's."""
    args = replace(FLAVORS[flavor], n_layers=n_layers or FLAVORS[flavor].n_layers)
    if args.vocab_size == 0:
        # Round up so the embedding splits evenly under tensor parallelism.
        return replace(args, vocab_size=64 * math.ceil(tokenizer_vocab / 64))
    if tokenizer_vocab > args.vocab_size:
        raise ValueError(f"model.flavor: {flavor} has {args.vocab_size} embeddings but the tokenizer has "
                         f"{tokenizer_vocab} tokens; use a smaller tokenizer or the debug/small flavor")
    return args


def shrunk(args: ModelArgs, vocab_size: int) -> ModelArgs:
    """`args` cut to two blocks of width 64 (model.shrink): what the family's code runs through is
    kept (queries per key head, norms, biases, RoPE and its scaling, windows and which blocks are
    global, dense first blocks, routing, shared experts, latent attention, MTP), at sizes a CPU
    trains in seconds; positions stay the job's, the vocabulary is the tokenizer's (`vocab_size`:
    a real tokenizer's is the flavor's own; a 128K-row output of 8K tokens is 4 GiB of fp32 logits)."""
    heads, experts = 4, min(args.n_experts, 8)
    groups = min(args.n_groups, 2)
    return replace(
        args, vocab_size=vocab_size, dim=64, n_layers=2, n_heads=heads, n_kv_heads=max(1, heads * args.n_kv_heads // args.n_heads),
        head_dim=16, rotary_dim=8 if args.rotary_dim else 0, ffn_hidden=128, nope_layers=tuple(i for i in args.nope_layers if i < 2),
        full_layers=tuple(i for i in args.full_layers if i < 2), dense_layers=tuple(i for i in args.dense_layers if i < 2),
        n_experts=experts, top_k=min(args.top_k, 2 if groups else experts), moe_hidden=32 if args.moe_hidden else 0,
        n_groups=groups, topk_groups=min(args.topk_groups, groups),
        **({"q_lora_rank": 32 if args.q_lora_rank else 0, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8, "v_head_dim": 16} if args.kv_lora_rank else {}))
