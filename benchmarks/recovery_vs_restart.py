"""Crash recovery against checkpoint-restart: the same model, slices and kill schedule three ways, in one invocation.

All three train the bundled tiny transformer (`elastic/configs/tiny.yml`) on
`--slices` slices of `--devices` CPU devices, with the same global batch, for
the same number of steps, and SIGKILL the process of slice `--kill-slice`
once the same step counts are committed (`--kills` kills, `--kill-gap` steps
apart, each in the middle of a checkpoint period, so checkpoint-restart loses
half a period: what a kill at a uniformly random time costs it on average):

- (a) jax-elastic with one warm spare: `elastic chaos tiny elastic_spares=1
  --faults kill:slice=K@step=N,...` (the spare replaces the dead slice);
- (b) jax-elastic with no spare: the same with `elastic_spares=0` (the run
  shrinks onto the survivors, and grows back when the relaunched worker is
  ready);
- (c) the classic SPMD answer, checkpoint-restart: a supervisor starts one
  process per slice (`--devices` devices each), joined by
  `jax.distributed.initialize` with CPU collectives (gloo), one `jax.jit` of
  the whole step over the global mesh (the multi-controller baseline of
  `benchmarks/step_time.py`, same config overrides), saving an orbax
  checkpoint every `--checkpoint-period` steps (`CheckpointManager`, async, as
  MaxText does). On a kill the supervisor notices the death (waitpid), SIGKILLs
  the other processes and relaunches all of them; they start Python and JAX
  again, join a new coordinator, compile with the same persistent compilation
  cache (`runtime.enable_compilation_cache`, as the runtime's workers do; filled
  beforehand by a short uncounted launch, as (a) and (b) run after their
  fault-free reference, which fills theirs), restore the newest complete
  checkpoint and recompute the lost steps. On CPU, JAX writes the cache from
  process 0 only and every process has its own key, so the others would
  compile on every relaunch (on GPU the key is shared); here every process
  writes its own entries (`_cache_from_every_process`) so that all of them
  restart warm, as on an accelerator job. `step_time.py` builds and runs its
  baseline in one function, so its model, mesh and step are written again
  here, line for line; the config comes from its `_overrides`.

For each kill, from the event logs of (a)/(b) and the timestamped step lines
of (c):

- kill -> next committed step: SIGKILL -> the first step committed past the
  frontier (the highest step committed before recovery; (c): by the killed
  incarnation);
- steps lost: steps committed again (recomputed) after the kill;
- goodput over the run: productive time / wall time, with the runtime's own
  definition (`elastic.report.goodput`); for (c) it is applied to an event
  log built from the supervisor's and the processes' timestamps (launch ->
  distributed init: startup; -> compiled: compile; -> state ready: startup;
  kill -> death seen: detection; -> restored: recovery; recomputed steps:
  wasted progress). Also without the one-time start-up ("no start":
  productive / (wall - startup - compile)): the three differ in step time
  and start-up, and a slower step alone raises the plain fraction, so this
  one says better what the failures cost. The wall time of the run (same
  steps for all three) is printed too.

What (c) includes: process start, `import jax`, the coordinator and
distributed init, compile (from the warm cache), orbax restore and the
recomputed steps; its checkpoint saves are inside its step times. What it
excludes, in its favour: a scheduler rescheduling pods or finding a new
host, the time a real cluster takes to notice a dead process (the supervisor
here is its parent and is told at once), graceful shutdown of the survivors
(they are SIGKILLed) and reading checkpoints from remote storage (a local
directory here). The runtime's (a) and (b) include their own detection.

Prints, for each, kill -> next committed step per kill and how it recovered,
where (c)'s time went, then a table (median, min, max of kill -> next
committed step over the kills; steps lost; goodput and wall time of the run)
and LAST the ratios (c)/(a) and (c)/(b) of the median kill -> next committed
step.
Usage: .venv/bin/python benchmarks/recovery_vs_restart.py [--kills 3] [--kill-gap 100] [--checkpoint-period 10]
       [--slices 4] [--devices 2] [--hosts 1] [--kill-slice 1] [--out DIR]

With ``--hosts H`` each slice is H processes (``elastic_hosts_per_slice``; (c): slices x H processes of
devices / H devices each, one jit over all) and the kill hits the slice's last host.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import queue
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import types

from _cli import ROOT, run_elastic
from _restart_analysis import (MARK, elastic_kills, kill_schedule, parse_step_log, restart_events,
                               restart_kills, _mark)

sys.path.insert(0, str(ROOT))

#: The supervisor gives up on a launch whose process 0 logged nothing for this long.
STALL_SECONDS = 900


# ------------------------------------------------------------------------------- (c): the restart child process


def restart_child(a) -> None:
    """One process of the checkpoint-restart job: init or restore, then train and checkpoint; process 0 logs."""
    t_start = time.time()

    def emit(kind, **fields):
        line = MARK + json.dumps({"t": time.time(), "kind": kind, **fields})
        print(line, file=sys.stderr, flush=True)   # every process's own log, for diagnosis
        if a.process_id == 0:
            print(line, flush=True)

    import jax
    import orbax.checkpoint as ocp

    from elastic.config_loading import load_config
    from runtime import enable_compilation_cache
    from step_time import SpmdJob, _overrides

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    enable_compilation_cache(a.cache_dir)
    _cache_from_every_process()
    emit("imported", started=t_start)
    # A long heartbeat timeout: on a loaded host a compiling process can miss heartbeats for a while, and here
    # the supervisor, not the coordination service, notices a death (it is the processes' parent).
    processes = a.slices * a.hosts
    jax.distributed.initialize(coordinator_address=a.coordinator, num_processes=processes,
                               process_id=a.process_id, initialization_timeout=300, heartbeat_timeout_seconds=600)
    emit("initialized", started=t_start)

    # The multi-controller baseline of step_time.py: same config, model, optimizer, mesh and step.
    cfg = load_config("tiny", _overrides(types.SimpleNamespace(slices=a.slices, devices=a.devices, steps=a.steps,
                                                               hosts=a.hosts, microbatches=0, overrides=[])))
    job = SpmdJob(cfg, processes, a.process_id)
    replicated = job.replicated
    key = jax.random.key(cfg.seed)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated),
                            jax.eval_shape(job.init_state, key))

    mngr = ocp.CheckpointManager(a.ckpt_dir, options=ocp.CheckpointManagerOptions(
        save_interval_steps=a.period, max_to_keep=2, enable_async_checkpointing=True))
    start = mngr.latest_step() or 0
    compiled = jax.jit(job.step).lower(abstract, job.batch(start)).compile()
    emit("compiled", global_batch=cfg.global_batch_size)
    if start:
        state = mngr.restore(start, args=ocp.args.StandardRestore(abstract))
    else:
        state = jax.jit(job.init_state, out_shardings=replicated)(key)
    jax.block_until_ready(state)
    emit("restored", step=start)
    for s in range(start, a.steps):
        state, l = compiled(state, job.batch(s))
        lv = float(l)   # waits for the step
        mngr.save(s + 1, args=ocp.args.StandardSave(state))   # a no-op off the period; async otherwise
        emit("step", step=s, loss=lv)
    mngr.wait_until_finished()
    emit("done")
    mngr.close()


def _cache_from_every_process() -> None:
    """Lets every process of the job write its own entries to the persistent compilation cache.

    JAX writes entries from process 0 only, expecting the others to read
    them; on GPU it strips the device assignment from the key so they can. On
    CPU it does not, so each process has its own key and processes 1..N-1
    would compile on every relaunch, a cost a GPU or TPU job does not pay. So
    that the baseline gets a warm cache on every process, each writes its
    own (the keys differ, so writes never collide). Uses JAX internals
    (``jax._src.compiler._cache_write``); if they change, says so and leaves
    JAX as it is.
    """
    try:
        from jax._src import compilation_cache, compiler

        def write(cache_key, compile_time_secs, module_name, backend, executable):
            compilation_cache.put_executable_and_time(cache_key, module_name, executable, backend,
                                                      int(compile_time_secs))

        assert callable(compiler._cache_write) and callable(compilation_cache.put_executable_and_time)
        compiler._cache_write = write
    except (ImportError, AttributeError, AssertionError) as e:
        print(f"warning: processes other than 0 will not write the compilation cache ({e})", file=sys.stderr)


# ---------------------------------------------------------------------------------------- (c): the supervisor


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_restart(a, base: pathlib.Path, steps: int, kill_steps: list[int], name: str) -> list[dict]:
    """Supervises the checkpoint-restart job until it has committed ``steps``; returns its incarnations."""
    ckpt, cache, logs = base / name / "checkpoints", base / "restart_jax_cache", base / name / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "benchmarks")]),
               XLA_FLAGS=f"--xla_force_host_platform_device_count={a.devices // a.hosts}")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    pending = list(kill_steps)
    incarnations: list[dict] = []
    while True:
        k = len(incarnations)
        coordinator = f"127.0.0.1:{_free_port()}"
        inc = {"launched": time.time(), "records": []}
        procs = []
        for i in range(a.slices * a.hosts):
            err = open(logs / f"inc{k}-proc{i}.log", "w")
            procs.append(subprocess.Popen(
                [sys.executable, __file__, "--restart-child", "--process-id", str(i), "--coordinator", coordinator,
                 "--slices", str(a.slices), "--devices", str(a.devices), "--hosts", str(a.hosts), "--steps", str(steps),
                 "--checkpoint-period", str(a.checkpoint_period), "--ckpt-dir", str(ckpt), "--cache-dir", str(cache)],
                env=env, stdout=subprocess.PIPE if i == 0 else subprocess.DEVNULL, stderr=err, text=True, cwd=ROOT))
            err.close()
        lines: queue.Queue = queue.Queue()

        def read(out=procs[0].stdout, q=lines):
            for line in out:
                for rec in parse_step_log([line]):
                    q.put(rec)
            q.put(None)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        killed = False
        last_heard = time.time()
        while True:
            try:
                rec = lines.get(timeout=1.0)
            except queue.Empty:
                for i, p in enumerate(procs):
                    if p.poll() not in (None, 0):
                        _fail(procs, logs, k, i, p.returncode)
                if time.time() - last_heard > STALL_SECONDS:
                    _fail(procs, logs, k, 0, f"process 0 logged nothing for {STALL_SECONDS} s")
                continue
            last_heard = time.time()
            if rec is None:
                break
            inc["records"].append(rec)
            if rec["kind"] == "step" and pending and rec["step"] + 1 >= pending[0]:
                pending.pop(0)
                victim = procs[a.kill_slice * a.hosts + a.hosts - 1]   # the slice's last host
                inc["kill"] = time.time()
                os.kill(victim.pid, signal.SIGKILL)
                os.waitpid(victim.pid, 0)       # the supervisor sees the death
                victim.returncode = -signal.SIGKILL
                inc["detected"] = time.time()
                for p in procs:                 # ... and stops the job
                    if p is not victim:
                        p.kill()
                for p in procs:
                    p.wait()
                inc["stopped"] = time.time()
                reader.join()
                while (r := lines.get()) is not None:
                    inc["records"].append(r)
                killed = True
                break
        if not killed:
            for i, p in enumerate(procs):
                if p.wait(timeout=600) != 0:
                    _fail(procs, logs, k, i, p.returncode)
        incarnations.append(inc)
        (base / name / "incarnations.json").write_text(json.dumps(incarnations, indent=1))   # for a later look
        if not killed:
            return incarnations


def _fail(procs, logs: pathlib.Path, k: int, i: int, rc):
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    tail = (logs / f"inc{k}-proc{i}.log").read_text()[-3000:]
    why = f"exited with {rc}" if isinstance(rc, int) else rc
    raise SystemExit(f"checkpoint-restart process {i} (launch {k}) failed: {why}\n{tail}")


# ---------------------------------------------------------------------------------------------------- main


def _elastic(a, base: pathlib.Path, name: str, spares: int, steps: int, kill_steps: list[int]) -> dict:
    host = f",host={a.hosts - 1}" if a.hosts > 1 else ""   # the slice's last host, as (c)'s victim
    faults = ",".join(f"kill:slice={a.kill_slice}{host}@step={n}" for n in kill_steps)
    report, events = run_elastic(base, name, ["chaos", "tiny", f"dcn_data_parallelism={a.slices}",
                                              f"ici_fsdp_parallelism={a.devices}", "elastic_microbatches=0",
                                              f"elastic_hosts_per_slice={a.hosts}",
                                              f"steps={steps}", f"elastic_spares={spares}", "--faults", faults],
                                 timeout=1800)
    kills = elastic_kills(events)
    if sum(k["steps_lost"] for k in kills) != report["steps_lost"]:
        print(f"note: {name}: re-commits in the log ({sum(k['steps_lost'] for k in kills)}) differ from the "
              f"report's steps_lost ({report['steps_lost']})")
    return {"kills": kills, **_goodputs(report["goodput"]), "global_batch": report["global_batch_size"]}


def _goodputs(g: dict) -> dict:
    """Goodput over the run, and over the run after its one-time start-up (productive / (wall - startup - compile)).

    The second compares what failures cost: the three differ in step time and
    start-up, and a slower step makes the plain fraction look better.
    """
    after = g["wall_seconds"] - g["badput_seconds"]["startup"] - g["badput_seconds"]["compile"]
    return {"goodput": g["goodput_fraction"], "wall": g["wall_seconds"],
            "goodput_after_startup": g["productive_seconds"] / after if after > 0 else 0.0}


def _row(label: str, run: dict) -> str:
    kills = run["kills"]
    t = [k["kill_to_next_commit"] for k in kills]
    lost = [k["steps_lost"] for k in kills]
    paths = ", ".join(f"{p} x{n}" for p, n in sorted(
        {str(k["path"]): sum(str(x["path"]) == str(k["path"]) for x in kills) for k in kills}.items()))
    return (f"{label:38s} {statistics.median(t):6.2f} {min(t):6.2f} {max(t):6.2f}   "
            f"{'/'.join(map(str, lost)):>8s} {sum(lost):5d}   {run['goodput'] * 100:5.1f} % "
            f"{run['goodput_after_startup'] * 100:5.1f} % {run['wall']:6.1f} s   "
            f"{paths}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--kill-gap", type=int, default=100,
                    help="steps between kills (long enough for (a)'s relaunched worker to be a warm spare again)")
    ap.add_argument("--checkpoint-period", type=int, default=10, help="(c) saves an orbax checkpoint every N steps")
    ap.add_argument("--slices", type=int, default=4)
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--kill-slice", type=int, default=1)
    ap.add_argument("--hosts", type=int, default=1,
                    help="processes (hosts) per slice: the last host of --kill-slice is killed; (c) runs slices x hosts "
                         "processes of devices / hosts devices each")
    ap.add_argument("--out", default="", help="keep the runs' directories here (default: a temporary directory)")
    ap.add_argument("--restart-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--coordinator", default="", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--ckpt-dir", default="", help=argparse.SUPPRESS)
    ap.add_argument("--cache-dir", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.period = a.checkpoint_period
    if a.restart_child:
        restart_child(a)
        return
    if not 0 <= a.kill_slice < a.slices:
        ap.error("--kill-slice must name a slice")
    if a.hosts < 1 or a.devices % a.hosts:
        ap.error(f"--hosts {a.hosts} must divide --devices {a.devices}")
    try:
        kill_steps, steps = kill_schedule(a.kills, a.kill_gap, a.checkpoint_period)
    except ValueError as e:
        ap.error(str(e))
    print(f"tiny, {a.slices} slices x {a.devices} devices ({a.hosts} host(s) a slice), {steps} steps, SIGKILL slice "
          f"{a.kill_slice}{f' host {a.hosts - 1}' if a.hosts > 1 else ''} once "
          f"{', '.join(map(str, kill_steps))} steps are committed; (c) checkpoints every {a.checkpoint_period} steps",
          flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        base = pathlib.Path(a.out).resolve() if a.out else pathlib.Path(tmp)
        base.mkdir(parents=True, exist_ok=True)
        runs = {"a": _elastic(a, base, "spare", 1, steps, kill_steps)}
        print("(a) done", flush=True)
        runs["b"] = _elastic(a, base, "shrink", 0, steps, kill_steps)
        print("(b) done", flush=True)
        run_restart(a, base, a.checkpoint_period + 2, [], "restart-warmup")   # fills (c)'s compilation cache
        incs = run_restart(a, base, steps, kill_steps, "restart")
        print("(c) done", flush=True)
    from elastic.report import goodput

    g = goodput(restart_events(incs))
    runs["c"] = {"kills": restart_kills(incs), **_goodputs(g),
                 "global_batch": _mark(incs[0], "compiled")["global_batch"]}
    assert runs["a"]["global_batch"] == runs["b"]["global_batch"] == runs["c"]["global_batch"], runs
    labels = {"a": "(a) jax-elastic, 1 warm spare", "b": "(b) jax-elastic, no spare (shrink)",
              "c": f"(c) checkpoint-restart, period {a.checkpoint_period}"}
    for key, run in runs.items():
        if any(k["kill_to_next_commit"] is None for k in run["kills"]):
            raise SystemExit(f"{labels[key]}: a kill was never followed by a committed step past its frontier")
        print(f"{labels[key]}: kill -> next committed step per kill: "
              + ", ".join(f"{k['kill_to_next_commit']:.2f} s ({k['path']})" for k in run["kills"]))
    if any(k["path"] != "replace" for k in runs["a"]["kills"]):
        print("note: in (a) a kill found no warm spare (the relaunched one was not ready yet): raise --kill-gap")
    phases = [k["phases"] for k in runs["c"]["kills"] if "phases" in k]
    if phases:
        print("(c) where kill -> next committed step goes (median over kills): "
              + ", ".join(f"{p} {statistics.median(x[p] for x in phases):.2f} s" for p in phases[0]))
    print(f"{'':38s} {'kill -> next commit (s)':>20s}   {'steps lost':>14s}   {'goodput':>7s} {'goodput':>7s} "
          f"{'wall':>8s}   recovery")
    print(f"{'':38s} {'median':>6s} {'min':>6s} {'max':>6s}   {'per kill':>8s} {'total':>5s}   {'run':>7s} "
          f"{'no start':>7s}")
    for key, run in runs.items():
        print(_row(labels[key], run))
    med = {k: statistics.median(x["kill_to_next_commit"] for x in v["kills"]) for k, v in runs.items()}
    print(f"ratio kill -> next committed step, median: (c)/(a) {med['c'] / med['a']:.1f}x   "
          f"(c)/(b) {med['c'] / med['b']:.1f}x")


if __name__ == "__main__":
    main()
