"""The canonical math in one process, without workers: the ground truth, for any stage count.

A :class:`LocalRun` runs the same exported programs through the same
:class:`~runtime.worker.executor.SliceExecutor` as a worker, one per stage,
by following each replica's compiled schedule in its global order
(:mod:`runtime.pipeline.schedule`; an unpipelined run is the one-stage
pipeline, whose schedule is each microbatch's ``grad``), handing activations
and gradients between stages as host arrays. Each stage's per-microbatch
gradients are summed in the canonical tree over all microbatch ids
(:mod:`runtime.core.microbatch`), so the result is the same bits for any
number of replicas and either schedule: both only change who computes a
microbatch and when, never the arithmetic. A distributed run of the same
programs must match it bit for bit.

:func:`run_reference` runs in this process, which must have the slice's
devices. :func:`run_reference_process` runs it in a fresh Python process with
the right number of simulated CPU devices (or the accelerator the programs
are for): for a caller whose JAX already started with fewer devices, or on
another platform (a notebook, a test suite, a CPU client of GPU programs).
The child speaks JSON lines on stdout (one per step, then the result);
``python -m runtime.worker.reference`` is it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

import numpy as np

from runtime.core import compile_cache
from runtime.core.microbatch import assign_microbatches, root, tree_reduce
from runtime.core.programs import ProgramSet
from runtime.core.timing import Clock
from runtime.pipeline.bubble import measured_bubble
from runtime.pipeline.interpreter import LocalWire, StageRunner
from runtime.pipeline.schedule import compile_schedule
from runtime.worker.executor import SliceExecutor, add_f32

__all__ = ["LocalRun", "StepTrace", "run_reference", "run_reference_process", "run_rl_reference",
           "run_rl_reference_process"]


@dataclasses.dataclass
class StepTrace:
    """What one step cost each stage: the most activation bytes alive at once (inputs kept for the backward,
    outputs not yet sent, gradients not yet used) and seconds spent computing; the step's wall seconds."""

    peak_bytes: list[int]
    busy: list[float]
    seconds: float

    @property
    def bubble(self) -> float:
        """The idle fraction over all stages (:func:`runtime.pipeline.bubble.measured_bubble` over the step)."""
        return measured_bubble(self.busy, self.seconds)


class LocalRun:
    """A run's every stage and replica in this process: :meth:`load`, then :meth:`train` (or :meth:`init` and
    :meth:`step`s). ``replicas`` and ``schedule`` change who computes what and when, never the bits."""

    def __init__(self, programs: ProgramSet, data_source, *, replicas: int = 1, schedule: str = "1f1b",
                 devices=None):
        self.programs = programs
        self.stages = [SliceExecutor(p, data_source, devices) for p in programs.by_stage]
        self.replan(replicas, schedule)

    def replan(self, replicas: int, schedule: str) -> None:
        """Runs the next steps on ``replicas`` pipeline replicas under ``schedule`` (the same math)."""
        self.replicas, self.kind = replicas, schedule
        self.schedules = [compile_schedule(schedule, self.programs.num_stages, [i for n in nodes for i in n.ids])
                          for nodes in assign_microbatches(self.programs.num_microbatches, replicas)]

    def load(self) -> None:
        for ex in self.stages:
            ex.load()

    def init(self, seed: int) -> None:
        for ex in self.stages:
            ex.init(seed)

    def step(self, step: int, clock: Clock | None = None, *, threads: bool = False,
             delay: float = 0.0) -> tuple[float, StepTrace]:
        """Runs one step; returns (its mean loss, what it cost).

        Sequentially in the schedules' global order (the default), or with
        ``threads`` each stage's stream on its own thread, as stage workers
        run them (then ``delay`` adds seconds per forward and per backward:
        a stand-in for a slower device, to measure the schedule's bubble).
        """
        t0 = time.perf_counter()
        runners = []
        for sched in self.schedules:
            rs = [StageRunner(k, ex, step, clock, delay) for k, ex in enumerate(self.stages)]
            runners.append(rs)
            if threads:
                _threaded(rs, sched.streams)
            else:
                wire = LocalWire(rs, timeout=0.0)   # the global order sends before it receives
                for k, instr in sched.order:
                    rs[k].run(instr, wire)
        seconds = time.perf_counter() - t0
        top = root(self.programs.num_microbatches)
        totals = [tree_reduce({n: v for rs in runners for n, v in rs[k].vecs.items()}, top, add_f32)
                  for k in range(len(self.stages))]
        for ex, total in zip(self.stages, totals):
            ex.apply(total[:-1], clock)
        trace = StepTrace([max(rs[k].peak_bytes for rs in runners) for k in range(len(self.stages))],
                          [sum(rs[k].busy for rs in runners) for k in range(len(self.stages))], seconds)
        return float(totals[-1][-1] / np.float32(self.programs.num_microbatches)), trace

    def digests(self) -> list[str]:
        """Each stage's state digest (the same on every replica of that stage)."""
        return [ex.state_digest() for ex in self.stages]

    def train(self, *, steps: int, seed: int, start_step: int = 0, threads: bool = False,
              on_step: Callable[[int, float], None] | None = None) -> tuple[list[float], list[str]]:
        """Initializes from ``seed`` and trains ``steps`` steps (see :meth:`step`); returns (per-step mean
        losses, each stage's final digest)."""
        self.init(seed)
        return self.resume(steps=steps, start_step=start_step, threads=threads, on_step=on_step)

    def resume(self, *, steps: int, start_step: int = 0, threads: bool = False,
               on_step: Callable[[int, float], None] | None = None) -> tuple[list[float], list[str]]:
        """:meth:`train` from the state the stages hold."""
        losses = []
        for step in range(start_step, start_step + steps):
            loss, _ = self.step(step, threads=threads)
            losses.append(loss)
            if on_step is not None:
                on_step(step, loss)
        return losses, self.digests()


