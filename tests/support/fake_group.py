"""The unit tests' one worker group: an in-process model of ``runtime.control.group.Group`` (what
``runtime.control.worker_group.WorkerGroup`` does over gRPC), so the controller's state machine and the modules it
drives (checkpointing, snapshotting, shadows, an RL run's sampling) are stepped without processes.

Each fake worker holds a replica as a hash chain over the steps it applied,
so two replicas agree exactly when they applied the same steps. A step's
loss sum is a fixed function of the step (:func:`loss_sum`). A worker is a host
of its own unless ``hosts`` names its host. Everything a worker keeps lives in
the group's memory:

- steps: ``dispatch`` answers ``{worker: future}`` (the step's workers and its
  shadow spares); ``wait`` runs the step on its workers (applies it to their
  replicas), and the shadows apply it too, unless a rank died in the step (their
  step then never ends) or the shadow was cut off (it fails, ``StepAbortedError``);
  ``poll`` answers the shadows' futures that ended;
- persistent checkpoints, per host and directory (``checkpoints``): a writer
  ordered at ``dispatch`` (or asked by ``flush_checkpoints(save=...)``) copies
  its replica into a save in flight; each reply of the worker after that (the
  next step's, or a ``flush_checkpoints`` round) completes one more round of
  its oldest save; ``load_checkpoints`` loads each worker the newest readable
  checkpoint its host holds at or before the step, naming the spoiled ones it
  passed over;
- in-memory snapshots, per host (``held``): written after the ordered step on the
  writer's host and copied to its peer's; ``abort`` lists them,
  ``load_snapshots`` loads them.

A test places state as a worker would have it: :meth:`FakeGroup.hold` (a
replica after some steps), :meth:`FakeGroup.checkpoint` (a checkpoint written
earlier, by another run or on another mesh, or spoiled) and
:meth:`FakeGroup.writing` (a save in flight). Each call a test may look at is
recorded in ``calls``, as a tuple ``(member, arguments...)``.

Faults are scheduled per step, or by a startup phase (``"register"``,
``"load"``, ``"init"``: the worker is killed during it):

- ``kill``: the worker crashes as the step runs; the "health monitor" finds
  it at once (``declare_dead`` with cause crash) and the step fails;
- ``kill_after_apply``: the worker crashes after the first survivor applied
  the step (survivors end one step apart: realignment rolls one back);
- ``hang``: the worker stops answering; only the step watchdog finds it
  (``wait`` answers ``Stalled`` at its deadline, without sleeping);
- ``partition``: a shadow spare is cut off from the ranks for the step: it
  gets none of their pushes, its step fails and it stays alive;
- ``fence``: every worker of the step fences itself in it (its client was
  silent past their lease: stopped, cut off): the step fails
  (``StepAbortedError``) and they answer no probe, but the "health monitor"
  found them fenced, waiting for this client (``fenced``), not dead.

``crash(worker)`` kills a worker at any moment (a test's observer uses it to
kill during a state transfer).
"""

from __future__ import annotations

import dataclasses
import hashlib
import queue
import time

from runtime._proto import elastic_pb2 as pb
from runtime.core.errors import RegistrationTimeoutError, StepAbortedError, WorkerLostError
from runtime.control.placement import WorkerInfo
from runtime.control.plan import decide_launch
from runtime.control.run_state import RunLedger
from runtime.control.calls import Death, LoadResult, Stalled, StepResult, WorkerStatus

#: The bytes of one replica's state: what an init, a copy or a load moves.
STATE_BYTES = 1024


def loss_sum(step: int) -> float:
    return 64.0 / (step + 1)


def eval_answer(applied: int, e: int, m: int) -> tuple[float, float]:
    """The fake's eval of microbatch ``(e, m)`` on the state of ``applied`` steps: ``(loss total, weight)``."""
    return 1.0 / (applied + 1) + 0.01 * e + 0.001 * m, 1.0


