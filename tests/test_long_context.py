"""Document masking and context parallelism's pieces, in one process: a packed sequence computes
what each of its documents computes alone, the kernels agree, and cp's chunks and their order
are what the unsharded computation sees. (The layouts' runs are rows of the parity matrix.)"""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from plait.models.masking import additive, allowed, document_ids, positions_in_documents
from plait.models.flavors import FLAVORS
from plait.models.transformer import Transformer
from plait.parallel.context_parallel import BatchLayout, chunk_indices, sequence_order
from plait.models.weights import init_weights

EOS = 3


def debug_model(flavor: str = "debug") -> Transformer:
    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(FLAVORS[flavor], vocab_size=512))
    init_weights(model, seed=0)
    return model


def packed(lengths: list[int], generator: torch.Generator) -> torch.Tensor:
    """A window of documents of these lengths, each after an end-of-text (the first one cut: none)."""
    parts = []
    for i, n in enumerate(lengths):
        parts += [torch.tensor([EOS])] * (i > 0) + [torch.randint(4, 512, (n,), generator=generator)]
    return torch.cat(parts)[None]


def test_document_ids_and_positions_restart_after_each_end_of_text():
    tokens = torch.tensor([[7, 8, EOS, 9, 10, 11, EOS, 12]])
    assert document_ids(tokens, EOS).tolist() == [[0, 0, 1, 1, 1, 1, 2, 2]]
    assert positions_in_documents(document_ids(tokens, EOS)).tolist() == [[0, 1, 0, 1, 2, 3, 0, 1]]
    mask = allowed(document_ids(tokens, EOS), torch.arange(8))[0, 0]
    assert mask[5].tolist() == [False, False, True, True, True, True, False, False]  # its document, up to itself


@pytest.mark.parametrize("flavor", ["debug", "debug_sliding", "debug_hybrid", "debug_llama4", "debug_kimi"])
def test_a_packed_sequence_computes_what_each_document_computes_alone(flavor):
    """Per-token losses of a packed window under the document mask equal those of each document
    run alone from position 0 (the end-of-text that opens it included): fp32, within 1e-6 (the
    same arithmetic on a different number of rows: matmul blocking may differ in the last bit).
    With a sliding block (a window of 8 keys: documents longer and shorter than it) too, with
    a linear block (its state and convolution restarted at each document; chunks of 16; Kimi's,
    a gate per key channel, before latent attention without RoPE), and with Llama 4's chunked
    attention (chunks of 12 counted from each document's start)."""
    model = debug_model(flavor)
    tokens = packed([9, 20, 14, 7, 41], torch.Generator().manual_seed(1))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    layout = BatchLayout("document", "sdpa", EOS, 0, 1)
    inputs, labels, attention = layout(inputs, labels)
    with torch.no_grad():
        per_token = F.cross_entropy(model(inputs, **attention)[0], labels[0], reduction="none")
        starts = [0, *(i for i in range(inputs.shape[1]) if inputs[0, i] == EOS), inputs.shape[1]]
        alone = torch.cat([F.cross_entropy(model(inputs[:, a:b])[0], labels[0, a:b], reduction="none")
                           for a, b in zip(starts, starts[1:])])
        causal = F.cross_entropy(model(inputs)[0], labels[0], reduction="none")
    assert (per_token - alone).abs().max() <= 1e-6
    assert (per_token - causal).abs().max() > 1e-2  # across documents the causal mask computes something else


def test_the_causal_mask_as_a_tensor_equals_the_causal_path_bitwise():
    """cp > 1 runs causal attention as mask rows (SDPA's grouped-query path): the forward is
    bitwise that of SDPA's causal path, which `causal` without cp keeps."""
    model = debug_model()
    inputs = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(2))
    zeros = torch.zeros_like(inputs)
    with torch.no_grad():
        rows = model(inputs, positions=torch.arange(64).expand(2, -1), mask=zeros)
        assert torch.equal(rows, model(inputs))


@pytest.mark.parametrize("flavor", ["debug", "debug_sliding", "debug_hybrid", "debug_llama4"])
def test_flex_attention_forward_equals_sdpa_under_the_document_mask(flavor):
    """Where both run (forward on CPU; CPU has no FlexAttention backward), the same numbers:
    fp32, measured 3.6e-7, bound 2e-6 (FlexAttention reduces blocks in another order). A model
    with a sliding (or chunked) block gets a BlockMask per window (BatchLayout's); its sinks (debug_sliding's)
    join FlexAttention's softmax through its log-sum-exp. The document ids come along: a linear
    block (debug_hybrid's) restarts its state at each document from them."""
    model = debug_model(flavor)
    with torch.no_grad():  # (sinks away from their init of 0: each head its own)
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(7)))
    tokens = packed([30, 50, 47], torch.Generator().manual_seed(3))[:, :128]
    _, _, sdpa_kwargs = BatchLayout("document", "sdpa", EOS, 0, 1, spans=model.args.spans)(tokens, tokens)
    _, _, flex_kwargs = BatchLayout("document", "flex", EOS, 0, 1, spans=model.args.spans)(tokens, tokens)
    assert set(flex_kwargs["mask"]) == {*model.args.spans, "documents"}
    with torch.no_grad():
        sdpa, flex = model(tokens, **sdpa_kwargs), model(tokens, **flex_kwargs)
    assert (sdpa - flex).abs().max() <= 2e-6


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_chunks_balance_causal_work_and_gather_back_in_sequence_order(cp):
    seq = 8 * cp
    shares = [chunk_indices(seq, r, cp) for r in range(cp)]
    assert sorted(torch.cat(shares).tolist()) == list(range(seq))
    # causal work of a rank: keys each of its queries sees; head-tail chunks make them equal
    assert len({int((share + 1).sum()) for share in shares}) == 1
    gathered = torch.cat(shares)[None, None, :, None].float()  # what an all-gather of each rank's share returns
    assert sequence_order(gathered, cp, 2).flatten().tolist() == list(range(seq))


