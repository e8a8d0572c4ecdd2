"""An in-process stand-in for ``runtime.control.worker_group.WorkerGroup``: the controller's state machine
without processes.

Each fake worker holds a replica as a hash chain over the steps it applied,
so two replicas agree exactly when they applied the same steps. A step's
loss sum is a fixed function of the step. Faults are scheduled per step, or by a startup phase (``"register"``,
``"load"``, ``"init"``: the worker is killed during it):

- ``kill``: the worker crashes as the step runs; the "health monitor" finds
  it at once (``declare_dead`` with cause crash) and the step fails;
- ``kill_after_apply``: the worker crashes after the first survivor applied
  the step (survivors end one step apart: realignment rolls one back);
- ``hang``: the worker stops answering; only the step watchdog finds it
  (``wait`` answers ``Stalled`` at its deadline, without sleeping).

``crash(worker)`` kills a worker at any moment (a test's observer uses it to
kill during a state transfer).
"""

from __future__ import annotations

import hashlib
import queue

from runtime._proto import elastic_pb2 as pb
from runtime.core.errors import RegistrationTimeoutError, WorkerLostError
from runtime.control.policy import WorkerInfo, may_relaunch
from runtime.control.calls import Death, LoadResult, Stalled, StepResult, WorkerStatus


def loss_sum(step: int) -> float:
    return 64.0 / (step + 1)


class _Replica:
    def __init__(self):
        self.history = ["init"]      # state hash after 0, 1, 2, ... applied steps
        self.losses: dict[int, float] = {}

    @property
    def applied(self) -> int:
        return len(self.history) - 1

    def apply(self, step: int) -> None:
        assert step == self.applied, f"applied {self.applied} steps, asked to apply step {step}"
        self.history.append(hashlib.sha256(f"{self.history[-1]}/{step}".encode()).hexdigest())
        self.losses[step] = loss_sum(step)


