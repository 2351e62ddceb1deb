"""A model's shape and switches (ModelArgs): plain data, read by the model code in plait/models/,
by the planner and by the Hugging Face reader; the named shapes are in plait/models/flavors.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

@dataclass(frozen=True)
class ModelArgs:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int  # 0 = take it from the tokenizer
    multiple_of: int = 256  # FFN hidden size is rounded up to this
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 8192
    head_dim: int = 0  # 0 = dim / n_heads; Hugging Face configs may give another
    rotary_dim: int = 0  # the entries of each query and key head RoPE rotates, the first ones (0: all; GLM-4.5: half)
    ffn_hidden: int = 0  # 0 = from dim, ffn_dim_multiplier and multiple_of, as Meta's reference
    tie_embeddings: bool = False  # the output layer multiplies by the embedding matrix itself
    # None, or {"rope_type": "linear", "factor"} or {"rope_type": "llama3", "factor",
    # "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
    rope_scaling: dict | None = None
    # The sliding blocks' own RoPE (OLMo 3, Gemma 3: local and global layers rotate by bases or
    # scalings of their own): its base and scaling; 0 = as every other block.
    local_rope_theta: float = 0.0
    local_rope_scaling: dict | None = None
    family: str = "llama"  # the Hugging Face model_type it is exported as
    qkv_bias: bool = False  # biases on the query, key and value projections (Qwen2)
    out_bias: bool = False  # a bias on the attention's output projection (with qkv_bias: attention_bias)
    ffn_bias: bool = False  # biases on the SwiGLU's three projections (mlp_bias)
    # RMSNorm of queries and keys before RoPE: "head" (Qwen3), "projection" (OLMo 2); "l2" (Llama 4):
    # without weight, after RoPE, in the blocks with RoPE
    qk_norm: str = "none"
    post_norm: bool = False  # norm each sub-layer's output before the residual add (OLMo 2), not its input
    sandwich_norm: bool = False  # norm each sub-layer's input and its output (Gemma 3)
    zero_centered_norms: bool = False  # each RMSNorm's weight is its gain's offset from 1 (Gemma 3): x / rms * (1 + w)
    embed_scale: bool = False  # the embedding's output times sqrt(dim) (Gemma)
    activation: str = "silu"  # the dense feed-forward's gate: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma)
    attention_scalar: int = 0  # scores scaled by attention_scalar^-0.5 (0: head_dim; Gemma 3's query_pre_attn_scalar)
    nope_layers: tuple[int, ...] = ()  # blocks whose attention uses no RoPE (SmolLM3: every fourth)
    # Llama 4's temperature tuning in the blocks without RoPE: queries times
    # log(1 + floor((position + 1) / temperature_floor)) x nope_temperature + 1 (0: off)
    nope_temperature: float = 0.0
    temperature_floor: int = 8192
    # Llama 4's chunked attention in the blocks with RoPE: the sequence cut every attention_chunk
    # positions, a query sees the earlier keys of its own chunk only (0: none)
    attention_chunk: int = 0
    # Sliding-window attention: a query sees itself and the sliding_window - 1 keys before it (0 =
    # the whole sequence), in every block but full_layers (Mistral: all; Qwen: those below
    # max_window_layers; gpt-oss and SmolLM3-style mixes: local and global blocks).
    sliding_window: int = 0
    full_layers: tuple[int, ...] = ()
    # A learned logit per head that joins each softmax's denominator (gpt-oss): a query may give
    # part of its attention to nothing.
    attention_sinks: bool = False
    # Mixture of experts (plait/models/moe.py): n_experts > 0 replaces the feed-forward of every block but
    # dense_layers with top_k of n_experts SwiGLUs of moe_hidden each, plus n_shared_experts that
    # every token goes through. router: "softmax" (then top k, renormalised if normalize_top_k;
    # Qwen3-MoE, Mixtral) or "sigmoid" (a load-balancing bias steers the choice; DeepSeek-V3).
    n_experts: int = 0
    top_k: int = 0
    moe_hidden: int = 0
    n_shared_experts: int = 0
    router: str = "softmax"
    normalize_top_k: bool = True
    route_scale: float = 1.0
    balance_bias: bool = True  # a sigmoid router's load-balancing bias (DeepSeek-V3); False: none (Llama 4)
    route_inputs: bool = False  # the router's weights scale each expert's input, not its output (Llama 4)
    dense_layers: tuple[int, ...] = ()
    # gpt-oss's experts: a bias on each expert's projections and on the router's logits, and the
    # clamped SwiGLU (swiglu_limit > 0): gate clamped above and up on both sides at the limit,
    # then gate * sigmoid(swiglu_alpha * gate) * (up + 1).
    expert_bias: bool = False
    router_bias: bool = False
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 1.702
    # Multi-head latent attention (DeepSeek-V2/V3, plait/models/latent_attention.py) where
    # kv_lora_rank > 0: keys and values expand from a latent of kv_lora_rank per token, each
    # head's key is qk_nope_head_dim of its own and a RoPE key of qk_rope_head_dim shared by
    # every head, values are v_head_dim; queries through a latent of q_lora_rank (0: one
    # projection). head_dim is then the query/key head (nope + rope), n_kv_heads n_heads.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # DeepSeek-V3's group-limited routing: the experts in n_groups groups, a token's top_k from
    # the topk_groups groups whose two best (biased) scores sum highest (0: no groups).
    n_groups: int = 0
    topk_groups: int = 0
    # DeepSeek-V3's multi-token prediction: mtp_layers (0 or 1) more blocks after the last; from
    # the model's output after its final norm and the embedding of token t+1 one predicts token t+2 (training only).
    mtp_layers: int = 0
    # Hybrid linear attention (Qwen3-Next, Qwen3.5, OLMo hybrid; plait/models/linear_attention.py): the blocks in
    # linear_layers mix tokens by the gated delta rule, not attention: linear_key_heads query/key
    # heads of linear_key_dim, linear_value_heads value heads of linear_value_dim (a multiple of the
    # key heads: each key head serves as many consecutive value heads), and a causal depthwise
    # convolution of linear_conv taps on q, k and v.
    linear_layers: tuple[int, ...] = ()
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0
    linear_conv: int = 4
    linear_chunk: int = 64  # positions the chunked rule solves at once (the result's rounding alone depends on it)
    # OLMo hybrid's variant: the step b doubled (sigmoid x 2, in [0, 2]: the transition I - b k k^T may
    # have negative eigenvalues), the output norm's own eps (0: norm_eps), and its initialisation: the
    # gate rates e^A_log uniform in linear_a_init; dt_bias ones where linear_dt_init is (), else the
    # softplus inverse of a dt log-uniform in [min, max] and at least floor (Mamba's: min, max, floor).
    linear_negative_eigenvalues: bool = False
    linear_norm_eps: float = 0.0
    linear_a_init: tuple[float, float] = (1.0, 16.0)
    linear_dt_init: tuple[float, ...] = ()
    # Kimi Delta Attention (Kimi Linear): the gate per key channel, and the gate and the output gate each
    # through a bottleneck of linear_key_dim (the output gate a sigmoid): plait/models/linear_attention.py
    linear_channel_gates: bool = False
    attention_gate: bool = False  # attention's output times sigmoid(a gate projection), per entry (Qwen3-Next)
    shared_expert_gate: bool = False  # the shared expert's output times sigmoid(a projection to 1) (Qwen3-Next)

    def __post_init__(self):
        # (a manifest's JSON gives a list back)
        object.__setattr__(self, "nope_layers", tuple(self.nope_layers))
        object.__setattr__(self, "dense_layers", tuple(self.dense_layers))
        object.__setattr__(self, "full_layers", tuple(self.full_layers))
        object.__setattr__(self, "linear_layers", tuple(self.linear_layers))
        object.__setattr__(self, "linear_a_init", tuple(self.linear_a_init))
        object.__setattr__(self, "linear_dt_init", tuple(self.linear_dt_init))
        # Settled once, so a checkpoint's manifest records every number of the shape.
        if self.kv_lora_rank:
            object.__setattr__(self, "head_dim", self.qk_nope_head_dim + self.qk_rope_head_dim)
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        if not self.v_head_dim:
            object.__setattr__(self, "v_head_dim", self.head_dim)
        if not self.ffn_hidden:
            hidden = int(2 * 4 * self.dim / 3)
            if self.ffn_dim_multiplier is not None:
                hidden = int(self.ffn_dim_multiplier * hidden)
            object.__setattr__(self, "ffn_hidden", self.multiple_of * math.ceil(hidden / self.multiple_of))

    @property
    def rope_dim(self) -> int:
        """The entries of a query or key head that RoPE rotates (under latent attention: its RoPE part)."""
        return self.qk_rope_head_dim if self.kv_lora_rank else self.rotary_dim or self.head_dim

    def sparse(self, block: int) -> bool:
        """Whether block `block` is a mixture of experts."""
        return bool(self.n_experts) and block not in self.dense_layers

    def linear(self, block: int) -> bool:
        """Whether block `block` mixes tokens by linear attention (the gated delta rule)."""
        return block in self.linear_layers

    def window(self, block: int) -> int:
        """Block `block`'s attention window (0: the whole sequence)."""
        return 0 if block in self.full_layers else self.sliding_window

    def chunk(self, block: int) -> int:
        """Block `block`'s attention chunk (0: none): Llama 4 chunks its blocks with RoPE."""
        return 0 if block in self.nope_layers else self.attention_chunk

    def reach(self, block: int) -> int:
        """The most keys a query of block `block` sees, itself included: its window or its chunk
        (0: the whole sequence before it)."""
        return self.window(block) or self.chunk(block)

    def local_rope(self, block: int) -> bool:
        """Whether block `block` rotates by the sliding blocks' own RoPE."""
        return bool(self.local_rope_theta and self.window(block))

    def block_table(self, block: int) -> str:
        """Which of the model's per-position tables block `block` takes: "rope", "local_rope" (the
        sliding blocks' own) or "temperature" (Llama 4's, in the blocks without RoPE)."""
        if self.nope_temperature and block in self.nope_layers:
            return "temperature"
        return "local_rope" if self.local_rope(block) else "rope"

    @property
    def spans(self) -> tuple[tuple[int, int], ...]:
        """The distinct (window, chunk) of the blocks' attention, ascending ((0, 0): a block over
        the whole sequence before each query)."""
        return tuple(sorted({(self.window(block), self.chunk(block)) for block in range(self.n_layers)}))

    def own_mask(self, block: int, seq_len: int) -> bool:
        """Whether block `block` attends under a mask even where a sequence of `seq_len` is causal
        alone (a window, sinks, a chunk shorter than it: SDPA's causal path has none of them)."""
        return bool(self.window(block)) or self.attention_sinks or 0 < self.chunk(block) < seq_len

    @property
    def sparse_blocks(self) -> int:
        return sum(map(self.sparse, range(self.n_layers)))

    def __hash__(self) -> int:  # (rope_scaling is a dict: hashed by its items)
        return hash(tuple(tuple(sorted(v.items())) if isinstance(v, dict) else v for v in vars(self).values()))
