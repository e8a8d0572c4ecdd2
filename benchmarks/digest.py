"""The whole-state digest's candidates against this machine's memory-copy speed, in one invocation.

Builds a state of numpy leaves (``--mb`` MB in all, shaped like a
transformer's parameters and Adam moments: large matrices, smaller ones,
vectors, a step counter) and times, median of ``--repeats``:

- memcpy: ``numpy.copyto`` of every leaf into a leaf of its own (the baseline);
- each candidate digest over the leaves as the runtime hashes them (each
  leaf's layout, then its bytes): sha256 (hashlib, the digest before), BLAKE3
  (the ``blake3`` package) on one thread and with ``max_threads=AUTO``
  (also over the whole state as one buffer, its best case),
  xxh3_128 and xxh3_64 (the ``xxhash`` package; xxh3_64 is the per-chunk
  check of every transfer, shown for reference);
- the runtime's own paths: ``state_digest`` with the current algorithm and
  with sha256, and a receiver assembling and checking the state from its
  chunks in this process (``assemble_state``: the chunk copy, the xxh3_64 per
  chunk and the digest on its own thread), with each algorithm.

For each: wall milliseconds, GB/s, speed against memcpy (x memcpy: 1.0 is
memory speed) and the CPU time of the process over the timed calls
(``/proc/self/stat``; it exceeds the wall time when threads hash in parallel).
The last line is the chosen digest's speed against memcpy.

Usage: .venv/bin/python benchmarks/digest.py [--mb 256] [--repeats 5]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import pathlib
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import xxhash

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from runtime.state.state_copy import DIGEST, assemble_state, state_chunks, state_digest  # noqa: E402
from runtime.wire.parts import DEFAULT_CHUNK_BYTES, inline  # noqa: E402

try:
    import blake3
except ImportError:   # not a dependency of the runtime: `pip install blake3` to measure it
    blake3 = None

_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds() -> float:
    """User + system CPU of this process, all threads (``/proc/self/stat`` fields 14 and 15)."""
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def make_state(total_bytes: int) -> list[np.ndarray]:
    """float32 leaves of about ``total_bytes``: per layer a 4 MiB and a 1 MiB matrix and two vectors, three
    times over (parameters, Adam's mu and nu), then an int32 step counter."""
    rng = np.random.default_rng(0)
    per_layer = (1024 * 1024 + 512 * 512 + 2 * 1024) * 4 * 3
    layers = max(1, total_bytes // per_layer)
    shapes = [s for _ in range(layers) for s in ((1024, 1024), (512, 512), (1024,), (1024,))]
    leaves = [rng.standard_normal(s, dtype=np.float32) for _ in range(3) for s in shapes]
    return leaves + [np.array(7, dtype=np.int32)]


def layout_then_bytes(new) -> Callable[[list[np.ndarray]], str]:
    """A digest of ``new()``'s hasher over each leaf's layout, then its bytes (what the runtime hashes)."""
    def digest(leaves):
        h = new()
        for x in leaves:
            h.update(str((x.shape, x.dtype.str)).encode())
            h.update(x.reshape(-1).view(np.uint8))
        return h.hexdigest()
    return digest


def timed(fn, repeats: int) -> tuple[float, float]:
    """``(median wall seconds, CPU seconds per call)`` of ``fn()`` over ``repeats`` calls, after one warm-up."""
    fn()
    walls = []
    c0 = cpu_seconds()
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        walls.append(time.perf_counter() - t0)
    return statistics.median(walls), (cpu_seconds() - c0) / repeats


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=256, help="state size in MB")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    leaves = make_state(args.mb * 10**6)
    nbytes = sum(x.nbytes for x in leaves)
    copies = [np.empty_like(x) for x in leaves]

    def memcpy():
        for dst, src in zip(copies, leaves):
            np.copyto(dst, src)

    candidates: dict[str, Callable[[], object]] = {
        "sha256 (hashlib)": lambda: layout_then_bytes(hashlib.sha256)(leaves),
    }
    if blake3 is not None:
        candidates["blake3, 1 thread"] = lambda: layout_then_bytes(blake3.blake3)(leaves)
        candidates[f"blake3, max_threads=AUTO ({os.cpu_count()} cpus)"] = lambda: layout_then_bytes(
            lambda: blake3.blake3(max_threads=blake3.blake3.AUTO))(leaves)
        whole = np.concatenate([x.reshape(-1).view(np.uint8) for x in leaves])   # its best case: one update
        candidates["blake3, max_threads=AUTO, one buffer"] = lambda: blake3.blake3(
            whole, max_threads=blake3.blake3.AUTO).hexdigest()
    candidates["xxh3_128 (xxhash)"] = lambda: layout_then_bytes(xxhash.xxh3_128)(leaves)
    candidates["xxh3_64 (xxhash; the per-chunk check)"] = lambda: layout_then_bytes(xxhash.xxh3_64)(leaves)
    candidates[f"runtime state_digest ({DIGEST})"] = lambda: state_digest(leaves)
    candidates["runtime state_digest (sha256, old records)"] = lambda: state_digest(leaves, "sha256")
    for algorithm in dict.fromkeys(("sha256", DIGEST)):
        chunks = list(inline(state_chunks(leaves, 1, DEFAULT_CHUNK_BYTES, state_digest(leaves, algorithm))))
        candidates[f"receive: assemble_state, {algorithm}"] = (
            lambda chunks=chunks, algorithm=algorithm: assemble_state(iter(chunks), algorithm=algorithm))

    print(f"state: {len(leaves)} leaves, {nbytes / 1e6:.1f} MB; median of {args.repeats}; CPU from /proc/self/stat")
    if blake3 is None:
        print("blake3: not installed, not measured (`.venv/bin/pip install blake3` to measure it)")
    base_wall, base_cpu = timed(memcpy, args.repeats)
    print(f"{'memcpy (numpy.copyto)':48s} {base_wall * 1e3:8.1f} ms {nbytes / base_wall / 1e9:6.2f} GB/s "
          f"  1.00x memcpy  CPU {base_cpu * 1e3:7.0f} ms")
    speed = {}
    for name, fn in candidates.items():
        wall, cpu = timed(fn, args.repeats)
        speed[name] = base_wall / wall
        print(f"{name:48s} {wall * 1e3:8.1f} ms {nbytes / wall / 1e9:6.2f} GB/s {speed[name]:6.2f}x memcpy  "
              f"CPU {cpu * 1e3:7.0f} ms", flush=True)
    print(f"state digest {DIGEST} / memcpy: {speed[f'runtime state_digest ({DIGEST})']:.2f}x "
          f"(sha256: {speed['runtime state_digest (sha256, old records)']:.2f}x), {nbytes / 1e6:.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
