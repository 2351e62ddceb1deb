"""Initial weights that are bitwise the same in every layout.

Each parameter's full value comes from (seed, parameter name) alone (`model.initial_value`);
a rank that holds a shard (a DTensor) cuts its piece out of that full value locally. No
random stream is shared between ranks and no collective runs, so the result cannot depend on
the mesh. (Initialising DTensors directly with torch's RNG on CPU would not work: there is no
DTensor RNG tracker there, so every rank would draw the same numbers for different shards.)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from plait.models.transformer import Transformer, initial_value


def init_weights(model: Transformer, seed: int) -> None:
    """Fill every parameter of a model already placed on its device (after `to_empty`)."""
    fill_weights(model, lambda name, shape: initial_value(model, name, shape, seed))


@torch.no_grad()
def fill_weights(model: Transformer, full_value: Callable[[str, torch.Size], torch.Tensor],
                 buffers: Mapping[str, torch.Tensor] | None = None) -> None:
    """Set every parameter from `full_value(name, full shape)`, each rank keeping its own piece,
    and the buffers named in `buffers` (a Hugging Face folder's router biases) from theirs."""
    for name, param in model.named_parameters():
        full = full_value(name, param.shape).to(param.dtype)
        if isinstance(param, DTensor):
            # src_data_rank=None: every rank has `full`, so slicing needs no communication.
            piece = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(piece.to_local())
        else:
            param.copy_(full)
    model.reset_buffers()
    for name, buffer in model.named_buffers():
        if name in (buffers or {}):
            buffer.copy_(buffers[name])
