"""torchrun's agent as `plait train --nproc` runs it: a signal that stops the job ends the agent
with 128 + the signal's number instead of SignalException's traceback (its workers, which it
has already told to stop, say what happened)."""

import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.run import main

if __name__ == "__main__":
    try:
        main()
    except SignalException as e:
        sys.exit(128 + int(e.sigval))
