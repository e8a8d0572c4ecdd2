"""The canonical math in one process, without workers: the ground truth.

Runs the same exported programs through the same :class:`SliceExecutor` as a
worker, sums all M microbatches in the canonical tree, and applies. A
distributed run of the same programs must match it bit for bit.

:func:`run_reference` runs in this process, which must have the slice's
devices. :func:`run_reference_process` runs it in a fresh Python process with
the right number of simulated CPU devices (or the accelerator the programs
are for): for a caller whose JAX already started with fewer devices, or on
another platform (a notebook, a test suite, a CPU client of GPU programs).
The child speaks JSON lines on stdout (one per step, then the result);
``python -m runtime.worker.reference`` is it.
"""

from __future__ import annotations

import json
import pickle
import struct
import subprocess
import sys
import tempfile
from collections.abc import Callable

import numpy as np

from runtime.core import compile_cache
from runtime.worker.executor import SliceExecutor
from runtime.core.microbatch import root
from runtime.core.programs import ProgramSet

__all__ = ["run_reference", "run_reference_process"]


def run_reference(programs: ProgramSet, data_source, *, steps: int, seed: int,
                  on_step: Callable[[int, float], None] | None = None, start_step: int = 0,
                  parameters_from: str = "") -> tuple[list[float], str]:
    """Trains ``steps`` steps; returns (per-step mean losses, final state digest). ``parameters_from``: the
    initialized state's parameters are that checkpoint's (``load_parameters_path``), as on the workers."""
    ex = SliceExecutor(programs, data_source)
    ex.load()
    compile_cache.mark_held(compile_cache.enabled(), programs.programs(), programs.devices_per_slice)
    ex.init(seed)
    if parameters_from:
        from runtime.worker.worker_state import with_parameters

        leaves, _ = with_parameters(ex, parameters_from, [(tuple(x.shape), x.dtype) for x in ex.state])
        ex.set_state(leaves, ex.steps_applied)
    top = root(programs.num_microbatches)
    losses = []
    for step in range(start_step, start_step + steps):
        total = ex.partials(step, [top])[top]
        ex.apply(total[:-1])
        loss = float(total[-1] / np.float32(programs.num_microbatches))
        losses.append(loss)
        if on_step is not None:
            on_step(step, loss)
    return losses, ex.state_digest()


#: How many times a reference child killed by a signal (OOM killer, an operator, a chaos test) is started again.
REFERENCE_RETRIES = 2


def run_reference_process(programs: ProgramSet, data_blob: bytes, *, steps: int, seed: int,
                          compilation_cache_dir: str = "", on_step: Callable[[int, float], None] | None = None,
                          parameters_from: str = "") -> tuple[list[float], str]:
    """:func:`run_reference` in a child process with ``programs.devices_per_slice`` devices of the programs' platform.

    CPU programs get that many simulated CPU devices; programs for an
    accelerator get JAX's own choice of platform (see
    :func:`runtime.core.child_env.jax_child_env`): the child refuses them by name
    when this host has no such device.

    ``data_blob``: the data source pickled as it is shipped to workers
    (cloudpickle). The child is a helper whose death costs only its output:
    killed by a signal, it is run again (``REFERENCE_RETRIES`` times), and
    ``on_step`` hears each step once (a step the rerun gives another loss for
    is an error: the math is not deterministic). Raises ``ElasticError`` with
    the child's last output lines if it fails otherwise.
    """
    from runtime.core.errors import ElasticError
    from runtime.core.child_env import jax_child_env
    from runtime.core.platforms import program_platforms

    platforms = program_platforms(programs.init)
    env = jax_child_env(programs.devices_per_slice, platforms[0] if len(platforms) == 1 else "")
    request = pickle.dumps({"programs": programs, "data": data_blob, "steps": steps, "seed": seed,
                            "cache": compilation_cache_dir, "parameters_from": parameters_from})
    heard: dict[int, float] = {}

    def step_done(step: int, loss: float) -> None:
        if step not in heard:
            heard[step] = loss
            if on_step is not None:
                on_step(step, loss)
        elif struct.pack("<d", heard[step]) != struct.pack("<d", loss):
            raise ElasticError(f"the reference run's rerun gave step {step} another loss ({loss!r}, first "
                               f"{heard[step]!r}): the programs are not deterministic")

    for attempt in range(REFERENCE_RETRIES + 1):
        rc, result, tail = _reference_child(env, request, step_done)
        if result is not None and rc == 0:
            return result
        if rc >= 0 or attempt == REFERENCE_RETRIES:
            break
    raise ElasticError(f"the reference run's process failed (exit status {rc}): " + " | ".join(tail))


def _reference_child(env: dict[str, str], request: bytes, step_done) -> tuple[int, tuple | None, list[str]]:
    """One reference child: (exit status, (losses, digest) or None, its last stderr lines)."""
    with tempfile.TemporaryFile() as err, tempfile.TemporaryFile() as inp:
        inp.write(request)
        inp.seek(0)
        proc = subprocess.Popen([sys.executable, "-m", "runtime.worker.reference"], stdin=inp, stdout=subprocess.PIPE,
                                stderr=err, env=env)
        result = None
        try:
            for line in proc.stdout:
                msg = json.loads(line)
                if "step" in msg:
                    step_done(msg["step"], msg["loss"])
                elif "losses" in msg:
                    result = msg["losses"], msg["digest"]
        except BaseException:
            proc.kill()   # step_done refused a step (or we were interrupted): the child is of no more use
            raise
        finally:
            proc.stdout.close()
            rc = proc.wait()
        err.seek(0)
        tail = err.read().decode(errors="replace").strip().splitlines()[-8:]
    return rc, result, tail


def _child() -> None:
    import cloudpickle  # noqa: F401 - registers what cloudpickled data sources need to load

    from runtime.core.allocator import retain_freed_memory
    from runtime.core.compile_cache import enable
    from runtime.core.errors import PlatformMismatchError
    from runtime.core.owner import set_title

    retain_freed_memory()   # a training process like a worker
    set_title("elastic-reference (the fault-free reference run)")
    req = pickle.loads(sys.stdin.buffer.read())
    enable(req["cache"])
    data = pickle.loads(req["data"])

    def step_done(step, loss):
        print(json.dumps({"step": step, "loss": loss}), flush=True)

    try:
        losses, digest = run_reference(req["programs"], data, steps=req["steps"], seed=req["seed"],
                                       on_step=step_done, parameters_from=req["parameters_from"])
    except PlatformMismatchError as e:   # a refusal says all there is to say: one line, not a traceback
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(1)
    print(json.dumps({"losses": losses, "digest": digest}), flush=True)


if __name__ == "__main__":
    _child()
