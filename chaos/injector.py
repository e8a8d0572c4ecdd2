"""The fault injector: fires a schedule of faults at a live run, from outside it.

A :class:`FaultInjector` is a :class:`runtime.ControllerObserver`: the
controller tells it when steps commit and when a state transfer starts; a
thread of its own fires the time-based faults. Each fault is resolved to
worker ids (:func:`chaos.schedule.resolve_target`, with a seeded RNG, so a
schedule replays the same way) and injected by a signal to the worker
process (kill, hang) or by arming a worker-side action through the
controller (straggle, partition, corrupt, a kill inside a given phase, a kill
mid-transfer). Every injection is an event (``fault_injected``;
``fault_skipped`` when its target does not exist at that moment, or when
the run ended before it fired), so the report can match faults to failures
and the verdict can fail a run that was not tested against every fault.

It uses only the controller's observer surface: ``placement``,
``live_spares()``, ``live_samplers()`` (an RL run's), ``next_checkpoint_writer()``, ``pid(worker[, host])``,
``hosts_of(worker)``, ``inject_fault(worker, action, ...[, host=])`` and ``events.emit``.

**Client faults** (target ``client``) strike the process the injector runs
in, so they fire only under the chaos supervisor (:mod:`chaos.supervisor`,
``supervised``: this process is a client it restarts); unsupervised they are
skipped. The fault is recorded first (``fault_injected``, written before
anything else happens), then ``kill`` SIGKILLs this process and ``hang``
SIGSTOPs it: a helper process wakes it after ``resume`` seconds when that is
within the workers' lease (the client goes on); a longer one is the
supervisor's to wake once a new client took the run over (the helper then
only backs it up, long after), and this injector fires nothing after it
wakes: the run is the new client's. Faults due at the same moment as a client
fault fire first (a worker killed with the client is one its successor
finds dead). A restarted client's injector is given the run's log so far
(``history``): faults it records as fired or skipped are never fired again,
the step, checkpoint and snapshot triggers count from what the log holds,
and ``@time`` counts from the first client's start.
"""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import subprocess
import sys
import threading
import time

from chaos.schedule import TargetError, resolve_target
from chaos.spec import INJECTABLE_KINDS, Fault
from runtime import FAULT_ACTIONS, ControllerObserver, ElasticError

__all__ = ["ClientSide", "FaultInjector", "backstop_seconds", "outlasts_lease"]

# How each fault kind is injected, keyed by (kind, variant): a signal to the
# worker process, or a worker-side action of runtime.FAULT_ACTIONS. The
# variant is the transfer end ("source"/"dest") of an @transfer fault,
# "phase" for kill(phase=...), else None.
_HOW: dict[tuple[str, str | None], signal.Signals | str] = {
    ("kill", None): signal.SIGKILL,
    ("kill", "phase"): "kill_in_phase",
    ("kill", "source"): "kill_on_send_state",
    ("kill", "dest"): "kill_on_receive_state",
    ("hang", None): signal.SIGSTOP,
    ("hang", "source"): "hang_on_send_state",
    ("straggle", None): "straggle",
    ("partition", None): "partition",
    ("corrupt", None): "corrupt",
    ("kill_save", None): "kill_in_phase",   # phase "save": mid-write of the next checkpoint it writes
}


def _check_how() -> None:
    """At import: every action is one the runtime offers, and every injectable kind (and no other) has a way."""
    unknown = sorted(a for a in _HOW.values() if isinstance(a, str) and a not in FAULT_ACTIONS)
    if unknown:
        raise RuntimeError(f"chaos.injector: actions {unknown} are not in runtime.FAULT_ACTIONS {FAULT_ACTIONS}")
    kinds = {kind for kind, _ in _HOW}
    if kinds != set(INJECTABLE_KINDS):
        raise RuntimeError(f"chaos.injector: injects {sorted(kinds)}, the grammar offers {sorted(INJECTABLE_KINDS)}")


_check_how()


@dataclasses.dataclass(frozen=True)
class ClientSide:
    """The injector runs in a client the chaos supervisor restarts (:mod:`chaos.supervisor`): the run's ``steps``,
    the workers' lease on their client (``elastic_worker_lease_seconds``) and how long they wait for a new one
    (``elastic_client_grace_seconds``)."""

    steps: int
    lease_seconds: float
    grace_seconds: float


def outlasts_lease(seconds: float, lease_seconds: float) -> bool:
    """Whether a client stopped for ``seconds`` is taken over by a new one (the supervisor's rule, which the
    stopped client's injector follows too): its workers fence themselves once the lease has passed."""
    return seconds > lease_seconds