def _threaded(runners: list[StageRunner], streams) -> None:
    """Each stage's stream on its own thread, queues between them; re-raises the first failure."""
    wire, errors = LocalWire(runners), []

    def run(runner, stream):
        try:
            for instr in stream:
                runner.run(instr, wire)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            errors.append(e)
    threads = [threading.Thread(target=run, args=(r, s), name=f"stage-{r.stage}") for r, s in zip(runners, streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def run_reference(programs: ProgramSet, data_source, *, steps: int, seed: int,
                  on_step: Callable[[int, float], None] | None = None, start_step: int = 0,
                  parameters_from: str = "", schedule: str = "1f1b") -> tuple[list[float], list[str]]:
    """Trains ``steps`` steps in this process; returns (per-step mean losses, each stage's final state digest:
    one for an unpipelined run; :func:`runtime.core.programs.stages_digest` makes them the run's).

    ``parameters_from``: the initialized state's parameters are that checkpoint's (``load_parameters_path``),
    as on the workers (an unpipelined run's only: ``ValueError`` for a pipeline). ``schedule``: a pipeline's
    (the same bits either way).
    """
    run = LocalRun(programs, data_source, schedule=schedule)
    run.load()
    compile_cache.mark_held(compile_cache.enabled(), programs.programs(), programs.devices_per_slice)
    run.init(seed)
    if parameters_from:
        if programs.pipelined:
            raise ValueError("parameters_from (load_parameters_path) starts an unpipelined run only; a pipelined "
                             "run starts from a pipelined run's whole state")
        from runtime.worker.worker_state import with_parameters

        (ex,) = run.stages
        leaves, _ = with_parameters(ex, parameters_from)
        ex.set_state(leaves, ex.steps_applied)
    return run.resume(steps=steps, start_step=start_step, on_step=on_step)


#: How many times a reference child killed by a signal (OOM killer, an operator, a chaos test) is started again.
REFERENCE_RETRIES = 2


def run_reference_process(programs: ProgramSet, data_blob: bytes, *, steps: int, seed: int,
                          compilation_cache_dir: str = "", on_step: Callable[[int, float], None] | None = None,
                          parameters_from: str = "", schedule: str = "1f1b", hosts: int = 1
                          ) -> tuple[list[float], list[str]]:
    """:func:`run_reference` in a child process with ``programs.devices_per_slice`` devices of the programs' platform.

    ``hosts`` > 1: in that many child processes, the slice's hosts (:mod:`runtime.core.hosts`), joined by a JAX
    distributed system of their own as a slice's workers are, so the math is theirs (collectives across
    processes sum in their own order); the digests are the slice's (each host's combined).

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
    request = {"programs": programs, "data": data_blob, "steps": steps, "seed": seed,
               "cache": compilation_cache_dir, "parameters_from": parameters_from, "schedule": schedule}
    return _in_children(programs, programs.devices_per_slice // hosts, request, hosts, on_step)


def _in_children(programs: ProgramSet, devices: int, request: dict, hosts: int, on_step):
    """The reference ``request`` run in ``hosts`` child processes of ``devices`` devices each (of the programs'
    platform): ``(losses, digests)``. A child killed by a signal is run again (``REFERENCE_RETRIES`` times), and
    ``on_step(step, loss, ...)`` hears each step once; a step the rerun gives another loss for is an error.
    ``ElasticError`` with the child's last output lines if it fails otherwise."""
    from runtime.core.errors import ElasticError
    from runtime.core.child_env import jax_child_env
    from runtime.core.platforms import program_platforms

    platforms = program_platforms(programs.init)
    env = jax_child_env(devices, platforms[0] if len(platforms) == 1 else "")
    heard: dict[int, float] = {}

    def step_done(step: int, loss: float, *more) -> None:
        if step not in heard:
            heard[step] = loss
            if on_step is not None:
                on_step(step, loss, *more)
        elif struct.pack("<d", heard[step]) != struct.pack("<d", loss):
            raise ElasticError(f"the reference run's rerun gave step {step} another loss ({loss!r}, first "
                               f"{heard[step]!r}): the programs are not deterministic")

    for attempt in range(REFERENCE_RETRIES + 1):
        rc, result, tail = _reference_children(env, request, hosts, step_done)
        if result is not None and rc == 0:
            return result
        if rc >= 0 or attempt == REFERENCE_RETRIES:
            break
    raise ElasticError(f"the reference run's process failed (exit status {rc}): " + " | ".join(tail))


def _reference_children(env: dict[str, str], request: dict, hosts: int, step_done
                        ) -> tuple[int, tuple | None, list[str]]:
    """The reference's children, one per host of a slice: (the first failed exit status or 0, (host 0's
    losses, each stage's slice digest) or None, the failed or last child's last stderr lines)."""
    if hosts == 1:
        return _reference_child(env, pickle.dumps(request), step_done)
    from runtime.state.state_copy import slice_digest
    from runtime.wire.rpc import free_port

    coordinator = f"127.0.0.1:{free_port()}"
    outcomes: list = [None] * hosts

    def run(k: int) -> None:
        req = pickle.dumps({**request, "slice": (coordinator, hosts, k)})
        outcomes[k] = _reference_child(env, req, step_done if k == 0 else (lambda step, loss: None))

    threads = [threading.Thread(target=run, args=(k,), name=f"reference-host{k}") for k in range(hosts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for outcome in outcomes:
        if outcome is None:   # its thread failed to run it
            return 1, None, []
        rc, result, tail = outcome
        if rc != 0 or result is None:
            return rc or 1, None, tail
    losses = outcomes[0][1][0]
    digests = [slice_digest([o[1][1][stage] for o in outcomes]) for stage in range(len(outcomes[0][1][1]))]
    return 0, (losses, digests), outcomes[0][2]


def _reference_child(env: dict[str, str], request: bytes, step_done) -> tuple[int, tuple | None, list[str]]:
    """One reference child: (exit status, (losses, digests) or None, its last stderr lines)."""
    with tempfile.TemporaryFile() as err, tempfile.TemporaryFile() as inp:
        inp.write(request)
        inp.seek(0)
        proc = subprocess.Popen([sys.executable, "-m", "runtime.worker.reference"], stdin=inp, stdout=subprocess.PIPE,
                                stderr=err, env=env)
        result = None
        try:
            for line in proc.stdout:
                msg = json.loads(line)
                if "step" in msg:   # (an RL run's: with its rl_step fields)
                    step_done(msg["step"], msg["loss"], *([msg["rl"]] if "rl" in msg else []))
                elif "losses" in msg:
                    result = msg["losses"], msg["digests"]
        except BaseException:
            proc.kill()   # step_done refused a step (or we were interrupted): the child is of no more use
            raise
        finally:
            proc.stdout.close()
            rc = proc.wait()
        err.seek(0)
        tail = err.read().decode(errors="replace").strip().splitlines()[-8:]
    return rc, result, tail

def run_rl_reference(programs: ProgramSet, samplers, prompts, data_source, *, steps: int, seed: int,
                     off_policy_steps: int = 0, on_step=None) -> tuple[list[float], str]:
    """An RL run in this process, on the very programs its workers run: the samplers' ``rollout`` program
    (:class:`runtime.worker.sampler.Sampler`) and the trainers' (:class:`SliceExecutor`, fed the rollouts as a
    trainer's step request feeds them), in the run's schedule: step ``s`` trains on the rollouts of every
    microbatch made with weights version ``max(s - off_policy_steps, 0)`` (the policy after that many steps,
    cast as the samplers hold it). Returns ``(per-step mean losses, the final state's digest)``; ``on_step(step,
    loss, rl_step)`` hears each step, ``rl_step`` the fields of its ``rl_step`` event."""
    from runtime.core.microbatch import root
    from runtime.wire.batches import decode_batch
    from runtime.worker.sampler import Sampler
    from runtime.worker.weights import cast_weights
    from runtime.state.state_copy import state_digest

    (stage,) = programs.by_stage
    m = programs.num_microbatches
    ex = SliceExecutor(stage, data_source)
    ex.load()
    ex.init(seed)
    sampler = Sampler(samplers.layout, samplers.programs(), prompts)
    sampler.load()
    leaves = list(samplers.weight_leaves)
    versions = {0: cast_weights(ex.host_state(), leaves, samplers.weights_dtype)}
    losses = []
    for s in range(steps):
        v = max(s - off_policy_steps, 0)
        if sampler.version != v:
            sampler.install(v, versions[v], state_digest(versions[v]))
        t0 = time.perf_counter()
        batches = sampler.rollout(s, list(range(m)), v, seed)
        seconds = time.perf_counter() - t0
        ex.feed({(s, b.microbatch): decode_batch(b, stage.batch_spec) for b in batches})
        total = ex.partials(s, [root(m)])[root(m)]
        ex.feed({})
        ex.apply(total[:-1])
        versions[s + 1] = cast_weights(ex.host_state(), leaves, samplers.weights_dtype)
        versions.pop(s + 1 - 2 - off_policy_steps, None)
        loss = float(np.float32(total[-1]) / np.float32(m))
        losses.append(loss)
        rewards = np.concatenate([decode_batch(b)["rewards"] for b in batches])
        if on_step is not None:
            on_step(s, loss, {"step": s, "version": v, "mean_reward": float(np.mean(rewards)),
                              "rollout_seconds": seconds, "rollout_bytes": sum(b.ByteSize() for b in batches)})
    return losses, ex.state_digest()


def run_rl_reference_process(programs: ProgramSet, samplers, prompts_blob: bytes, data_blob: bytes, *, steps: int,
                             seed: int, off_policy_steps: int = 0, on_step=None,
                             compilation_cache_dir: str = "") -> tuple[list[float], str]:
    """:func:`run_rl_reference` in a child process with the devices of a trainer's slice and of a sampler's (the
    most of the two; simulated on the CPU), for a client that has fewer. ``on_step(step, loss, rl_step)`` as
    there; the child is retried as :func:`run_reference_process`'s is."""
    request = {"programs": programs, "data": data_blob, "steps": steps, "seed": seed, "cache": compilation_cache_dir,
               "rl": {"samplers": samplers, "prompts": prompts_blob, "off_policy_steps": off_policy_steps}}
    losses, digests = _in_children(programs, max(programs.devices_per_slice, samplers.devices_per_slice), request,
                                   1, on_step)
    return losses, digests[0]


def _child() -> None:
    import cloudpickle  # noqa: F401 - registers what cloudpickled data sources need to load

    from runtime.core.allocator import retain_freed_memory
    from runtime.core.compile_cache import enable
    from runtime.core.errors import PlatformMismatchError
    from runtime.core.owner import set_title

    # The JSON lines go on a descriptor of their own: what libraries print to stdout (gloo's C++ does) goes to
    # stderr, so it never breaks a line of them.
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    retain_freed_memory()   # a training process like a worker
    set_title("elastic-reference (the fault-free reference run)")
    req = pickle.loads(sys.stdin.buffer.read())
    if "slice" in req:   # one host of a slice of several: it joins the others before JAX starts
        from runtime.core.platforms import join_slice

        coordinator, hosts, host = req["slice"]
        join_slice(coordinator, hosts, host, timeout=120.0)
    enable(req["cache"])
    data = pickle.loads(req["data"])

    def step_done(step, loss, rl=None):
        print(json.dumps({"step": step, "loss": loss, **({"rl": rl} if rl is not None else {})}), file=out,
              flush=True)

    if "rl" in req:   # an RL run's reference: its samplers' program and the trainers', in this process
        rl = req["rl"]
        losses, digest = run_rl_reference(req["programs"], rl["samplers"], pickle.loads(rl["prompts"]), data,
                                          steps=req["steps"], seed=req["seed"],
                                          off_policy_steps=rl["off_policy_steps"], on_step=step_done)
        print(json.dumps({"losses": losses, "digests": [digest]}), file=out, flush=True)
        return
    try:
        losses, digests = run_reference(req["programs"], data, steps=req["steps"], seed=req["seed"],
                                        on_step=step_done, parameters_from=req["parameters_from"],
                                        schedule=req["schedule"])
    except PlatformMismatchError as e:   # a refusal says all there is to say: one line, not a traceback
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(1)
    print(json.dumps({"losses": losses, "digests": digests}), file=out, flush=True)


if __name__ == "__main__":
    _child()

