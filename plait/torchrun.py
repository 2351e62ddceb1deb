"""torchrun's agent as `plait train --nproc` runs it: a signal that stops the job ends the agent
with 128 + the signal's number instead of SignalException's traceback (its workers, which it
has already told to stop, say what happened). One that comes while the agent starts (Python's
start-up, torch's import: seconds, more on a busy machine) ends it at once with that code: it
has started no worker yet (a Ctrl-C there was a KeyboardInterrupt traceback)."""

import os
import signal
import sys

if __name__ == "__main__":
    # the signals it is told to handle (--signals-to-handle=..., as plait's launcher passes them;
    # one this process was started ignoring is not among them)
    HANDLED = [getattr(signal, name) for arg in sys.argv[1:] if arg.startswith("--signals-to-handle=")
               for name in arg.split("=", 1)[1].split(",") if name]
    for sig in HANDLED:
        signal.signal(sig, lambda signum, frame: os._exit(128 + signum))

import torch.distributed.elastic.multiprocessing.api as elastic  # noqa: E402
from torch.distributed.elastic.multiprocessing.api import SignalException  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # noqa: E402
from torch.distributed.run import main  # noqa: E402

from plait.launch import die_with_parent  # noqa: E402

raise_signal_exception = elastic._terminate_process_handler
stopping: list[int] = []


def signal_behind(error: BaseException) -> SignalException | None:
    """The SignalException `error` was raised while handling, if any: the signal can land anywhere
    in the agent, e.g. inside torch's metrics wrapper before it set its start time, whose `finally`
    then raises an UnboundLocalError over it (seen once in CI)."""
    while error is not None and not isinstance(error, SignalException):
        error = error.__context__
    return error


def stop_once(signum, frame) -> None:
    """The agent's first stopping signal raises as torchrun's own handler does; a repeat is
    ignored. A scheduler signals every process and plait's launcher forwards the signal too, so
    the agent gets two: the second, raised inside the first one's shutdown (logging it, or waiting
    for the workers' saves), printed a 'Logging error' traceback or cut the wait short."""
    if not stopping:
        stopping.append(signum)
        raise_signal_exception(signum, frame)


if __name__ == "__main__":
    die_with_parent()  # (the launcher's: a SIGKILL to it ends the job, not only the launcher)
    elastic._terminate_process_handler = stop_once  # looked up when the agent registers its handlers
    for sig in HANDLED:  # from here until it does (its rendezvous, say): the agent shuts down what it started
        signal.signal(sig, stop_once)
    try:
        main()
    except SignalException as e:
        sys.exit(128 + int(e.sigval))
    except ChildFailedError as e:
        # A worker that refused the job (exit 2) has said why in one line; torchrun's report of
        # it would bury that line under a traceback. Any other failure keeps the report.
        if e.get_first_failure()[1].exitcode != 2:
            raise
        sys.exit(2)
    except Exception as e:
        if (stopped := signal_behind(e)) is None:
            raise
        sys.exit(128 + int(stopped.sigval))
