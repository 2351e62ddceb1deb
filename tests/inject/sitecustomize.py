"""Behaviour planted from outside plait in every process of a job: with this folder on PYTHONPATH,
Python imports this file at start-up, and an environment variable says what to plant once the
module it patches is imported (from wherever the job imports plait):

PLAIT_HOLD=1 (tests/test_interrupts.py's second Ctrl-C): a rank that has taken a first Ctrl-C
holds at the step's agreement on the signal (plait.preemption.Preemption.agree) until a signal
ends it. Its step then cannot finish, nor be saved, before the test's second Ctrl-C, however long
the test takes to send it on a busy machine (the test waits for the first one's notice).

PLAIT_FAULT (tests/test_diagnostics.py), in the training step (plait.step):
  spike:STEP      the loss of step STEP x 1000 (its gradient too): a batch the model finds absurd
  nan:PARAM       one NaN in parameter PARAM (the first element of rank 0's shard) before step 1
  nan_grad:MODULE the gradient that reaches MODULE's output in backward is NaN (forward stays finite)
  usr2:STEP       every rank sends itself SIGUSR2 at the start of step STEP (as a person would the job)
  slow:SECONDS    rank 1 sleeps SECONDS at the start of every step (a slower rank: the others wait for it)
  stall:STEP      rank 1 stops at the start of step STEP for good: the others wait in its collective
  halt:STEP       every rank stops at the start of step STEP for good (tests/test_checkpoint.py: a job
                  killed once an earlier step's line is out has gone no further, however late the
                  test reads the line on a busy machine)
  inf_input       the embedding of the token at row 1, position 5 of step 1's first micro-batch is
                  inf (an input the model cannot take; one process)
"""

import importlib.abc
import importlib.util
import os
import signal
import sys
import threading


def hold(module) -> None:
    agree = module.Preemption.agree

    def holding(self) -> None:
        while self.signum == signal.SIGINT:
            signal.pause()  # (returns after any handler ran; SIGINT's default action ends the process)
        agree(self)

    module.Preemption.agree = holding


FAULT = os.environ.get("PLAIT_FAULT", "")


def plant(module) -> None:
    import torch
    from torch.distributed.tensor import DTensor

    kind, _, arg = FAULT.partition(":")
    step_class = module.TrainStep
    call, loss = step_class.__call__, step_class.loss

    def local(p):
        return p.to_local() if isinstance(p, DTensor) else p

    def spiking(self, step):
        self.fault_step = step
        return call(self, step)

    def spiked_loss(self, batches, watch=None):
        if getattr(self, "fault_step", None) != int(arg):
            return loss(self, batches, watch)
        hook = self.model.register_forward_hook(lambda module, args, output: output * 1000)
        try:
            return loss(self, batches, watch)
        finally:
            hook.remove()

    def nan_then_call(self, step):
        if step == 1:
            with torch.no_grad():
                shard = local(dict(self.model.named_parameters())[arg])
                if shard.numel() and torch.distributed.get_rank() == 0:
                    shard.view(-1)[0] = float("nan")
        return call(self, step)

    def inf_input_loss(self, batches, watch=None):
        if not getattr(self, "fault_planted", False):
            self.fault_planted = True
            with torch.no_grad():
                self.model.tok_embeddings.weight[int(batches[0][0][1, 5])] = float("inf")
        return loss(self, batches, watch)

    def nan_grad_call(self, step):
        if step == 1:
            module = dict(self.model.named_modules())[arg]
            module.register_full_backward_pre_hook(lambda module, grad: tuple(g * float("nan") for g in grad))
        return call(self, step)

    def stalling_call(self, step):
        if step == int(arg) and torch.distributed.get_rank() == 1:
            threading.Event().wait()  # (as a rank stuck in its data or a file system: no collective comes)
        return call(self, step)

    def halting_call(self, step):
        if step == int(arg):
            threading.Event().wait()
        return call(self, step)

    def signalling_call(self, step):
        if step == int(arg):
            os.kill(os.getpid(), signal.SIGUSR2)
        return call(self, step)

    def slow_call(self, step):
        if torch.distributed.get_rank() == 1:
            threading.Event().wait(float(arg))
        return call(self, step)

    patches = {"spike": {"__call__": spiking, "loss": spiked_loss}, "nan": {"__call__": nan_then_call},
               "nan_grad": {"__call__": nan_grad_call}, "usr2": {"__call__": signalling_call},
               "slow": {"__call__": slow_call}, "stall": {"__call__": stalling_call},
               "halt": {"__call__": halting_call},
               "inf_input": {"loss": inf_input_loss}}
    for name, patched in patches[kind].items():
        setattr(step_class, name, patched)


class Hook(importlib.abc.MetaPathFinder):
    """Patches module `name` with `patch` once it is imported."""

    def __init__(self, name: str, patch):
        self.name, self.patch = name, patch

    def find_spec(self, name, path, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            self.patch(module)

        spec.loader.exec_module = exec_module
        return spec


def when_imported(name: str, patch) -> None:
    """Patch module `name` now if it is imported (in a process forked after its imports:
    tests/forkserver.py), else once it is."""
    if name in sys.modules:
        patch(sys.modules[name])
    else:
        sys.meta_path.insert(0, Hook(name, patch))


if os.environ.get("PLAIT_HOLD"):
    when_imported("plait.preemption", hold)
if FAULT:
    when_imported("plait.step", plant)
