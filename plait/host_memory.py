"""Whether the process keeps the host memory it frees: on a CPU, where the activations live.

glibc's malloc serves large blocks with mmap and hands freed memory at the heap's top back to
the OS. A training step frees and re-allocates the same activations every step, so each step
faulted them in again page by page: on a 2-core Xeon, `plait train` of `small` took 16K-500K
minor page faults per step and a bf16 step ran 5-8% slower than the same step with none
(docs/performance.md). jemalloc and tcmalloc, which PyTorch's CPU performance guide
recommends, keep freed memory in the process; `retain` makes glibc do so with two documented
mallopt(3) settings: no mmap for large blocks, no trimming. A step reaches the same peak every
step, so the peak resident set does not grow (measured: 3.05 GiB either way).

On CUDA the activations live in PyTorch's caching allocator, which already keeps them; host
memory there holds checkpoint and data buffers that are better handed back, so `auto` leaves
glibc as it is.
"""

from __future__ import annotations

import ctypes
import platform

import torch

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # mallopt's parameter numbers (malloc.h)


def configure(choice: str, device: torch.device) -> bool:
    """Apply `training.host_memory` (auto = retain on a CPU device); True where it retains."""
    if choice == "release" or (choice == "auto" and device.type != "cpu"):
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False  # other allocators keep their own policy
    libc = ctypes.CDLL(None)  # the process's C library
    # man mallopt: M_MMAP_MAX 0 disables mmap for large requests; M_TRIM_THRESHOLD -1 disables trimming.
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, -1))
