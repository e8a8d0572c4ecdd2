"""runtime.core.allocator: a freed large buffer's pages are reused, not faulted in again (in a child process each)."""

import ctypes
import subprocess
import sys

import pytest

CHILD = """
import resource, sys
import numpy as np
from runtime.core.allocator import retain_freed_memory
if sys.argv[1] == "retain":
    assert retain_freed_memory()

def step():   # a buffer above glibc's mmap threshold, touched and freed, as a gradient vector is each step
    a = np.ones(48 << 18, np.float32)
    del a

step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, check=True, timeout=60)
    return int(out.stdout.split()[-1])


def test_the_second_steps_buffer_reuses_the_first_ones_pages():
    if not hasattr(ctypes.CDLL(None), "gnu_get_libc_version"):
        pytest.skip("not glibc: the allocator settings do not apply")
    default, retained = _faults("default"), _faults("retain")
    assert default > 0, "with glibc's defaults a 48 MiB buffer comes back from the kernel with fresh pages"
    assert retained * 4 < default, (retained, default)
