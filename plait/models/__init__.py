"""The models: Llama 3 and its close relatives, and mixtures of experts, in plain PyTorch.

The relatives differ from Llama by a few switches of one model, not by copies of it: biases
(Qwen2's q/k/v, Llama's and OLMo 2's `attention_bias`, `mlp_bias`), RMSNorm on queries and keys
(per head as Qwen3, over the whole projection as OLMo 2), norms after each sub-layer instead of
before it (OLMo 2), blocks without RoPE (SmolLM3) and feed-forward layers that are mixtures of
experts (Qwen3-MoE, DeepSeek-style sigmoid routers).

No parallelism lives here; plait/parallel applies it from outside. The modules, bottom up:
`flavors` (ModelArgs and the named shapes), `norms`, `rope`, `masking` (document masks),
`attention` (with the KV cache), `mlp`, `moe`, `transformer` (the block and the model) and
`weights` (the layout-independent init).
"""
