"""The gated delta rule (plait/models/linear_attention.py), its gate per head (Gated DeltaNet) and per
key channel (Kimi Delta Attention), against transformers' per-token recurrences, with documents that restart it, a state carried from one call to the next (generation's cache),
and the causal convolution against PyTorch's depthwise conv1d. Whole models against transformers'
Qwen3-Next: tests/test_families.py; each document alone in a packed sequence:
tests/test_long_context.py; every layout: the parity matrix."""

import pytest
import torch
import torch.nn.functional as F

from plait.models.linear_attention import causal_conv, gated_delta_rule, l2_normalized

transformers = pytest.importorskip("transformers")

BATCH, SEQ, HEADS, DK, DV = 2, 150, 3, 16, 8  # (150 positions: two whole chunks of 64 and a padded one)


def inputs(seed: int = 0, per_channel: bool = False):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(BATCH, SEQ, HEADS, DK, generator=g), torch.randn(BATCH, SEQ, HEADS, DK, generator=g)
    v = torch.randn(BATCH, SEQ, HEADS, DV, generator=g)
    # (log of a gate in (0, 1): a head's, or each key channel's)
    gate = -F.softplus(torch.randn(BATCH, SEQ, HEADS, *[DK] * per_channel, generator=g))
    beta = torch.rand(BATCH, SEQ, HEADS, generator=g)
    return q, k, v, gate, beta


def documents() -> torch.Tensor:
    """Documents that start inside chunks and on a chunk's edge (64), of one position too (row 1's 5)."""
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
    ids[:, 64:] = 1
    ids[:, 100:] = 2
    ids[1, 5:] += 3
    ids[1, 6:] += 1
    return ids


def test_the_chunked_rule_equals_the_per_token_recurrence():
    """fp32, 150 positions: measured 3.7e-7 on the output, 2.5e-7 on the final state (the two forms
    add the same terms in other orders); bound 1e-5, 27x. Chunks of 16 compute the same."""
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule

    q, k, v, gate, beta = inputs()
    theirs, their_state = torch_recurrent_gated_delta_rule(q, k, v, gate, beta, output_final_state=True,
                                                           use_qk_l2norm_in_kernel=True)
    for chunk in (64, 16):
        ours, state = gated_delta_rule(l2_normalized(q) * DK ** -0.5, l2_normalized(k), v, gate, beta, chunk=chunk)
        assert (ours - theirs).abs().max() <= 1e-5 and (state - their_state).abs().max() <= 1e-5


def test_the_gate_per_key_channel_equals_kimis_recurrence():
    """Kimi Delta Attention's gate decays each key channel's row of the state: the chunked rule
    equals transformers' per-token recurrence (fp32, measured 7.3e-7 on the output and 1.8e-6 on
    the final state: other orders of the same sums; bound 1e-5, 5x), in chunks of 64, 16 and 24
    (blocks of 16 or 12 within them). Gates 60 times stronger (decays to e^-100 within a chunk:
    the products of decays that rise would overflow) stay finite and equal."""
    from transformers.models.kimi_linear.modeling_kimi_linear import recurrent_kimi_delta_attention

    q, k, v, gate, beta = inputs(per_channel=True)
    for strength in (1, 60):
        theirs, their_state = recurrent_kimi_delta_attention(q, k, v, gate * strength, beta, None, True,
                                                             use_qk_l2norm_in_kernel=True)
        for chunk in (64, 16, 24):
            ours, state = gated_delta_rule(l2_normalized(q) * DK ** -0.5, l2_normalized(k), v, gate * strength,
                                           beta, chunk=chunk)
            assert (ours - theirs).abs().max() <= 1e-5 and (state - their_state).abs().max() <= 1e-5


@pytest.mark.parametrize("per_channel", [False, True], ids=["per_head", "per_channel"])
def test_each_document_computes_what_it_computes_alone(per_channel):
    """Under document ids the rule restarts from a zero state at each document, and the
    convolution reads zeros before it: each document equals its own run (fp32, measured 4.3e-7 and
    6e-8: other chunkings of the same sums), and unlike the run across documents."""
    q, k, v, gate, beta = inputs(per_channel=per_channel)
    q, k = l2_normalized(q) * DK ** -0.5, l2_normalized(k)
    ids = documents()
    packed, _ = gated_delta_rule(q, k, v, gate, beta, ids)
    across, _ = gated_delta_rule(q, k, v, gate, beta)
    x, weight = v.flatten(2), torch.randn(HEADS * DV, 4, generator=torch.Generator().manual_seed(1))
    convolved = causal_conv(x, weight, ids)
    for row in range(BATCH):
        for document in ids[row].unique():
            at = (ids[row] == document).nonzero().flatten()
            alone, _ = gated_delta_rule(*(t[row:row + 1, at] for t in (q, k, v, gate, beta)))
            assert (alone - packed[row:row + 1, at]).abs().max() <= 1e-6
            assert (causal_conv(x[row:row + 1, at], weight) - convolved[row:row + 1, at]).abs().max() <= 1e-6
    assert (packed - across).abs().max() > 1e-2


@pytest.mark.parametrize("per_channel", [False, True], ids=["per_head", "per_channel"])
def test_a_state_and_a_window_carried_over_continue_the_sequence(per_channel):
    """Generation's cache: the rule from the state after the first 90 positions, and the
    convolution from their last 3 inputs, continue as one call over all 150 (fp32, measured
    3.8e-7 and 0)."""
    q, k, v, gate, beta = inputs(per_channel=per_channel)
    q, k = l2_normalized(q) * DK ** -0.5, l2_normalized(k)
    whole, state = gated_delta_rule(q, k, v, gate, beta)
    first, carried = gated_delta_rule(*(t[:, :90] for t in (q, k, v, gate, beta)))
    rest, last = gated_delta_rule(*(t[:, 90:] for t in (q, k, v, gate, beta)), state=carried)
    assert (torch.cat([first, rest], 1) - whole).abs().max() <= 1e-5 and (last - state).abs().max() <= 1e-5
    x, weight = v.flatten(2), torch.randn(HEADS * DV, 4, generator=torch.Generator().manual_seed(1))
    assert torch.equal(causal_conv(x[:, 90:], weight, history=x[:, 87:90]), causal_conv(x, weight)[:, 90:])


def test_the_convolution_is_pytorchs_depthwise_causal_conv1d():
    """fp32, measured 7e-7 (conv1d's kernel sums the taps in its own order)."""
    x, weight = torch.randn(BATCH, SEQ, 12), torch.randn(12, 4)
    theirs = F.silu(F.conv1d(x.transpose(1, 2), weight[:, None], padding=3, groups=12)[..., :SEQ]).transpose(1, 2)
    assert (causal_conv(x, weight) - theirs).abs().max() <= 1e-5
