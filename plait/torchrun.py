"""torchrun's agent as `plait train --nproc` runs it: a signal that stops the job ends the agent
with 128 + the signal's number instead of SignalException's traceback (its workers, which it
has already told to stop, say what happened)."""

import sys

import torch.distributed.elastic.multiprocessing.api as elastic
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.run import main

raise_signal_exception = elastic._terminate_process_handler
stopping: list[int] = []


def stop_once(signum, frame) -> None:
    """The agent's first stopping signal raises as torchrun's own handler does; a repeat is
    ignored. A scheduler signals every process and plait's launcher forwards the signal too, so
    the agent gets two: the second, raised inside the first one's shutdown (logging it, or waiting
    for the workers' saves), printed a 'Logging error' traceback or cut the wait short."""
    if not stopping:
        stopping.append(signum)
        raise_signal_exception(signum, frame)


if __name__ == "__main__":
    elastic._terminate_process_handler = stop_once  # looked up when the agent registers its handlers
    try:
        main()
    except SignalException as e:
        sys.exit(128 + int(e.sigval))
