"""JAX's persistent compilation cache, shared by the processes of a run.

Contract:

* :func:`enable(path)` turns JAX's on-disk cache on for this process at
  ``path`` (created if missing), for every program whatever its compile time
  or size: the first process to compile a program writes it, every other
  process (the workers of a run, its spares, relaunched workers, the
  reference run, later runs with the same directory) loads it instead of
  compiling. It may be called again with the same path (no-op) or another
  one (the cache moves). An empty ``path`` turns the cache off.
* Entries are read and written under JAX's file lock (the cache is given a
  size bound, which is what turns the lock on), so a reader never sees a
  half-written entry of a live writer. An entry left truncated by a writer
  that was killed mid-write fails to decompress; JAX warns and compiles
  instead, so a bad entry costs a compile, never a wrong program.
* The cache is trusted code: whoever can write to the directory can make
  the processes that read it run anything. Keep it private to the run's user
  (it is created with mode 0700).

Imports JAX: call it in processes that compile (workers, the reference run).
"""

from __future__ import annotations

import hashlib
import logging
import os
import pathlib

__all__ = ["enable", "enabled", "DEFAULT_MAX_BYTES", "holds", "mark_held"]

log = logging.getLogger("jax_elastic.compile_cache")

#: The size bound given to JAX's cache (least recently used entries go first beyond it).
DEFAULT_MAX_BYTES = 4 << 30

_current: str | None = None


def enable(path: str, max_bytes: int = DEFAULT_MAX_BYTES) -> str:
    """Points JAX's persistent compilation cache of this process at ``path``; returns the path used ("" = off)."""
    global _current
    import jax
    from jax.experimental.compilation_cache import compilation_cache as cc

    resolved = str(pathlib.Path(path).expanduser().resolve()) if path else ""
    if resolved == _current:
        return resolved
    if resolved:
        os.makedirs(resolved, mode=0o700, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", resolved or None)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    jax.config.update("jax_compilation_cache_max_size", max_bytes if resolved else -1)
    cc.reset_cache()   # JAX initializes its cache once, at the first compile: start it again here
    _current = resolved
    log.info("compilation cache %s", resolved or "off")
    return resolved


def enabled() -> str:
    """The cache this process uses ("": none)."""
    return _current or ""


# -- which program sets a cache holds -----------------------------------------------------------------
# A run's controller loads its programs on one worker first, so that one process compiles and the others
# read the cache. When the cache already holds them (an earlier run, or this run's reference run, loaded
# the same programs), that wait buys nothing: every worker loads at once. JAX's cache keys cannot be
# computed without lowering the programs, so a marker per program set says so instead. A wrong marker
# (the entries were evicted since) only costs the workers compiling side by side.

_MARKERS = "jax-elastic-loaded"   # a subdirectory: JAX's cache files are beside it, never in it


def _marker(path: str, programs: dict[str, bytes], devices: int) -> pathlib.Path:
    h = hashlib.sha256(f"{devices}".encode())
    for name in sorted(programs):
        h.update(name.encode() + b"\0" + hashlib.sha256(programs[name]).digest())
    return pathlib.Path(path).expanduser() / _MARKERS / h.hexdigest()


def holds(path: str, programs: dict[str, bytes], devices: int) -> bool:
    """Whether a process already loaded ``programs`` (exported for ``devices`` devices) with the cache at ``path``."""
    return bool(path) and _marker(path, programs, devices).exists()


def mark_held(path: str, programs: dict[str, bytes], devices: int) -> None:
    """Records that ``programs`` were loaded (so compiled into the cache at ``path``); best effort."""
    if not path:
        return
    marker = _marker(path, programs, devices)
    try:
        marker.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        marker.touch()
    except OSError as e:
        log.debug("could not mark programs as cached at %s: %s", marker, e)