def test_cp_shards_tokens_labels_positions_and_mask_rows_together():
    tokens = packed([5, 12, 20], torch.Generator().manual_seed(4))[:, :32]
    inputs, labels = tokens, tokens.roll(-1, 1)
    whole = BatchLayout("document", "sdpa", EOS, 0, 1)(inputs, labels)
    for rank in range(2):
        mine, their_labels, attention = BatchLayout("document", "sdpa", EOS, rank, 2)(inputs, labels)
        rows = chunk_indices(32, rank, 2)
        assert torch.equal(mine, inputs[:, rows]) and torch.equal(their_labels, labels[:, rows])
        assert torch.equal(attention["positions"], whole[2]["positions"][:, rows])
        assert torch.equal(attention["mask"], whole[2]["mask"])  # every key's document: the whole sequence's
        # causal: positions are the shard's sequence indices, one document for the mask rows
        _, _, causal = BatchLayout("causal", "sdpa", EOS, rank, 2)(inputs, labels)
        assert torch.equal(causal["positions"], rows.expand(1, -1))
        assert torch.equal(causal["mask"], torch.zeros_like(inputs))


def test_a_blocks_mask_is_built_from_document_ids_in_the_compute_dtype():
    mask = allowed(torch.zeros(1, 4, dtype=torch.long), torch.arange(4))
    assert torch.equal(allowed(torch.zeros(1, 4, dtype=torch.long), torch.arange(2, 4), 3), mask[:, :, 2:, :3])
    assert additive(mask, torch.bfloat16).dtype == torch.bfloat16
    assert additive(mask, torch.float32)[0, 0].tolist() == [[0, -float("inf"), -float("inf"), -float("inf")],
                                                           [0, 0, -float("inf"), -float("inf")],
                                                           [0, 0, 0, -float("inf")], [0, 0, 0, 0]]


def test_attention_sinks_join_each_softmax_as_one_more_score_with_no_value():
    """A sink logit per head (gpt-oss) in the SDPA path equals the explicit softmax over the
    scores and the sink, dropped after, under a document mask and a window: fp32, forward within
    1e-6 (measured 3.6e-7), gradients (sinks included: a sum over 700 rows) within 1e-6 of their
    largest entry (measured 1.3e-7; other kernels' summation orders)."""
    from plait.models.attention import masked_attention

    g = torch.Generator().manual_seed(6)
    q = torch.randn(1, 4, 700, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(1, 2, 700, 16, generator=g, requires_grad=True) for _ in range(2))
    sinks = torch.randn(4, generator=g, requires_grad=True)
    documents = document_ids(torch.randint(0, 40, (1, 700), generator=g), EOS)
    allowed_rows = allowed(documents, torch.arange(700), window=300)
    scores = (q @ k.repeat_interleave(2, 1).transpose(-1, -2) / 4).masked_fill(~allowed_rows, float("-inf"))
    with_sink = torch.cat([scores, sinks[None, :, None, None].expand(1, 4, 700, 1)], -1).softmax(-1)
    explicit = with_sink[..., :-1] @ v.repeat_interleave(2, 1)
    ours = masked_attention(q, k, v, documents, ((0, 700),), 300, sinks=sinks)
    assert (explicit - ours).abs().max() <= 1e-6
    grads = [torch.autograd.grad(out.square().sum(), (q, k, v, sinks)) for out in (explicit, ours)]
    assert max((a - b).abs().max() / a.abs().max() for a, b in zip(*grads)) <= 1e-6


@pytest.mark.parametrize("window", [0, 100, 700])
def test_masked_attention_in_query_blocks_equals_one_masked_sdpa_call(window):
    """Blocks of 512 queries over the keys up to their last query (under a window, from their
    first query's window on) compute what one SDPA call under the whole mask computes (measured
    bitwise in the forward; fp32 bounds 1e-6 forward and 1e-5 for gradients, which autograd sums
    over the blocks in another order), at a length that leaves a partial block. No tensor of
    queries x keys is kept for backward: each block's mask is built again there."""
    from plait.models.attention import masked_attention

    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 4, 1100, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(1, 2, 1100, 16, generator=g, requires_grad=True) for _ in range(2))
    documents = document_ids(torch.randint(0, 40, (1, 1100), generator=g), EOS)
    mask = additive(allowed(documents, torch.arange(1100), window=window), torch.float32)
    whole = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        blocks = masked_attention(q, k, v, documents, ((0, 1100),), window)
    assert saved and not [s for s in saved if len(s) == 4 and s[1] == 1 and s[-2] >= 512 and s[-1] >= 512]
    assert (whole - blocks).abs().max() <= 1e-6
    grads = [torch.autograd.grad(out.square().sum(), (q, k, v)) for out in (whole, blocks)]
    assert max((a - b).abs().max() for a, b in zip(*grads)) <= 1e-5