class FakeGroup:
    address = "fake:0"
    client_host = ""
    def __init__(self, opts, events, faults: dict[int, tuple[str, str]] | None = None, devices: int = 2):
        self.opts, self.events, self.faults, self.devices = opts, events, dict(faults or {}), devices
        # In-memory snapshots (with ``snapshot_interval``): each host (a worker is a host of its own) keeps the
        # state histories it was given, by step, as the real workers' SnapshotStore does.
        self.snapshot_root = "fake-snapshots" if opts.snapshot_interval else ""
        self.held: dict[str, dict[int, _Replica]] = {}
        self._snapshot_orders: dict[int, dict] = {}
        self.epoch = 0
        self.dead: dict[str, str] = {}
        self.fenced: set[str] = set()
        self.replicas: dict[str, _Replica | None] = {}   # registered workers; None until initialized
        self.crashed: set[str] = set()
        self.hung: set[str] = set()
        self.adopted: set[str] = set()
        self.calls: list[str] = []
        self.stages: dict[str, int] = {}   # the pipeline stage each worker loaded (loaded_stage)
        self._deaths: queue.Queue = queue.Queue()
        self._launched = 0
        self._relaunched: set[str] = set()

    # -- lifecycle and membership ---------------------------------------------

    def start(self):
        pass

    def close(self):
        pass

    def detach(self):
        self.calls.append("detach")

    def attach(self, known, registered, stages=None):
        """A restarted client's attach: the workers of ``known`` that live (this group's ``replicas``, shared
        with the dead client's group by the test) take it; the others are declared dead."""
        self._launched = max([self._launched, *(int(w[1:]) + 1 for w in registered)])
        out = {}
        for w in known:
            if w not in self.replicas or not self._reachable(w):
                self.declare_dead(w, "did not answer the restarted client", cause="crash")
                continue
            r = self.replicas[w]
            self.adopted.add(w)
            out[w] = pb.AttachReply(worker_id=w, address=f"fake:{w}", num_devices=self.devices, platform="cpu",
                                    pid=2, host="", applied_steps=r.applied if r else -1)
        return out

    def new_generation(self, generation):
        self.generation = generation

    def fence_at(self, epoch):
        assert epoch >= self.epoch, f"epoch went back from {self.epoch} to {epoch}"
        self.epoch = epoch

    def launch(self, host=""):
        wid = f"w{self._launched}"
        self._launched += 1
        self.replicas[wid] = None
        return wid

    def relaunch(self, dead_worker):
        if dead_worker in self._relaunched:
            return None
        self._relaunched.add(dead_worker)
        o = self.opts
        if not may_relaunch(o.relaunch, self._launched, o.slices, o.spares, o.max_retries):
            return None
        wid = self.launch()
        self.events.emit("worker_relaunched", replaces=dead_worker, worker=wid)
        return wid

    def wait_for_workers(self, n, timeout):
        kind, target = self.faults.pop("register", (None, None))
        if kind == "kill":
            self.declare_dead(target, "exited with status -9 before registering", cause="crash")
            self.relaunch(target)
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

    def has_newcomers(self):
        return any(w not in self.adopted for w in self.replicas)

    def warmed(self):
        return False

    def start_warming(self):
        self.calls.append("start_warming")

    def warm_newcomers(self, block_until=None):
        new = [w for w in self.replicas if w not in self.adopted]
        self.adopted |= set(new)
        for w in new:
            self.events.emit("worker_warmed", worker=w, compile_seconds=0.0)
        return new

    def declare_dead(self, worker_id, reason, cause="unresponsive"):
        if worker_id in self.dead:
            return
        self.dead[worker_id] = reason
        self.events.emit("worker_dead", worker=worker_id, reason=reason, cause=cause)
        self._deaths.put(Death(worker_id, reason, cause))

    def drain_deaths(self):
        out = []
        while not self._deaths.empty():
            out.append(self._deaths.get_nowait())
        return out

    def forget(self, worker_id):
        self.calls.append(f"forget {worker_id}")

    def shutdown(self, worker_id):
        self.calls.append(f"shutdown {worker_id}")

    def crash(self, worker_id):
        self.crashed.add(worker_id)

    # -- health ---------------------------------------------------------------

    def _reachable(self, w) -> bool:
        return w not in self.dead and w not in self.crashed and w not in self.hung

    def is_alive(self, worker_id):
        return self._reachable(worker_id)

    def probe(self, workers):
        return {w: self._reachable(w) for w in workers}

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

    def init(self, workers, seed):
        ok = self._each("init", workers)
        for w in ok:
            self.replicas[w] = _Replica()
        return {w: 1024 for w in ok}

    def host_of(self, worker_id):
        return worker_id

    def dispatch(self, plan, checkpoints=None, shadows=(), snapshots=None):
        self.calls.append(f"dispatch {plan.step} epoch {plan.epoch}")
        self._snapshot_orders[plan.step] = dict(snapshots or {})
        return plan

    def _snapshots(self, plan) -> dict:
        """The snapshots ordered after ``plan``'s step: written on the writer's host, copied to its peer's."""
        out = {}
        for writer, peer in self._snapshot_orders.pop(plan.step, {}).items():
            r = self.replicas[writer]
            for host in (writer, peer):
                if host is not None:
                    copy = _Replica()
                    copy.history, copy.losses = list(r.history), dict(r.losses)
                    self.held.setdefault(host, {})[r.applied] = copy
            out[writer] = {"snapshots_saved": (r.applied,), "snapshots_copied": (r.applied,) if peer else ()}
        return out

    def wait(self, futs, deadline=None):
        plan = futs   # what dispatch returned
        assert plan.epoch == self.epoch, f"step {plan.step} of epoch {plan.epoch} waited on in epoch {self.epoch}"
        kind, target = self.faults.pop(plan.step, (None, None))
        if kind == "kill":
            self.crashed.add(target)
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
        saved = self._snapshots(plan)
        return {w: StepResult(loss_sum(plan.step), grad_seconds=0.01, **saved.get(w, {})) for w in plan.workers}

    def cancel_inflight(self):
        self.calls.append("cancel_inflight")

    def abort(self, workers):
        out = {}
        for w in workers:
            self._touch(w)
            r = self.replicas[w]
            out[w] = WorkerStatus(r.applied if r else 0, dict(r.losses) if r else {}, tuple(sorted(self.held.get(w, {}))))
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
        copy = _Replica()
        copy.history, copy.losses = list(src.history), dict(src.losses)
        self.replicas[dest] = copy
        return 1024, src.history[-1], "tcp"

    def hashes(self, workers):
        out = {}
        for w in workers:
            self._touch(w)
            r = self.replicas[w]
            out[w] = (r.applied, r.history[-1])
        return out

    def pid(self, worker_id):
        return 0

    def inject_fault(self, worker_id, action, *, factor=0.0, seconds=0.0, phase="", after_step=0):
        raise AssertionError("the fake group injects no faults: give them to its constructor")

    def poll(self, futs, deadline=None):
        raise AssertionError("the fake group has no shadow spares (their steps are polled)")

    def load_checkpoints(self, workers, directory, applied, snapshot=False, parameters_only=False):
        assert snapshot, "the fake group holds no checkpoints: only in-memory snapshots"
        out = {}
        for w in workers:
            self._touch(w)
            step = max(s for s in self.held.get(w, {}) if s <= applied)
            held = self.held[w][step]
            self.replicas[w] = copy = _Replica()
            copy.history, copy.losses = list(held.history), dict(held.losses)
            out[w] = pb.PullStateReply(applied_steps=step, bytes=1024)
        return out

    def flush_checkpoints(self, workers, wait_seconds, *, save=None):
        raise AssertionError("the fake group writes no checkpoints")