class _Replica:
    def __init__(self):
        self.history = ["init"]      # state hash after 0, 1, 2, ... applied steps
        self.losses: dict[int, float] = {}

    @classmethod
    def after(cls, steps: int) -> _Replica:
        """The replica of a worker that applied steps 0..steps-1."""
        r = cls()
        for step in range(steps):
            r.apply(step)
        return r

    @property
    def applied(self) -> int:
        return len(self.history) - 1

    def apply(self, step: int) -> None:
        assert step == self.applied, f"applied {self.applied} steps, asked to apply step {step}"
        self.history.append(hashlib.sha256(f"{self.history[-1]}/{step}".encode()).hexdigest())
        self.losses[step] = loss_sum(step)

    def copy(self) -> _Replica:
        out = _Replica()
        out.history, out.losses = list(self.history), dict(self.losses)
        return out


@dataclasses.dataclass
class _Checkpoint:
    """A checkpoint as a host's directory holds it: the state, the committed loss sums written beside it, the
    mesh that wrote it (``(devices per slice, microbatches)``) when not this run's, and whether it is spoiled
    (listed, but it does not read back)."""

    state: _Replica
    loss_sums: list
    written_on: tuple[int, int] | None = None
    spoiled: bool = False


@dataclasses.dataclass
class _Save:
    """A save in flight: ``rounds`` more replies of its worker until it ends (None: it never does), then it is
    in ``directory`` (or fails with ``error``)."""

    directory: str
    checkpoint: _Checkpoint
    rounds: int | None = 1
    error: str = ""


class _Future:
    """One worker's call of one step: ``outcome`` is None while it runs, then its ``StepResult`` or typed error."""

    def __init__(self, plan, worker: str):
        self.plan, self.worker, self.outcome = plan, worker, None

    def done(self) -> bool:
        return self.outcome is not None


class _Dispatched(dict):
    """What ``dispatch`` answers: ``{worker: future}`` of one step, which also names the step (``plan``, ``step``:
    a test wrapping ``wait`` may look at which step it waits for)."""

    def __init__(self, plan, futs: dict):
        super().__init__(futs)
        self.plan, self.step = plan, plan.step


