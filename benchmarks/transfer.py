"""State transfer worker -> worker on one host against this machine's memory-copy bandwidth, in one invocation.

Runs `elastic chaos` on a ~10 M parameter transformer (2 slices x 1 device +
1 spare) with one kill, so the spare pulls the whole training state
(parameters and Adam moments) from a live replica (`PullState`), twice: the
same-host path (`elastic_shared_memory=true`, the default: the spare copies
the leaves out of the source's memory, one copy by the kernel, hashed as it
lands) and the data plane's TCP stream (`elastic_shared_memory=false`:
chunked, checksummed, hash-checked; the path between hosts). Reads
`state_transferred` (bytes, seconds, transport) from each event log.
Measures `numpy.copyto` of a buffer of the same size in this process
(median of 5) as the memory-copy bandwidth. Prints each path, memcpy, and
the ratios transfer / memcpy last.
Usage: .venv/bin/python benchmarks/transfer.py [key=value ...]
"""

import pathlib
import statistics
import sys
import tempfile
import time

import numpy as np
from _cli import run_elastic
MODEL = ["base_emb_dim=384", "base_num_decoder_layers=4", "base_mlp_dim=1536", "vocab_size=4096",
         "max_target_length=128", "base_num_query_heads=6"]


def transfer(overrides: list[str]) -> tuple[int, float, str]:
    with tempfile.TemporaryDirectory() as tmp:
        _, events = run_elastic(pathlib.Path(tmp), "t", ["chaos", "tiny", "steps=8", "dcn_data_parallelism=2",
                                                         "ici_fsdp_parallelism=1", "elastic_spares=1", *MODEL,
                                                         *overrides, "--faults", "kill:slice=1@step=3"], timeout=1800)
    moved = [e for e in events if e["kind"] == "state_transferred"]
    if not moved:
        raise SystemExit("no state was transferred")
    return moved[0]["bytes"], moved[0]["seconds"], moved[0].get("transport", "?")


def memcpy_bytes_per_second(nbytes: int) -> float:
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times)


def main():
    rates = {}
    for shared in ("true", "false"):
        nbytes, seconds, transport = transfer([f"elastic_shared_memory={shared}", *sys.argv[1:]])
        rates[transport] = nbytes / seconds
        print(f"state transfer ({transport}): {nbytes / 1e6:.1f} MB in {seconds * 1e3:.0f} ms = "
              f"{rates[transport] / 1e6:.0f} MB/s (PullState, the state digest checked)", flush=True)
    copy = memcpy_bytes_per_second(nbytes)
    print(f"memory copy (numpy.copyto, same size, this process): {copy / 1e6:.0f} MB/s")
    for transport, rate in rates.items():
        print(f"transfer / memcpy, {transport}: {rate / copy:.3f}")


if __name__ == "__main__":
    main()
