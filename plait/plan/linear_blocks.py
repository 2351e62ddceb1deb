"""What a linear-attention block's token mixer (plait/models/linear_attention.py: the gated delta
rule) leaves for backward, per token: counted from its code, tensor by tensor. Against the dtype
probe's measure of whole runs (tests/test_plan.py): 0.96-1.01 on one device, FSDP2, TP2, PP2
and CP2. Kimi Delta Attention's gate per key channel keeps what a gate per head keeps: its
products are recomputed in backward (`decayed_products`); its wider gates and their bottlenecks
are left out (measured 1.0055 on one device, debug_kimi)."""

from __future__ import annotations

from plait.models.args import ModelArgs


def linear_mixer_bytes(args: ModelArgs, e: int, mode: str, tp: int, cp: int = 1) -> int:
    """Per token, under TP's split of its heads (e: compute dtype bytes).

    none: the convolution keeps its fp32 input and sum and its output (q, k and v); the L2 norms
    their normalised, repeated fp32 q and k and the scaled q; the rule, per value head, its fp32
    copies of q, k, v and the gates, k x b, the chunk's pairwise decays, k.k, the triangular system
    and q.k (4 rows of `linear_chunk`), the solves' values and keys, each chunk's corrections,
    output and decayed q and k, and its incoming state (key dim x value dim per chunk); the output
    norm its fp32 input, its normalised values, SiLU's input and output, the gate z and the output
    projection's input. Under cp (plait/parallel/linear_context.py) each chunk runs the rule again
    from the identity, its values key-dim wide, and keeps that run's reads of the incoming state.
    selective: the six projections' outputs and the rule's output; full: nothing of its own (the
    block input is counted with the block)."""
    keys = args.linear_key_heads * args.linear_key_dim // tp
    values = args.linear_value_heads * args.linear_value_dim // tp
    heads, dk, dv = args.linear_value_heads // tp, args.linear_key_dim, args.linear_value_dim
    if mode == "full":
        return 0
    if mode == "selective":
        return e * (2 * keys + 3 * values + 2 * heads)
    convolution = (8 + e) * (2 * keys + values)
    normed = 4 * heads * 3 * dk
    rule = rule_bytes(args, heads, dv) + (rule_bytes(args, heads, dk) + 4 * heads * dk if cp > 1 else 0)
    gated_norm = (12 + 4 * e) * values
    return int(convolution + normed + rule + gated_norm)


def rule_bytes(args: ModelArgs, heads: int, dv: int) -> float:
    """What one run of the chunked rule keeps per token, for values `dv` wide."""
    dk, chunk = args.linear_key_dim, args.linear_chunk
    return 4 * heads * ((2 * dk + dv + 2) + dk + 4 * chunk + (dv + dk) + 2 * (dv + dk) + dk * dv / chunk)
