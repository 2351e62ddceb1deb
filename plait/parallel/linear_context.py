"""Context parallelism for linear attention (plait/models/linear_attention.py). A cp rank holds
chunks r and 2·cp-1-r of the sequence (`chunk_indices`, load-balanced for causal attention), and
a linear block's chunk needs what only the chunks before it know: the state the rule carries in,
and the convolution's last taps - 1 inputs.

The rule is linear in its incoming state S: a chunk's output is O + Q S and its final state A S + B,
where O and B are the chunk's from a zero state, and Q and A its run with zero values from the
identity (every output's read of the incoming state; its share of the final one). Each rank runs
its two chunks both ways, all-gathers every chunk's (A, B) (with autograd: the backward
reduce-scatters their gradients), scans them in sequence order to its chunks' incoming states
(zero where a document starts with the chunk: the rule restarts there) and adds their reads.
What crosses ranks is two states a head per chunk, whatever the sequence's length; the rule's
work doubles (the identity's values are key-dim wide). The convolutions' windows are all-gathered
the same way: each chunk's last taps - 1 inputs.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol

from plait.models.linear_attention import GatedDeltaNet, causal_conv, gated_delta_rule


def owner_index(chunk: int, cp: int) -> int:
    """Where chunk `chunk`'s entry lies in a rank-by-rank all-gather of every rank's two chunks."""
    return 2 * chunk if chunk < cp else 2 * (2 * cp - 1 - chunk) + 1


def apply_linear_cp(module: GatedDeltaNet, group, rank: int, cp: int) -> None:
    """Replace `module.mix` with one whose chunks continue the chunks before them, on any rank."""

    def mix(qkv: list[torch.Tensor], g: torch.Tensor, beta: torch.Tensor, documents: torch.Tensor | None,
            cache=None) -> torch.Tensor:
        # (cp ranks get the whole sequence's document ids, [batch, seq]; none: one document)
        batch, length = g.shape[:2]
        half, chunks, tail = length // 2, (rank, 2 * cp - 1 - rank), module.conv_q.shape[1] - 1
        if documents is None:
            documents = torch.zeros(batch, 2 * cp * half, dtype=torch.long, device=g.device)
        docs = documents.view(batch, 2 * cp, half)
        widths = [t.shape[-1] for t in qkv]
        x = torch.cat(qkv, -1)
        windows = torch.stack([x[:, half - tail:half], x[:, length - tail:]], 1).contiguous()
        every_window = funcol.all_gather_tensor_autograd(windows, gather_dim=1, group=group)
        outputs, reads = [], []
        for i, c in enumerate(chunks):
            mine = slice(i * half, (i + 1) * half)
            history = every_window[:, owner_index(c - 1, cp)].split(widths, -1) if c else (None,) * 3
            ids = torch.cat([docs[:, c - 1, -tail:], docs[:, c]], 1) if c else docs[:, c]
            convolved = [causal_conv(t[:, mine], module.local(f"conv_{name}"), ids, h)
                         for t, name, h in zip(qkv, "qkv", history)]
            q, k, v = module.heads(*convolved)
            out, final = gated_delta_rule(q, k, v, g[:, mine], beta[:, mine], docs[:, c], None, module.chunk)
            identity = torch.eye(q.shape[-1], device=q.device).expand(batch, q.shape[2], -1, -1)
            read, through = gated_delta_rule(q, k, torch.zeros_like(q), g[:, mine], beta[:, mine], docs[:, c],
                                             identity, module.chunk)
            outputs.append(out)
            reads.append((read, torch.cat([through, final], -1)))
        every = funcol.all_gather_tensor_autograd(torch.stack([r[1] for r in reads], 1), gather_dim=1, group=group)
        state, incoming = None, {}
        for c in range(max(chunks) + 1):  # the state into each chunk, in sequence order
            if c:
                continues = (docs[:, c, 0] == docs[:, c - 1, -1]).float()[:, None, None, None]
                incoming[c] = state * continues
            transition, start = every[:, owner_index(c, cp)].split([q.shape[-1], v.shape[-1]], -1)
            state = start if c == 0 else transition @ incoming[c] + start
        return torch.cat([out + torch.einsum("bthk,bhkv->bthv", read, incoming[c]) if c else out
                          for out, (read, _), c in zip(outputs, reads, chunks)], 1)

    module.mix = mix