def backstop_seconds(seconds: float, side: ClientSide) -> float:
    """When a stopped client that outlasts the lease wakes should no supervisor wake it (the supervisor is gone):
    once ``resume`` passed and the workers' grace ran out, so it can never race a new client."""
    return seconds + side.lease_seconds + side.grace_seconds + 30.0


class FaultInjector(ControllerObserver):
    """Injects ``faults`` into the run of the controller it is attached to.

    Contract: each fault fires at most once, in schedule order for its
    trigger (a client fault after the others due with it); a fault whose
    target cannot be resolved is skipped and logged, never retried; a fault
    still waiting when the run ends (:meth:`close`) is skipped and logged
    too, and nothing fires after that. Hooks run on the controller's thread
    and only send signals or one short RPC (a client fault stops or kills the
    very process they run in).
    """

    def __init__(self, faults: list[Fault], seed: int = 0, info: dict | None = None, *,
                 history: list[dict] | tuple = (), supervised: ClientSide | None = None):
        self.faults = list(faults)
        self.info = info or {}
        self.rng = random.Random(seed)
        self.supervised = supervised
        self.ctl = None
        self.t0 = 0.0
        self.committed = 0
        self.transfers = 0
        self.checkpointed = -1   # the newest step whose checkpoint was saved (-1: none yet)
        self.snapshotted = -1    # the newest step whose in-memory snapshot was saved (-1: none yet)
        self.fired: set[int] = set()
        self._started_at: float | None = None   # wall time the run's first injector attached (a restarted client)
        self._replay(history)
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._timers: list[threading.Timer] = []
        self._thread = threading.Thread(target=self._clock, name="chaos-clock", daemon=True)

    def _replay(self, history) -> None:
        """What the run's log so far (a restarted client's) says was fired, committed and saved."""
        specs = [f.spec() for f in self.faults]
        for e in history:
            kind = e.get("kind")
            if kind in ("fault_injected", "fault_skipped"):
                i = e.get("index")
                if isinstance(i, int) and 0 <= i < len(specs) and e.get("fault") == specs[i]:
                    self.fired.add(i)
            elif kind == "step_committed":
                self.committed = max(self.committed, e.get("step", -1) + 1)
            elif kind == "checkpoint_saved":
                self.checkpointed = max(self.checkpointed, e.get("step", -1))
            elif kind == "snapshot_saved":
                self.snapshotted = max(self.snapshotted, e.get("step", -1))
            elif kind == "chaos_started" and self._started_at is None:
                self._started_at = e.get("t")

    # -- ControllerObserver --------------------------------------------------

    def attach(self, controller) -> None:
        self.ctl = controller
        self.t0 = time.monotonic()
        if self._started_at is not None:   # a restarted client: @time counts from the first client's start
            self.t0 -= max(time.time() - self._started_at, 0.0)
        elif self.info:
            controller.events.emit("chaos_started", **self.info)
        self._fire(lambda f: f.when.step is not None and f.when.step <= 0)
        self._thread.start()

    def step_committed(self, step: int) -> None:
        self.committed = max(self.committed, step + 1)
        self._fire(lambda f: f.when.step is not None and f.when.step <= self.committed)

    def checkpoint_saved(self, step: int) -> None:
        self.checkpointed = max(self.checkpointed, step)
        self._fire(lambda f: f.when.checkpoint is not None and f.when.checkpoint <= self.checkpointed)

    def snapshot_saved(self, step: int) -> None:
        self.snapshotted = max(self.snapshotted, step)
        self._fire(lambda f: f.when.snapshot is not None and f.when.snapshot <= self.snapshotted)

    def before_transfer(self, source: str, dest: str) -> None:
        self.transfers += 1
        self._fire(lambda f: f.when.transfer, source=source, dest=dest)

    def close(self) -> None:
        """The run ended: nothing fires any more; each fault that never fired is logged as ``fault_skipped``.

        A fault that did not fire was never tested, so it is recorded with the
        reason (the report lists it, the verdict fails); ``close`` does this once.
        """
        self._stop.set()
        for t in self._timers:
            t.cancel()
        with self._lock:
            unfired = [i for i in range(len(self.faults)) if i not in self.fired]
            self.fired.update(unfired)
            if self.ctl is None:
                return   # the run ended before training started: no log to write to, and it failed anyway
            elapsed = time.monotonic() - self.t0
            for i in unfired:
                fault = self.faults[i]
                self.ctl.events.emit("fault_skipped", index=i, fault=fault.spec(), fault_kind=fault.kind,
                                     reason=self._never_fired(fault, elapsed), step=self.committed)

    def _never_fired(self, fault: Fault, elapsed: float) -> str:
        when = fault.when
        if fault.hits_client and self.supervised is None:
            return "never fired: a client fault needs the chaos supervisor to restart the client (chaos.harness.run_chaos, as elastic chaos runs it)"
        if fault.hits_client and self._came_due(fault, elapsed):
            return (f"never fired: {when.spec()} came due with every step committed, and a client fault strikes "
                    "only while steps are left for a new client to take over")
        if when.step is not None:
            n = self.committed
            return f"never fired: the run ended with {n} step{'' if n == 1 else 's'} committed, before {when.spec()}"
        if when.checkpoint is not None:
            saved = f"the newest saved was of step {self.checkpointed}" if self.checkpointed >= 0 else "none was saved"
            return f"never fired: the run ended before a checkpoint of step {when.checkpoint} or later ({saved})"
        if when.snapshot is not None:
            saved = f"the newest saved was of step {self.snapshotted}" if self.snapshotted >= 0 else "none was saved"
            return f"never fired: the run ended before a snapshot of step {when.snapshot} or later ({saved})"
        if when.time is not None and when.time <= elapsed:   # came due between two ticks of the clock
            return f"never fired: the run ended just as {when.spec()} came due ({elapsed:.1f} s after training started)"
        if when.time is not None:
            return f"never fired: the run ended {elapsed:.1f} s after training started, before {when.spec()}"
        if self.transfers:
            return (f"never fired: the run made {self.transfers} state transfer{'' if self.transfers == 1 else 's'}, "
                    "and each carries one @transfer fault")
        return "never fired: no state transfer happened"

    def _came_due(self, fault: Fault, elapsed: float) -> bool:
        """Whether ``fault``'s trigger came (for a client fault kept back: it waits for steps committed and left)."""
        when = fault.when
        return ((when.step is not None and when.step <= self.committed)
                or (when.checkpoint is not None and 0 <= when.checkpoint <= self.checkpointed)
                or (when.snapshot is not None and 0 <= when.snapshot <= self.snapshotted)
                or (when.time is not None and when.time <= elapsed) or (when.transfer and self.transfers > 0))

    # -- firing --------------------------------------------------------------

    def _clock(self) -> None:
        while not self._stop.wait(0.05):
            elapsed = time.monotonic() - self.t0
            self._fire(lambda f: f.when.time is not None and f.when.time <= elapsed)
            if all(i in self.fired for i in range(len(self.faults))):
                return

    def _fire(self, due, source: str | None = None, dest: str | None = None) -> None:
        with self._lock:
            ready = [i for i, f in enumerate(self.faults) if i not in self.fired and due(f) and self._may_strike(f)]
            if ready and self.faults[ready[0]].when.transfer:
                ready = ready[:1]   # one transfer fault per transfer: the next one hits the retry's transfer
            for i in sorted(ready, key=lambda i: self.faults[i].hits_client):   # the client's last
                if i in self.fired:
                    continue   # a client hang outlasting the lease woke this injector after the run was taken over
                self.fired.add(i)
                self._inject(i, self.faults[i], source, dest)

    def _may_strike(self, fault: Fault) -> bool:
        """A client fault waits for a state its workers can keep (a committed step) and strikes only while steps
        are left (after the last commit nothing is left to take over); unsupervised it is skipped at close."""
        if not fault.hits_client:
            return True
        return self.supervised is not None and 1 <= self.committed < self.supervised.steps

    def _inject(self, index: int, fault: Fault, source: str | None, dest: str | None) -> None:
        ctl = self.ctl
        if fault.hits_client:
            self._strike_client(index, fault)
            return
        try:
            writer = ctl.next_checkpoint_writer() if fault.target.spec() == "role=writer" else None
            workers = resolve_target(fault.target, ctl.placement, ctl.live_spares(), self.rng,
                                     source=source, dest=dest, writer=writer, samplers=ctl.live_samplers())
        except TargetError as e:
            ctl.events.emit("fault_skipped", index=index, fault=fault.spec(), fault_kind=fault.kind, reason=str(e),
                            step=self.committed)
            return
        errors, hosts = {}, {}
        for w in workers:
            try:
                hosts[w] = self._host(fault, w)
                self._hit(fault, w, hosts[w])
            except (OSError, ElasticError, KeyError, IndexError) as e:
                errors[w] = f"{type(e).__name__}: {e}"
        hit_hosts = {w: k for w, k in hosts.items() if k is not None}
        ctl.events.emit("fault_injected", index=index, fault=fault.spec(), fault_kind=fault.kind,
                        workers=list(workers), step=self.committed, errors=errors,
                        seconds=time.monotonic() - self.t0, **({"hosts": hit_hosts} if hit_hosts else {}))

    def _host(self, fault: Fault, worker: str) -> int | None:
        """Which host of ``worker``'s slice ``fault`` hits: the target's, else a random one (None: a slice of one
        host). IndexError when the slice has no such host."""
        hosts = self.ctl.hosts_of(worker)
        if hosts == 1 and fault.target.host in (None, 0):
            return None
        if fault.target.host is not None:
            if fault.target.host >= hosts:
                raise IndexError(f"slice {worker} has {hosts} host(s), no host {fault.target.host}")
            return fault.target.host
        return self.rng.randrange(hosts)

    def _hit(self, fault: Fault, worker: str, host: int | None = None) -> None:
        """Injects ``fault`` into ``worker`` (``host`` of its slice; None: a slice of one host); raises OSError,
        ElasticError or KeyError when it cannot."""
        if fault.when.transfer:
            variant = fault.target.value
        elif fault.kind == "kill" and fault.option("phase"):
            variant = "phase"
        else:
            variant = None
        how = _HOW.get((fault.kind, variant))
        if how is None:
            raise KeyError(f"the injector cannot do {fault.kind!r}" + (f" ({variant})" if variant else ""))
        if isinstance(how, signal.Signals):
            pid = self.ctl.pid(worker, host or 0)
            os.kill(pid, how)
            resume = fault.option("resume") if fault.kind == "hang" else None
            if resume:
                timer = threading.Timer(resume, _resume, args=(pid,))
                timer.daemon = True
                timer.start()
                self._timers.append(timer)
        elif how == "kill_in_phase":
            phase = "save" if fault.kind == "kill_save" else str(fault.option("phase"))
            # kill_save@checkpoint=N: a save still ahead of checkpoint N, never an older one still being written.
            after = fault.when.checkpoint if fault.kind == "kill_save" and fault.when.checkpoint else 0
            self.ctl.inject_fault(worker, how, phase=phase, after_step=after, host=host)
        elif how == "straggle":
            self.ctl.inject_fault(worker, how, factor=fault.option("factor"), seconds=fault.option("for"), host=host)
        elif how == "partition":
            self.ctl.inject_fault(worker, how, seconds=fault.option("for"), host=host)
        else:
            self.ctl.inject_fault(worker, how, host=host)

    def _strike_client(self, index: int, fault: Fault) -> None:
        """Records the client fault, then SIGKILLs or SIGSTOPs this process (see the module docstring)."""
        side = self.supervised
        self.ctl.events.emit("fault_injected", index=index, fault=fault.spec(), fault_kind=fault.kind, workers=[],
                             step=self.committed, errors={}, seconds=time.monotonic() - self.t0)
        pid = os.getpid()
        if fault.kind == "kill":
            os.kill(pid, signal.SIGKILL)
            return
        seconds = fault.option("resume")
        taken_over = outlasts_lease(seconds, side.lease_seconds)
        wake = time.time() + (backstop_seconds(seconds, side) if taken_over else seconds)
        subprocess.Popen([sys.executable, "-I", "-S", "-c", _WAKER, str(pid), repr(wake)], start_new_session=True,
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.kill(pid, signal.SIGSTOP)
        if taken_over:   # woken: a new client drives the run now; this one only gets refused
            self._stop.set()
            self.fired.update(range(len(self.faults)))


# What wakes a stopped client (``python -c _WAKER PID WALL_TIME``): SIGCONT at that time unless it ended first.
# Through a pidfd, so it never signals another process that got the pid since; it ends with the client.
_WAKER = """
import os, select, signal, sys, time
pid, at = int(sys.argv[1]), float(sys.argv[2])
try:
    fd = os.pidfd_open(pid)
except OSError:   # no pidfds (Linux before 5.3): a plain signal at that time
    time.sleep(max(at - time.time(), 0.0))
    os.kill(pid, signal.SIGCONT)
    sys.exit(0)
if not select.select([fd], [], [], max(at - time.time(), 0.0))[0]:
    try:
        signal.pidfd_send_signal(fd, signal.SIGCONT)
    except OSError:
        pass
"""


def _resume(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass   # the controller's cleanup got there first
