"""For tests/test_interrupts.py's second Ctrl-C: with this folder on PYTHONPATH, Python imports
this file at start-up in every process of the job, and a rank that has taken a first Ctrl-C
holds at the step's agreement on the signal (plait.preemption.Preemption.agree) until a signal
ends it. Its step then cannot finish, nor be saved, before the test's second Ctrl-C, however
long the test takes to send it on a busy machine (the test waits for the first one's notice)."""

import importlib.abc
import importlib.util
import signal
import sys


def hold(module) -> None:
    agree = module.Preemption.agree

    def holding(self) -> None:
        while self.signum == signal.SIGINT:
            signal.pause()  # (returns after any handler ran; SIGINT's default action ends the process)
        agree(self)

    module.Preemption.agree = holding


class Hook(importlib.abc.MetaPathFinder):
    """Patches plait.preemption once it is imported, from wherever the job imports plait."""

    def find_spec(self, name, path, target=None):
        if name != "plait.preemption":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            hold(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, Hook())
