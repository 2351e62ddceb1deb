"""An exponential moving average of the weights (`training.ema`): after each update,
average = decay x average + (1 - decay) x weights, from the weights the run starts with.

The average is held as the parameters are, in their sharding (a DTensor per parameter under
FSDP2, TP or both), so it costs each rank one more float32 copy of its own shard of the
parameters (plait plan counts it) and any layout resumes it: it is saved with every checkpoint as
DCP's `ema`, under the model's own names (those of its state dict: no wrapper of compile, DDP or
activation checkpointing in them), the manifest recording the decay; `--weights ema` reads it back
in export, eval and generate. A checkpoint without one (a seed, a run without ema) starts
the average from its weights.
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from plait import float8

WRAPPERS = ("_orig_mod.", "_checkpoint_wrapped_module.")  # (torch.compile's, activation checkpointing's)


def model_name(name: str, model: torch.nn.Module) -> str:
    """A parameter's name as the model's state dict (and a one-device Transformer) has it."""
    for wrapper in WRAPPERS:
        name = name.replace(wrapper, "")
    return name.removeprefix("module.") if hasattr(model, "module") else name


class WeightAverage:
    def __init__(self, model: torch.nn.Module, decay: float, float8_on: bool):
        self.decay = decay
        params = {model_name(name, model): p.detach() for name, p in model.named_parameters()}
        unknown = set(params) - set(get_model_state_dict(model))
        assert not unknown, f"parameters without a state-dict name: {sorted(unknown)[:3]}"
        # float8's weights wrap their fp32 masters: the average is of the masters (views of their storage)
        self.params = float8.master_weights({"ema": params})["ema"] if float8_on else params
        self.restart()

    def restart(self) -> None:
        """The average from the weights as they are now (after a checkpoint without one loaded)."""
        self.average = {name: p.detach().clone() for name, p in self.params.items()}

    @torch.no_grad()
    def update(self) -> None:
        for name, p in self.params.items():
            self.average[name].lerp_(p, 1 - self.decay)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.average
