"""Keeps freed host memory in the process, so a step's large buffers reuse pages.

Every step allocates and frees the same large buffers: the gradient vector,
the reduced sum, the new state. glibc's ``malloc`` hands a buffer above its
mmap threshold (at most 32 MiB) to ``mmap`` and gives it back to the kernel
when freed, and trims the heap's free top: the next step's buffer of the same
size then starts as fresh pages, and the process pays a page fault for every
4 KiB it touches (a 41 MB gradient: about 10,000 faults, 20-30 ms on this
kind of host, on every microbatch and every apply). Measured on the 10.3 M
parameter model: the apply program 63 -> 34 ms, the host->device copy of the
reduced gradient 32 -> 0.1 ms (benchmarks/step_time.py, docs/performance.md).

:func:`retain_freed_memory` tells glibc (``mallopt``) to serve large blocks
from the heap and to keep a freed top, as TCMalloc and jemalloc do by design.
The price is that a worker's resident memory stays at its peak instead of
shrinking between steps, which a training process reaches every step anyway.
Elsewhere than glibc (musl, macOS) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

__all__ = ["retain_freed_memory"]

log = logging.getLogger("jax_elastic.allocator")

# mallopt parameters (glibc malloc.h).
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
KEEP_FREE_TOP = 2**31 - 1    # bytes of free heap top kept before trimming (mallopt takes a C int)


def retain_freed_memory() -> bool:
    """Large blocks from the heap, freed memory kept: returns whether glibc took both settings."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        libc.gnu_get_libc_version   # only glibc has it (and mallopt with these meanings)
    except (OSError, AttributeError):
        return False
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, KEEP_FREE_TOP))
    if not ok:
        log.warning("glibc refused the allocator settings; large buffers will fault in fresh pages every step")
    return ok
