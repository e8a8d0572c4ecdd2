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

import logging
import os
import pathlib

__all__ = ["enable", "DEFAULT_MAX_BYTES"]

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
