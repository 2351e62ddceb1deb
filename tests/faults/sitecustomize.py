"""Faults for `plait doctor`'s tests, injected from outside plait: this folder on PYTHONPATH makes
Python import this file at start-up in every rank, and PLAIT_TEST_FAULTS="RANK:FAULT,..." gives
each named rank its fault."""

import os

FAULTS = dict(item.split(":") for item in os.environ.get("PLAIT_TEST_FAULTS", "").split(",") if item)
FAULT = FAULTS.get(os.environ.get("RANK", "0"))

if FAULT:
    import resource
    import time

    import torch

    matmul = torch.matmul

    if FAULT == "bitflip":  # silent data corruption: the last bit of one element of every matmul
        def flipped(a, b, **kwargs):
            out = matmul(a, b, **kwargs)
            out.view(torch.int16 if out.dtype == torch.bfloat16 else torch.int32).view(-1)[0] ^= 1
            return out

        torch.matmul = flipped
    elif FAULT == "slow":  # a throttled device: every matmul takes 4x its time, on any CPU
        def slowed(a, b, **kwargs):
            begin = time.perf_counter()
            out = matmul(a, b, **kwargs)
            time.sleep(3 * (time.perf_counter() - begin))
            return out

        torch.matmul = slowed
    elif FAULT == "version":  # another build of torch on this rank
        torch.__version__ = f"{torch.__version__}.other"
    elif FAULT == "disk":  # a full disk: every write past 1 MiB fails (EFBIG), as ENOSPC would
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    else:
        raise ValueError(f"PLAIT_TEST_FAULTS: unknown fault {FAULT!r}")
