"""Same-host copies between worker processes: one copy, by the kernel, from the source's memory into the reader's.

Two workers on one host need not send a state through loopback TCP (a copy
into the socket, one out of it, the stream's checks): the reader asks the
kernel to copy the source's buffers straight into its own
(``process_vm_readv``, Linux's cross-memory attach, the single-copy path MPI
libraries use between ranks on one node). What is here is the mechanism,
not what travels:

- :func:`local_name`: the abstract Unix socket a data server also listens on,
  named after its TCP address. Abstract names live in the host's network
  namespace, so connecting to it succeeds exactly when the server is on
  this host (a server elsewhere is never reached this way).
- :func:`peer_credentials`: the pid and uid the kernel vouches for at the
  other end of such a socket.
- :func:`readable_by`: lets one process read this one's memory for a while
  (needed only under Yama's ``ptrace_scope`` 1, which otherwise lets no
  sibling read; at 2 and above nothing can, and the reader falls back).
- :func:`read_into`: the copy itself, into destination arrays, in pieces.
- :func:`fresh_buffer`: aligned destination memory backed by huge pages
  where the kernel offers them (a page fault per 4 KiB of a fresh 123 MB
  buffer cost more than the copy on this project's VMs).

Any refusal by the kernel (``EPERM``: Yama or a container's policy;
``ENOSYS``) is :class:`CrossMemoryUnavailable`: the caller takes another
path. ``ESRCH`` (the source exited) and ``EFAULT`` (it freed the memory) are
``OSError`` s: the copy failed.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import socket
import struct
import sys
import threading
from collections.abc import Iterator

import numpy as np

__all__ = ["CrossMemoryUnavailable", "fresh_buffer", "local_name", "peer_credentials", "read_into", "readable_by",
           "supported"]

_PR_SET_PTRACER = 0x59616D61          # prctl: who may ptrace (and so read) this process under Yama
_YAMA_SCOPE = "/proc/sys/kernel/yama/ptrace_scope"
_ptracer_lock = threading.Lock()       # PR_SET_PTRACER names one process at a time


class CrossMemoryUnavailable(OSError):
    """This host (its kernel, Yama, a container's seccomp policy) does not let the reader read the source."""


def supported() -> bool:
    """Whether this platform has the calls at all (Linux with ``process_vm_readv``)."""
    return sys.platform.startswith("linux") and _libc() is not None


def local_name(address: str) -> str:
    """The abstract Unix socket name of the data server at TCP ``address`` (``host:port``).

    Unique on a host because the TCP address is, and reachable only from the
    same network namespace: a successful connect means "same host".
    """
    return "\0jax-elastic-data/" + address


def peer_credentials(sock: socket.socket) -> tuple[int, int]:
    """``(pid, uid)`` of the process at the other end of the Unix socket ``sock``, as the kernel saw it connect.

    The pid is in this process's pid namespace (0 when the peer's is not visible from here).
    """
    pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return pid, uid


@contextlib.contextmanager
def readable_by(pid: int) -> Iterator[None]:
    """While inside, process ``pid`` may read this process's memory (``process_vm_readv``).

    Without Yama (or at ``ptrace_scope`` 0) same-user processes may already,
    and nothing changes. At scope 1 this process names ``pid`` as its only
    ptracer (``PR_SET_PTRACER``) for the duration, one reader at a time, and
    names none again after. At 2 or 3 nothing helps: the reader's call is
    refused and it takes another path.
    """
    if _yama_scope() != 1:
        yield
        return
    libc = _libc()
    with _ptracer_lock:
        if libc is None or libc.prctl(_PR_SET_PTRACER, ctypes.c_ulong(pid), 0, 0, 0) != 0:
            yield   # the reader will be refused, and fall back
            return
        try:
            yield
        finally:
            libc.prctl(_PR_SET_PTRACER, ctypes.c_ulong(0), 0, 0, 0)


def read_into(pid: int, pieces: list[tuple[np.ndarray, int]]) -> None:
    """Copies, for each ``(dest, address)``, ``dest.nbytes`` bytes at ``address`` in process ``pid`` into ``dest``
    (a C-contiguous array), in one system call (the kernel copies; the GIL is released meanwhile).

    Raises :class:`CrossMemoryUnavailable` when the kernel does not allow it
    at all, ``OSError`` when the source is gone or the memory is not there
    (``ESRCH``, ``EFAULT``) or the copy came up short.
    """
    libc = _libc()
    if libc is None or pid <= 0:
        raise CrossMemoryUnavailable(errno.ENOSYS, "process_vm_readv is not available here")
    n = len(pieces)
    local, remote = (_IoVec * n)(), (_IoVec * n)()
    want = 0
    for i, (dest, address) in enumerate(pieces):
        if not dest.flags.c_contiguous:
            raise ValueError("a cross-memory destination must be C-contiguous")
        local[i].base, local[i].len = dest.ctypes.data, dest.nbytes
        remote[i].base, remote[i].len = address, dest.nbytes
        want += dest.nbytes
    got = libc.process_vm_readv(pid, local, n, remote, n, 0)
    if got < 0:
        code = ctypes.get_errno()
        if code in (errno.EPERM, errno.ENOSYS, errno.EACCES):
            raise CrossMemoryUnavailable(code, f"reading process {pid}'s memory: {os.strerror(code)}")
        raise OSError(code, f"reading process {pid}'s memory: {os.strerror(code)}")
    if got != want:
        raise OSError(errno.EFAULT, f"read {got} of {want} bytes from process {pid}")


_HUGE = 2 << 20


def fresh_buffer(nbytes: int) -> np.ndarray:
    """``nbytes`` of new, page-aligned uint8 memory of its own (freed when the last view of it goes), advised
    to use transparent huge pages: a large buffer filled once (a state copied in) faults in 2 MiB at a time."""
    size = max(nbytes, 1)
    mem = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if size >= _HUGE and hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):
            mem.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(mem, dtype=np.uint8, count=nbytes)


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_LIBC: list = []


def _libc():
    if not _LIBC:
        lib = None
        if sys.platform.startswith("linux"):
            with contextlib.suppress(OSError, AttributeError):
                lib = ctypes.CDLL(None, use_errno=True)
                lib.process_vm_readv.restype = ctypes.c_ssize_t
                lib.process_vm_readv.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                                                 ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong]
                lib.prctl.restype = ctypes.c_int
        _LIBC.append(lib)
    return _LIBC[0]


def _yama_scope() -> int:
    try:
        with open(_YAMA_SCOPE) as f:
            return int(f.read().strip() or 0)
    except (OSError, ValueError):
        return 0   # no Yama: same-user processes may read each other
