"""Activation checkpointing: keep less from forward to backward, recompute the rest.

Applied per transformer block from outside the model, by wrapping the block's forward in
non-reentrant `torch.utils.checkpoint` (FQNs, and so plans and checkpoints, stay those of the
plain model):

- `full`: a block keeps only its input; backward re-runs its whole forward.
- `selective`: a block keeps the outputs of its matmuls, attention and TP reductions (the
  expensive ops) and recomputes the rest (norms, RoPE, SiLU, casts, views): less memory than
  `none` for a few percent of recompute.
- `every` N: only blocks 0, N, 2N, ... are checkpointed, trading memory against recompute.

SimpleFSDP reshards by the same mechanism (its blocks recompute their parameter all-gathers in
backward), so it asks this module for its blocks' checkpoint too: one checkpoint per block,
never two nested ones.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from plait.models.expert_matmul import expert_matmul

# Outputs `selective` keeps: matmuls (experts' grouped ones too), attention (every backend's kernel), and TP's reductions
# (as torchtitan does). All-gathers are recomputed on purpose: SimpleFSDP's parameter gathers,
# because recomputing them is what frees the gathered parameters between forward and backward,
# and TP's sequence-parallel gathers, which are activations as large as a block input. Measured
# under TP (full and selective alike): a checkpointed block's backward repeats two all-gathers
# and one reduce-scatter; plan predicts exactly these (tests/test_plan.py).
_ops = torch.ops.aten
MATMULS = {_ops.mm.default, _ops.addmm.default, _ops.bmm.default, _ops._grouped_mm.default,
           expert_matmul._opoverload,  # (plait's, outside bf16)
           _ops._scaled_dot_product_flash_attention_for_cpu.default,
           _ops._scaled_dot_product_flash_attention.default,
           _ops._scaled_dot_product_efficient_attention.default,
           _ops._scaled_dot_product_cudnn_attention.default}
SAVED_OPS = MATMULS | {torch.ops._c10d_functional.reduce_scatter_tensor.default,
                      torch.ops._c10d_functional.all_reduce.default}


# An FSDP2 unit inside a block (the experts under ep) opens profiler ranges in its hooks, more of
# them when a recomputation meets it in backward than in forward; they hold no tensors, so the
# checkpoint need not match them (as it does not match detach).
torch.utils.checkpoint.SAC_IGNORED_OPS |= {torch.ops.profiler._record_function_enter_new.default,
                                          torch.ops.profiler._record_function_exit._RecordFunction}


# MUST_*, not PREFER_*: under torch.compile the partitioner would otherwise decide for itself.
def _selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.MUST_RECOMPUTE


def _full_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_RECOMPUTE


def checkpoint_block(block: nn.Module, selective: bool) -> None:
    """Wrap `block.forward` in a checkpoint: selective (keep SAVED_OPS' outputs) or full (keep
    nothing inside the block)."""
    forward = block.forward
    # Full is a policy too, rather than checkpoint's default: torch.compile traces a policy's
    # context around SimpleFSDP's parametrized blocks, not the default (it would save the mesh).
    context = functools.partial(create_selective_checkpoint_contexts, _selective_policy if selective else _full_policy)

    def checkpointed_forward(*args, **kwargs):
        if not torch.is_grad_enabled():  # evaluation: nothing to save, nothing to recompute
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, **kwargs, use_reentrant=False, context_fn=context)

    block.forward = checkpointed_forward


def checkpointed_blocks(n_blocks: int, mode: str, every: int) -> list[int]:
    """Indices of the blocks `mode` (none/full/selective) checkpoints: every `every`-th from block 0."""
    return [] if mode == "none" else [i for i in range(n_blocks) if i % every == 0]


def apply_ac(model: nn.Module, mode: str, every: int, n_blocks: int, at_least_selective: bool = False) -> None:
    """Checkpoint the blocks `mode` chooses; with `at_least_selective` (SimpleFSDP resharding)
    the others selectively. Indices are the whole model's (`n_blocks` blocks), so a pipeline
    stage holding blocks 4-7 checkpoints the same blocks one device would."""
    chosen = set(checkpointed_blocks(n_blocks, mode, every))
    for name, block in model.layers.items():
        if int(name) in chosen:
            checkpoint_block(block, selective=mode == "selective")
        elif at_least_selective:
            checkpoint_block(block, selective=True)
