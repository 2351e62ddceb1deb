"""Which keys each query of a packed sequence may attend to, and at which RoPE position.

Pre-training packs documents end to end, separated by the end-of-text token. Under the
`document` mask a token attends only to earlier tokens of its own document and its RoPE
position counts from that document's start, so a packed sequence computes what each document
would compute alone. An end-of-text token opens the document after it (as a beginning-of-text
token would): the token that follows is predicted from the end-of-text alone, never from the
previous document, and stays in the loss, where it teaches how documents begin (generation
from an empty prompt starts from an end-of-text too). The window's first tokens, cut from a
document that began before it, count as a document that starts at position 0.

Llama 4's chunked blocks cut each document every `chunk` positions from its start (the whole
sequence from 0 under the causal mask, as transformers does): a chunk is a document of its own to
them (`chunk_segments`), so every kernel path below serves them unchanged.

The model gets a mask's recipe, not a mask: the document id of every key of the sequence
[batch, seq] (all zeros: causal alone). Attention builds each query block's boolean rows from it
(`allowed`) when it needs them, and again in backward, so no tensor of queries x keys is ever
held: at 128k tokens over cp 8 that tensor was 4 GiB per rank.
"""

from __future__ import annotations

import torch

from plait.config import ConfigError, JobConfig
from plait.hardware import pick_device


def document_ids(tokens: torch.Tensor, eos: int) -> torch.Tensor:
    """[batch, seq] -> the document of each token: the number of end-of-text tokens up to and
    including it (an end-of-text opens the next document)."""
    return torch.cumsum(tokens == eos, dim=1)


def positions_in_documents(documents: torch.Tensor) -> torch.Tensor:
    """Each token's distance from the first token of its document: RoPE restarts per document."""
    index = torch.arange(documents.shape[1], device=documents.device).expand_as(documents)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    return index - torch.cummax(torch.where(starts, index, 0), dim=1).values


def chunk_segments(documents: torch.Tensor, chunk: int) -> torch.Tensor:
    """[batch, seq] document ids -> the ids of each document's chunks of `chunk` positions: a new
    one wherever a token's position in its document is a multiple of `chunk` (0 included: every
    document's first token). `chunk` 0: the documents themselves."""
    if not chunk:
        return documents
    return torch.cumsum(positions_in_documents(documents) % chunk == 0, dim=1)


def allowed(documents: torch.Tensor, queries: torch.Tensor, end: int | None = None, start: int = 0,
            window: int = 0) -> torch.Tensor:
    """[batch, 1, len(queries), end - start] boolean mask: the queries at sequence indices
    `queries` against the keys start ... end - 1 in sequence order (default: all), causal and
    within one document (`documents` all zeros: causal alone); with a `window`, also fewer than
    `window` positions back (a query sees itself and the window - 1 keys before it, as
    transformers' sliding window does)."""
    end = documents.shape[1] if end is None else end
    key_index = torch.arange(start, end, device=queries.device)
    back = queries[:, None] - key_index[None, :]
    mask = (back >= 0) & (documents[:, queries, None] == documents[:, None, start:end])
    if window:
        mask &= back < window
    return mask[:, None]


def additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as SDPA's additive float mask (0 where allowed, -inf elsewhere) in `dtype`."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def block_mask(documents: torch.Tensor, queries: torch.Tensor, window: int = 0):
    """The same mask as FlexAttention's BlockMask: it skips the blocks no query may attend to
    (under a window, all but the few blocks along the diagonal)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def document_causal(b, h, q, k):
        back = queries[q] - k
        visible = (back >= 0) & (documents[b, queries[q]] == documents[b, k])
        return visible & (back < window) if window else visible

    return create_block_mask(document_causal, documents.shape[0], None, len(queries), documents.shape[1],
                             device=documents.device)


def attention_kernel(cfg: JobConfig) -> str:
    """`model.attention` settled: auto is flex where it trains and pays (the document mask on
    CUDA, no pp or cp, no dtype probe: FlexAttention trains compiled, the probe records eager ops),
    else sdpa."""
    m, p = cfg.model, cfg.parallelism
    if m.attention != "auto":
        return m.attention
    cuda = pick_device(cfg.training.device).type == "cuda"
    flex = cuda and m.attention_mask == "document" and p.pp == 1 and p.cp == 1 and not cfg.debug.dtype_probe
    return "flex" if flex else "sdpa"


def check_attention(cfg: JobConfig) -> None:
    """`model.attention flex` against the other options and the device: one line each."""
    m, p = cfg.model, cfg.parallelism
    if m.attention != "flex":
        return
    if m.attention_mask != "document":
        raise ConfigError("model.attention: flex serves the document mask; under model.attention_mask causal "
                          "allowed: auto or sdpa (SDPA's causal path needs no mask at all)")
    if p.pp > 1 or p.cp > 1:
        raise ConfigError("model.attention: flex is not proven with pp > 1 or cp > 1 (a pipeline splits its inputs "
                          "by tensor, and a BlockMask is none); allowed there: auto or sdpa")
    if cfg.debug.dtype_probe:
        raise ConfigError("model.attention: flex runs compiled, and debug.dtype_probe records eager ops (a job "
                          "probed under FlexAttention failed on an H200 in the compiler); allowed with the probe: auto or sdpa")
    if pick_device(cfg.training.device).type != "cuda":
        raise ConfigError("model.attention: flex cannot train on this device (torch 2.13 has no FlexAttention "
                          "backward on CPU); allowed: auto or sdpa (SDPA with the document mask)")