class FakeGroup:
    address = "fake:0"
    client_host = ""

    def __init__(self, opts, events, faults: dict | None = None, devices: int = 2,
                 hosts: dict[str, str] | None = None, first_worker: int = 0):
        self.opts, self.events, self.faults, self.devices = opts, events, dict(faults or {}), devices
        self.hosts = dict(hosts or {})     # worker -> its host (default: a host of its own)
        # In-memory snapshots (with ``snapshot_interval``): each host keeps the state histories it was given, by
        # step, as the real workers' SnapshotStore does.
        self.snapshot_root = "fake-snapshots" if opts.snapshot_interval else ""
        self.held: dict[str, dict[int, _Replica]] = {}
        # Persistent checkpoints: (host, directory) -> {step: checkpoint}; each worker's saves in flight, oldest first.
        self.checkpoints: dict[tuple[str, str], dict[int, _Checkpoint]] = {}
        self.saving: dict[str, list[_Save]] = {}
        self._snapshot_orders: dict[int, dict] = {}
        self._checkpoint_orders: dict[int, dict] = {}
        self._eval_orders: dict[int, object] = {}   # step -> its EvalOrder (eval_interval)
        self._running: list[_Future] = []   # shadow steps not ended
        self.epoch = 0
        self.generation = getattr(opts, "generation", 0)
        self.dead: dict[str, str] = {}
        self.fenced_procs: set[str] = set()   # workers that fenced themselves (they answer no probe)
        self.replicas: dict[str, _Replica | None] = {}   # registered workers; None until initialized
        self.crashed: set[str] = set()
        self.hung: set[str] = set()
        self.adopted: set[str] = set()
        self.calls: list[tuple] = []
        self.stages: dict[str, int] = {}   # the pipeline stage each worker loaded (loaded_stage)
        self._deaths: queue.Queue = queue.Queue()
        self._launched = first_worker   # the next launch's number (w<n>, a sampler s<n>)
        # An RL run's samplers: each call a sampler is asked to start, (worker, method, request fields, future);
        # what trainers answer a PublishWeights (their version, and the versions they hold).
        self.sent: list[tuple] = []
        self.publish_version, self.held_versions = 0, ()
        # The run's state as the real group reads it (the controller's events folded): who is who, for the one
        # launch rule (runtime.control.plan.decide_launch).
        self.ledger = RunLedger(events) if hasattr(events, "subscribe") else None

    # -- state a test places, as the workers would hold it -------------------------

    def hold(self, worker_id: str, applied: int) -> None:
        """``worker_id`` is registered and holds the state after ``applied`` steps (as if it had trained them)."""
        self.replicas[worker_id] = _Replica.after(applied)

    def checkpoint(self, worker_id: str, directory: str, step: int, loss_sums=None, *,
                   written_on: tuple[int, int] | None = None, spoiled: bool = False) -> None:
        """``worker_id``'s host holds a checkpoint of ``step`` in ``directory``, written before (by an earlier
        run, on another mesh: ``written_on``; ``spoiled``: listed, but it does not read back), recording
        ``loss_sums`` (default: the fake's loss sums of its steps)."""
        sums = [loss_sum(s) for s in range(step)] if loss_sums is None else list(loss_sums)
        self._stored(worker_id, directory)[step] = _Checkpoint(_Replica.after(step), sums, written_on, spoiled)

    def writing(self, worker_id: str, directory: str, step: int, *, rounds: int | None = 1, error: str = "") -> None:
        """``worker_id`` is writing the checkpoint of ``step`` (after its saves in flight): it ends after
        ``rounds`` more replies of the worker (None: never), written, or failed with ``error``."""
        sums = [loss_sum(s) for s in range(step)]
        self.saving.setdefault(worker_id, []).append(
            _Save(directory, _Checkpoint(_Replica.after(step), sums), rounds, error))

    def _stored(self, worker_id: str, directory: str) -> dict[int, _Checkpoint]:
        return self.checkpoints.setdefault((self.host_of(worker_id), directory), {})

    @property
    def fenced(self):
        """Members that fenced themselves and wait for this client (the run state's, as the real group's)."""
        return self.ledger.state.fenced if self.ledger is not None else frozenset(self.fenced_procs)

    # -- lifecycle and membership ---------------------------------------------

    def start(self):
        pass

    def close(self):
        pass

    def detach(self):
        self.calls.append(("detach",))

    def attach(self, known, registered, stages=None, placed=None):
        """A restarted client's attach: the workers of ``known`` that live (this group's ``replicas``, shared
        with the dead client's group by the test) take it; the others are declared dead. One not in ``placed``
        warms again as a newcomer (it is left unadopted for :meth:`warm_newcomers`)."""
        self._launched = max([self._launched, *(int(w[1:]) + 1 for w in registered)])
        out = {}
        for w in known:
            if w not in self.replicas or not self._reachable(w):
                self.declare_dead(w, f"did not answer client generation {self.generation} taking the run over",
                                  cause="crash")
                continue
            r = self.replicas[w]
            if placed is None or w in placed:
                self.adopted.add(w)
            out[w] = pb.AttachReply(worker_id=w, address=f"fake:{w}", num_devices=self.devices, platform="cpu",
                                    pid=2, host="", applied_steps=r.applied if r else -1)
        return out

    def new_generation(self, generation):
        self.generation = generation

    def fence_at(self, epoch):
        assert epoch >= self.epoch, f"epoch went back from {self.epoch} to {epoch}"
        self.epoch = epoch

    def launch(self, host="", role="trainer", replaces=""):
        wid = f"{'s' if role == 'sampler' else 'w'}{self._launched}"
        self._launched += 1
        self.replicas[wid] = None
        if replaces:
            self.events.emit("worker_relaunched", replaces=replaces, worker=wid, host=host, role=role)
        else:
            self.events.emit("worker_launched", worker=wid, host=host, role=role)
        return wid

    def relaunch(self, launch):
        return self.launch(launch.host, launch.role, replaces=launch.replaces)

    def wait_for_workers(self, n, timeout):
        kind, target = self.faults.pop("register", (None, None))
        if kind == "kill":
            self.declare_dead(target, "exited with status -9 before registering", cause="crash")
            if (launch := decide_launch(self.ledger.state, self.opts, target)) is not None:
                self.relaunch(launch)
        live = [w for w in self.replicas if w not in self.dead]
        if not live:
            raise RegistrationTimeoutError(f"0 of {n}")
        self.adopted |= set(live)
        for w in live:
            self.events.emit("worker_registered", worker=w, address=f"fake:{w}", devices=self.devices,
                             platform="cpu", pid=2, host="")
        return [WorkerInfo(w, f"fake:{w}", self.devices, pid=2) for w in live]

    def wait_for_newcomer(self, timeout):
        pass

    # a shared pool's give-backs: a test sets ``give_back``; each release is recorded and asks for a worker again
    give_back = 0

    def release_due(self):
        return self.give_back

    def release(self, worker_id):   # as the worker group does: the worker goes, and a worker is asked for again
        self.give_back = max(self.give_back - 1, 0)
        self.calls.append(("release", worker_id))
        self.forget(worker_id)
        self.dead[worker_id] = "given back to the pool"   # (its process is gone: never probed again)
        self.launch()

    def release_refused(self, count):
        self.give_back = max(self.give_back - count, 0)
        self.calls.append(("release_refused", count))

    def has_newcomers(self):
        return any(w not in self.adopted for w in self.replicas)

    def warmed(self):
        return False

    def start_warming(self):
        self.calls.append(("start_warming",))

    def warm_newcomers(self, block_until=None):
        new = [w for w in self.replicas if w not in self.adopted]
        self.adopted |= set(new)
        for w in new:
            self.events.emit("worker_warmed", worker=w, compile_seconds=0.0)
        return new

    def declare_dead(self, worker_id, reason, cause="unresponsive", stacks=""):
        if worker_id in self.dead:
            return
        self.dead[worker_id] = reason
        self.events.emit("worker_dead", worker=worker_id, reason=reason, cause=cause,
                         **({"stacks": stacks} if stacks else {}))
        self._deaths.put(Death(worker_id, reason, cause))

    def drain_deaths(self):
        out = []
        while not self._deaths.empty():
            out.append(self._deaths.get_nowait())
        return out

    def forget(self, worker_id):
        self.calls.append(("forget", worker_id))

    def shutdown(self, worker_id):
        self.calls.append(("shutdown", worker_id))

    def crash(self, worker_id):
        self.crashed.add(worker_id)

    # -- health ---------------------------------------------------------------

    def _reachable(self, w) -> bool:
        return w not in self.dead and w not in self.crashed and w not in self.hung and w not in self.fenced_procs

    def is_alive(self, worker_id):
        return self._reachable(worker_id)

    def probe(self, workers):
        return {w: self._reachable(w) for w in workers}

    def keep_stacks(self, workers, step, timeout=2.0, silent=None):
        """Stacks kept only of the reachable (a hung worker does not answer): ``{worker: path}``, no file."""
        return {w: f"stacks/{w}-{step}.txt" for w in workers if self._reachable(w)}

    def progress(self, worker_id):
        if not self._reachable(worker_id):
            return None
        r = self.replicas[worker_id]
        return (r.applied if r else -1), "reduce", 0.0

    def _touch(self, w):
        """A call to ``w``: a crashed worker is found (as the health monitor would) and the call fails."""
        if w in self.crashed:
            self.declare_dead(w, "connection refused", cause="crash")
        if w in self.dead:
            raise WorkerLostError(w, "declared dead; its call was cancelled")
        if w in self.hung:
            raise WorkerLostError(w, "DEADLINE_EXCEEDED")

    # -- calls ------------------------------------------------------------------

    def program_bytes(self):
        return 0

    def _each(self, phase, workers):
        """The workers a startup call reaches; one killed in ``phase`` (a fault keyed by it) is declared dead."""
        kind, target = self.faults.pop(phase, (None, None))
        if kind == "kill":
            self.crashed.add(target)
        ok = []
        for w in workers:
            try:
                self._touch(w)
                ok.append(w)
            except WorkerLostError:
                pass
        return ok

    def load(self, workers, spares=(), stages=None):
        loaded = {w: LoadResult(0.0, self.devices, 0.0) for w in self._each("load", workers)}
        if stages is not None:   # a pipelined run's (the real group records every worker's, spares at 0)
            self.stages.update({w: stages.get(w, 0) for w in loaded})
        return loaded

    def loaded_stage(self, worker_id):
        return self.stages.get(worker_id)

    def stage_answered(self, worker_id, reply, stages):
        return (stages or {}).get(worker_id, self.stages.get(worker_id))

    def init(self, workers, seed):
        ok = self._each("init", workers)
        for w in ok:
            self.replicas[w] = _Replica()
        return {w: STATE_BYTES for w in ok}

    def host_of(self, worker_id):
        return self.hosts.get(worker_id, worker_id)

    def dispatch(self, plan, checkpoints=None, shadows=(), snapshots=None, evals=None, feed=None):
        self.calls.append(("dispatch", plan.step, plan.epoch, tuple(shadows)))
        self._snapshot_orders[plan.step] = dict(snapshots or {})
        self._checkpoint_orders[plan.step] = dict(checkpoints or {})
        self._eval_orders[plan.step] = evals
        futs = _Dispatched(plan, {w: _Future(plan, w) for w in (*plan.workers, *shadows)})
        self._running += [futs[w] for w in shadows]
        return futs

    def _evals(self, step: int, w: str) -> dict:
        """Worker ``w``'s eval answers of step ``step`` (:func:`eval_answer`): after it, and an owed one before."""
        order = self._eval_orders.get(step)
        if order is None:
            return {}
        return {"eval_losses": tuple(eval_answer(step + 1, e, m) for e, m in order.after.get(w, ())),
                "eval_before_losses": tuple(eval_answer(step, e, m) for e, m in order.before.get(w, ()))}

    def _snapshots(self, plan) -> dict:
        """The snapshots ordered after ``plan``'s step: written on the writer's host, copied to its peer's."""
        out = {}
        for writer, peer in self._snapshot_orders.pop(plan.step, {}).items():
            r = self.replicas[writer]
            for w in (writer, peer):
                if w is not None:
                    self.held.setdefault(self.host_of(w), {})[r.applied] = r.copy()
            out[writer] = {"snapshots_saved": (r.applied,), "snapshots_copied": (r.applied,) if peer else ()}
        return out

    def _order_saves(self, plan) -> None:
        """The checkpoints ordered after ``plan``'s step: each writer starts saving its state."""
        for writer, (directory, sums) in self._checkpoint_orders.pop(plan.step, {}).items():
            r = self.replicas[writer]
            own = [loss_sum(k) for k in range(len(sums), plan.step + 1)]   # the steps not committed yet: its own
            self.saving.setdefault(writer, []).append(_Save(directory, _Checkpoint(r.copy(), [*sums, *own])))

    def _reply(self, w) -> tuple[list[int], str]:
        """One more reply of ``w``: its oldest save in flight gets one round further; ``(steps saved, error)``."""
        pending = self.saving.get(w, [])
        if not pending or pending[0].rounds is None:
            return [], ""
        save = pending[0]
        save.rounds -= 1
        if save.rounds > 0:
            return [], ""
        pending.pop(0)
        if save.error:
            return [], save.error
        step = save.checkpoint.state.applied
        self._stored(w, save.directory)[step] = save.checkpoint
        return [step], ""

    def _shadows_apply(self, plan, cut_off: set) -> None:
        """The shadows of ``plan``'s step get the ranks' pushes and apply it (a rank died in it: they wait on)."""
        for f in [f for f in self._running if f.plan is plan and not f.done()]:
            if f.worker in cut_off:
                f.outcome = StepAbortedError(plan.step, f"no all-gather data from ranks {list(range(len(plan.workers)))}")
            else:
                self.replicas[f.worker].apply(plan.step)
                f.outcome = StepResult(loss_sum(plan.step))
        self._running = [f for f in self._running if not f.done()]

    def wait(self, futs, deadline=None):
        plan = futs.plan
        assert plan.epoch == self.epoch, f"step {plan.step} of epoch {plan.epoch} waited on in epoch {self.epoch}"
        kind, target = self.faults.pop(plan.step, (None, None))
        if kind == "fence":
            self.fenced_procs.update(plan.workers)
            for w in plan.workers:   # the "health monitor" finds each fenced, waiting for this client
                self.events.emit("worker_fenced", worker=w, reason="no word from the controller past its lease")
            raise StepAbortedError(plan.step, "its workers fenced themselves")
        if kind == "kill":
            self.crashed.add(target)
        elif kind == "give_back":   # a shared pool asks for ``target`` workers back
            self.give_back += target
        elif kind == "hang":
            self.hung.add(target)
        for w in plan.workers:
            if w in self.crashed or w in self.dead:
                self._touch(w)
        if self.hung & set(plan.workers):
            if deadline is None:
                raise AssertionError("the fake would block forever: nothing declared the hung worker dead")
            return Stalled(tuple(sorted(self.hung & set(plan.workers))))
        survivors = [w for w in plan.workers if w != target]
        if kind == "kill_after_apply":
            self.replicas[survivors[0]].apply(plan.step)
            self.crashed.add(target)
            self._touch(target)
        for w in plan.workers:
            self.replicas[w].apply(plan.step)
        self._shadows_apply(plan, {target} if kind == "partition" else set())
        saved = self._snapshots(plan)
        out = {}
        for w in plan.workers:
            done, error = self._reply(w)
            out[w] = StepResult(loss_sum(plan.step), grad_seconds=0.01, checkpoints_saved=tuple(done),
                                checkpoint_error=error, **saved.get(w, {}), **self._evals(plan.step, w))
        self._order_saves(plan)
        return out

    def poll(self, futs, deadline=None):
        """The shadow steps of ``futs`` that ended (the fake ends them in ``wait``: waiting changes nothing)."""
        self.calls.append(("poll", tuple(futs), deadline is not None))
        return {w: f.outcome for w, f in futs.items() if f.done()}

    def cancel_inflight(self):
        self.calls.append(("cancel_inflight",))
        for f in self._running:
            f.outcome = StepAbortedError(f.plan.step, "cancelled: a recovery started")
        self._running = []

    def abort(self, workers):
        out = {}
        for w in workers:
            self._touch(w)
            r = self.replicas[w]
            out[w] = WorkerStatus(r.applied if r else 0, dict(r.losses) if r else {},
                                  tuple(sorted(self.held.get(self.host_of(w), {}))))
        return out

    def rollback(self, worker_id, to_applied_steps):
        self._touch(worker_id)
        r = self.replicas[worker_id]
        assert r.applied == to_applied_steps + 1
        r.history.pop()
        r.losses.pop(to_applied_steps, None)

    def transfer(self, source, dest, applied):
        self._touch(source)
        self._touch(dest)
        src = self.replicas[source]
        assert src.applied == applied
        self.replicas[dest] = src.copy()
        return STATE_BYTES, src.history[-1], "tcp"

    def hashes(self, workers):
        out = {}
        for w in workers:
            self._touch(w)
            r = self.replicas[w]
            out[w] = (r.applied, r.history[-1])
        return out

    def pid(self, worker_id, host=0):
        return 0

    def hosts_of(self, worker_id):
        return 1

    def inject_fault(self, worker_id, action, *, factor=0.0, seconds=0.0, phase="", after_step=0, host=None):
        raise AssertionError("the fake group injects no faults: give them to its constructor")

    def load_snapshots(self, workers, applied):
        """Each worker loads the newest in-memory snapshot its host holds at or before ``applied``."""
        self.calls.append(("load_checkpoints", tuple(workers), "", applied, True))
        out = {}
        for w in workers:
            self._touch(w)
            step = max(s for s in self.held.get(self.host_of(w), {}) if s <= applied)
            self.replicas[w] = self.held[self.host_of(w)][step].copy()
            out[w] = pb.PullStateReply(applied_steps=step, bytes=STATE_BYTES)
        return out

    def load_checkpoints(self, workers, directory, applied, parameters_only=False):
        """Each worker loads the newest readable checkpoint its host holds at or before ``applied``; a spoiled one
        is passed over and named in ``skipped``."""
        assert not parameters_only, "the fake group loads no parameters alone"
        self.calls.append(("load_checkpoints", tuple(workers), directory, applied, False))
        out = {}
        for w in workers:
            self._touch(w)
            stored = self._stored(w, directory)
            step = max(s for s, c in stored.items() if s <= applied and not c.spoiled)
            ck = stored[step]
            self.replicas[w] = ck.state.copy()
            out[w] = pb.PullStateReply(applied_steps=step, bytes=STATE_BYTES, loss_sums=ck.loss_sums[:step],
                                       digest=f"fake:{step}",   # a worker's load always says what it holds
                                       written_devices_per_slice=ck.written_on[0] if ck.written_on else 0,
                                       written_microbatches=ck.written_on[1] if ck.written_on else 0,
                                       skipped=[f"step {s} ({directory}/{s}): does not read back"
                                                for s, c in sorted(stored.items()) if step < s <= applied and c.spoiled])
        return out

    def flush_checkpoints(self, workers, wait_seconds, *, save=None):
        """One round for each worker's saves in flight (each first saves its state now when in ``save``);
        ``{worker: (steps saved, error, idle)}``. A worker still writing has waited ``wait_seconds``."""
        self.calls.append(("flush_checkpoints", tuple(workers), dict(save or {})))
        for w, (directory, sums) in (save or {}).items():
            self._touch(w)
            self.saving.setdefault(w, []).insert(0, _Save(directory, _Checkpoint(self.replicas[w].copy(), list(sums))))
        out = {}
        for w in workers:
            self._touch(w)
            saved, error = self._reply(w)
            out[w] = (saved, error, not self.saving.get(w))
        if not all(idle for _, _, idle in out.values()):
            time.sleep(wait_seconds)
        return out

    # -- an RL run's samplers (runtime.control.sampling) ------------------------------------------------------
    # A sampler's calls are kept in ``sent``, each answered by the test (:meth:`open`, ``_Future.answer``); every
    # launched sampler registers at once.

    def _start(self, worker, method, **fields):
        fut = SamplerCall()
        self.sent.append((worker, method, fields, fut))
        return fut

    def open(self, method):
        """The sampler calls of ``method`` not answered yet: ``[(worker, request fields, future)]``."""
        return [(w, f, fut) for w, m, f, fut in self.sent if m == method and not fut.done()]

    def wait_for_samplers(self, workers, timeout):
        return list(workers)

    def load_sampler(self, worker_id, programs):
        return object()

    def start_sampler_load(self, worker_id, programs):
        return self._start(worker_id, "Load")

    def publish_weights(self, trainers, leaves, dtype):
        return {w: pb.PublishWeightsReply(version=self.publish_version, bytes=8, held=list(self.held_versions))
                for w in trainers}

    def start_sync(self, worker_id, version, sources):
        return self._start(worker_id, "SyncWeights", version=version, sources=list(sources))

    def start_rollout(self, worker_id, step, microbatches, version, seed):
        return self._start(worker_id, "Rollout", step=step, microbatches=list(microbatches), version=version, seed=seed)

    def settle(self, worker_id, fut):
        pass

    def attach_samplers(self, known, fingerprint):
        return sorted(known)


class SamplerCall:
    """A sampler's call in flight, answered by the test (``answer``)."""

    def __init__(self):
        self._result, self._error, self._done = None, None, False

    def done(self):
        return self._done

    def result(self, timeout=None):
        if self._error is not None:
            raise self._error
        return self._result

    def answer(self, result=None, error=None):
        self._result, self._error, self._done = result, error, True
