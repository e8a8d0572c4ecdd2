"""The run's state as the controller knows it: one frozen value, a pure fold of the event log.

:class:`RunState` holds everything the controller decides from: the
placement and its epoch, the committed and dispatched frontiers, the losses
(and the workers' loss sums), the replicas, the dead, the recovery count,
the relaunches deferred to the next commit, the stragglers waiting for a
swap, the backups known to be complete (checkpoints, snapshots, shadow
spares), and an RL run's weights versions: which live trainer and sampler
holds which, and the version each sampler has installed.

It changes in one way only: an event. :meth:`RunState.apply` folds one event
(as written to ``events.jsonl``: JSON-decoded) into a new value, and the
controller subscribes to its own :class:`~runtime.core.events.EventLog`, so the
state it reads is the fold of exactly the events it wrote, in the order the
log holds them. :meth:`RunState.replay` rebuilds the same value from the log
alone: a restarted client re-attaches the run's live workers from it
(:mod:`runtime.control.attach`; a ``client_attached`` continues the attempt),
and the chaos harness checks it at the end of every run. Kinds the fold does not
read are passed over; a
``run_started`` begins a new attempt (the log keeps every attempt; a resumed
attempt gets its frontier and losses from ``run_resumed``).

Nothing here reads a clock, a socket or a file but :func:`replay_file`, the
one reader, at the edge, and :class:`RunLedger`, which holds a client's
current state and notes when its last event came.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from runtime.core.hosts import host_id
from runtime.control.placement import Placement, WorkerInfo
from runtime.core.events import read_events
from runtime.core.programs import SAMPLER_WEIGHTS_KEPT, TRAINER_WEIGHTS_KEPT
from runtime.state.snapshot import KEEP as KEPT

__all__ = ["Backup", "Member", "RunLedger", "RunState", "SAMPLER", "Series", "TRAINER", "Transition", "attempts",
           "replay_file", "transitions"]

#: A member's role: a trainer slice (a cell of the placement grid, or a spare) or an RL run's sampler.
TRAINER, SAMPLER = "trainer", "sampler"

#: Recovery decisions that leave the placement as it was (the run waits, or ends).
_UNADOPTED = ("wait", "fail")


def _loss(x: Any) -> float:
    return float("nan") if x is None else float(x)


@dataclasses.dataclass(frozen=True)
class Member:
    """One process (slice) of the run, as the log knows it: its ``role``, the host it was launched on, the dead
    member it was launched in place of (``replaces``, "" for none), where it serves once it registered
    (``info``: its :class:`~runtime.control.placement.WorkerInfo`, with each host of its slice; None until then)
    and whether it loaded its role's programs (``loaded``). Its cell is the placement's
    (``Placement.stage_of``); a spare or a sampler has none."""

    worker: str
    role: str = TRAINER
    host: str = ""
    replaces: str = ""
    info: WorkerInfo | None = None
    loaded: bool = False

    @property
    def registered(self) -> bool:
        return self.info is not None

    @property
    def home(self) -> str:
        """The host a process launched in this one's place goes to (it finds the snapshots left there): where this
        one registered, else where it was launched (a slice of several hosts: where it was launched, its hosts'
        base), else its id."""
        if self.info is not None and self.info.hosts:
            return self.host or self.info.host or self.worker
        return (self.info.host if self.info is not None else "") or self.host or self.worker


@dataclasses.dataclass(frozen=True)
class Backup:
    """One backup of the state known complete: ``tier`` ("snapshot" or "checkpoint") of ``step`` (the state
    after that many steps), of pipeline ``stage`` (None: an unpipelined run's whole state, or one reported by a
    worker of no known stage), held on ``host`` (a snapshot: the host whose memory keeps it; a checkpoint: "",
    the run's checkpoint directory)."""

    tier: str
    step: int
    stage: int | None = None
    host: str = ""

    def _key(self):
        return (self.tier, self.step, -1 if self.stage is None else self.stage, self.host)

    def __lt__(self, other):
        return self._key() < other._key()


class Series(Sequence):
    """An immutable sequence of floats that appends in O(1): a view of the first ``len`` items of a list it may
    share with the views it came from. ``appended(x)`` and ``upto(n)`` answer new views and never change this
    one (an append past a shorter view's end copies first). Compares equal to any sequence of the same floats,
    NaN equal to NaN (losses are compared by their bits, as the trajectory check does)."""

    __slots__ = ("_items", "_n")

    def __init__(self, items: Iterable[float] = ()):
        self._items = [float(x) for x in items]
        self._n = len(self._items)

    @classmethod
    def _view(cls, items: list, n: int) -> Series:
        new = cls.__new__(cls)
        new._items, new._n = items, n
        return new

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return tuple(self._items[:self._n][i])
        if not -self._n <= i < self._n:
            raise IndexError(i)
        return self._items[i % self._n]

    def appended(self, x: float) -> Series:
        if len(self._items) == self._n:   # this view ends the list: extend it in place
            self._items.append(x)
            return Series._view(self._items, self._n + 1)
        return Series._view(self._items[:self._n] + [x], self._n + 1)

    def upto(self, n: int) -> Series:
        return self if n >= self._n else Series._view(self._items, max(n, 0))

    def __eq__(self, other) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, str):
            return NotImplemented
        return len(other) == self._n and _bits(self) == _bits(other)

    __hash__ = None

    def __repr__(self) -> str:
        return f"Series({list(self)!r})"


@dataclasses.dataclass(frozen=True)
class RunState:
    """The controller's knowledge of the run (see the module docstring). Equal values mean the same run state
    (NaN losses compare equal: they are compared by their bits)."""

    run_id: str = ""
    steps: int = 0                               # the steps this attempt runs to (run_truncated cuts it)
    placement: Placement | None = None           # the adopted placement (its epoch is the membership epoch)
    pipeline_stages: int = 1                     # the placement grid's rows (run_started's stages)
    losses: Series = dataclasses.field(default_factory=Series)      # per committed step (len: committed frontier)
    loss_sums: Series = dataclasses.field(default_factory=Series)   # the workers' sums behind them (checkpoints)
    dispatched: int = 0                          # the next step to dispatch (the dispatch frontier)
    replicas: frozenset[str] = frozenset()       # workers known to hold the state at the committed frontier
    dead: Mapping[str, str] = dataclasses.field(default_factory=dict)   # every worker declared dead in this
    #                                            attempt, with why (the run's one record of deaths)
    recoveries: int = 0                          # recovery attempts so far (failures detected)
    deferred: tuple[str, ...] = ()               # dead workers whose replacements start after the next commit
    swaps: tuple[str, ...] = ()                  # stragglers to move onto spares at the next boundary
    evaluated: frozenset[int] = frozenset()      # steps whose eval is recorded (eval_completed or eval_skipped)
    # The run's one record of backups: each checkpoint a worker reported saved (of its stage), each in-memory
    # snapshot reported kept on a host (written there, or copied there from its writer; the newest KEPT of each
    # host's stage directory, as its SnapshotStore keeps them). ``complete(tier)``: the steps a whole copy is of.
    backups: frozenset[Backup] = frozenset()
    shadows: frozenset[str] = frozenset()        # spares given a copy of the committed state to shadow
    state_bytes: int = 0
    # Every process of this attempt, by id, in launch order: its role, where it was launched, whom it replaces,
    # where it serves once registered (a restarted client attaches them from here): {worker: Member}.
    members: Mapping[str, Member] = dataclasses.field(default_factory=dict)
    generation: int = 0                          # the client generation driving the run (a restart: one more)
    # A shared pool's run (runtime.pool): the hosts leased to it ({worker: (pool host, lease id)}), whether it
    # waits in the pool's queue now (the pool's last word on where, None: not waiting) and whether it ever did
    # either in this attempt (``pooled``).
    leases: Mapping[str, tuple[str, str]] = dataclasses.field(default_factory=dict)
    pool_waiting: str | None = None
    pooled: bool = False
    fenced: frozenset[str] = frozenset()         # members that fenced themselves (their client was silent past their
    #                                            lease) and wait, holding their state, to be taken back
    left: frozenset[str] = frozenset()           # workers the run let go alive (given back to a pool, a straggler
    #                                            sent home): no member any more, never attached again
    # A pipelined run: the stage each worker's programs are for ({worker: stage}, from programs_loaded,
    # worker_warmed, stage_loaded, a stage's shadow_synced and client_attached); a backup it reports is of that
    # stage. The one record of it: the group and checkpointing read it here.
    stages: Mapping[str, int] = dataclasses.field(default_factory=dict)
    # An RL run's weights versions (runtime.control.sampling): the versions each live trainer and sampler holds for
    # others to pull ({worker: versions, ascending}; its newest, as its outbox keeps them), and the version each
    # sampler has installed, which its rollouts use ({sampler: version}). A restarted client reads them here: the
    # trainers' answers to PublishWeights (weights_published), the trainers that applied a step (rl_step: they
    # hold the version after it), the samplers' syncs (weights_synced); a death forgets what the dead held.
    weights: Mapping[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    installed: Mapping[str, int] = dataclasses.field(default_factory=dict)

    # -- what the controller reads --------------------------------------------

    @property
    def committed(self) -> int:
        """The committed frontier: steps ``0 .. committed - 1`` are committed."""
        return len(self.losses)

    @property
    def in_flight(self) -> range:
        """The steps dispatched and not committed."""
        return range(self.committed, max(self.dispatched, self.committed))

    @property
    def registered(self) -> dict[str, WorkerInfo]:
        """The members that registered: ``{worker: WorkerInfo}``."""
        return {w: m.info for w, m in self.members.items() if m.info is not None}

    def role_of(self, worker: str) -> str:
        """``worker``'s role (a worker the log never saw launched, one that joined by hand: a trainer)."""
        m = self.members.get(worker)
        return m.role if m is not None else TRAINER

    def of_role(self, role: str) -> list[str]:
        """The members of ``role`` not declared dead, in launch order."""
        return [w for w, m in self.members.items() if m.role == role and w not in self.dead]

    def relaunches(self, role: str) -> int:
        """Members of ``role`` launched in a dead one's place in this attempt, and those decided and not launched
        yet (``deferred``); not those asked for in place of one the run let go (``left``: nothing died)."""
        return sum(1 for m in self.members.values() if m.replaces and m.replaces not in self.left and m.role == role) + \
            sum(1 for w in self.deferred if self.role_of(w) == role)

    def replaced(self, worker: str) -> bool:
        """A member was launched in ``worker``'s place, or is decided to be (``deferred``)."""
        return worker in self.deferred or any(m.replaces == worker for m in self.members.values())

    def complete(self, tier: str, at_most: int | None = None) -> frozenset[int]:
        """The steps (at or before ``at_most``) of which ``tier`` holds a whole copy of the state: a backup of
        the step, or in a pipelined run one of every stage."""
        held = [b for b in self.backups if b.tier == tier and (at_most is None or b.step <= at_most)]
        if self.pipeline_stages == 1:
            return frozenset(b.step for b in held)
        return frozenset.intersection(*(frozenset(b.step for b in held if b.stage == k)
                                        for k in range(self.pipeline_stages)))

    @property
    def checkpoints(self) -> tuple[int, ...]:
        """The steps of the complete checkpoints, ascending."""
        return tuple(sorted(self.complete("checkpoint")))

    @property
    def snapshots(self) -> tuple[tuple[int, str, int | None], ...]:
        """``(step, host, stage)`` of each snapshot known kept, ascending."""
        return tuple((b.step, b.host, b.stage) for b in sorted(b for b in self.backups if b.tier == "snapshot"))

    @property
    def epoch(self) -> int:
        return self.placement.epoch if self.placement else 0

    def __eq__(self, other) -> bool:
        if not isinstance(other, RunState):
            return NotImplemented
        return not self.differences(other)

    __hash__ = None

    def differences(self, other: RunState) -> dict[str, tuple[Any, Any]]:
        """``{field: (mine, theirs)}`` of the fields that differ (for a test's or the harness's message)."""
        out = {}
        for f in dataclasses.fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if f.name in ("losses", "loss_sums"):
                a, b = _bits(a), _bits(b)
            if a != b:
                out[f.name] = (a, b)
        return out

    # -- the fold ----------------------------------------------------------------

    @classmethod
    def replay(cls, events: Iterable[Mapping[str, Any]]) -> RunState:
        """The state the events leave, from nothing (a run's whole log: the last attempt's state)."""
        state = cls()
        for e in events:
            state = state.apply(e)
        return state

    def apply(self, e: Mapping[str, Any]) -> RunState:
        """This state after event ``e`` (as written: JSON-decoded). Kinds the run state does not read return
        ``self``."""
        fold = _FOLDS.get(e.get("kind"))
        return fold(self, e) if fold is not None else self


def _bits(xs: Iterable) -> tuple:
    return tuple("nan" if isinstance(x, float) and math.isnan(x) else x for x in xs)


def _replace(s: RunState, **changes) -> RunState:
    """``dataclasses.replace`` without its per-field checks (RunState has none): a fold runs twice a step."""
    new = object.__new__(RunState)
    new.__dict__.update(s.__dict__, **changes)
    return new


def _active(s: RunState) -> frozenset[str]:
    return frozenset(s.placement.active) if s.placement else frozenset()


def _placement(s: RunState, e: Mapping[str, Any]) -> Placement:
    return Placement(epoch=e.get("epoch", 0), active=tuple(e["active"]),   # (older logs: no epoch, spares)
                     spares=tuple(e.get("spares", ())), stages=s.pipeline_stages)


def _run_started(s: RunState, e) -> RunState:
    return RunState(run_id=e.get("run_id", ""), steps=e.get("steps", 0), generation=e.get("generation", 0),
                    pipeline_stages=e.get("stages", 1))


def _worker_info(w: str, i) -> WorkerInfo:
    """A worker as an event records it (``worker_registered``, or one of ``client_attached``'s): a slice of
    several hosts with each host's (``hosts``: address, data_address, pid, host; see
    :mod:`runtime.core.hosts`)."""
    hosts = i.get("hosts") or ()
    return WorkerInfo(w, i["address"], i["devices"], i["platform"], i["pid"], i.get("data_address", ""),
                      i.get("host") or "",
                      tuple(WorkerInfo(host_id(w, k, len(hosts)), h["address"], i["devices"], i["platform"], h["pid"],
                                       h.get("data_address", ""), h.get("host") or "") for k, h in enumerate(hosts)))


def _member(s: RunState, worker: str, **changes) -> RunState:
    """``s`` with member ``worker`` changed (a member the log never saw launched: added, a trainer)."""
    m = s.members.get(worker) or Member(worker)
    return _replace(s, members={**s.members, worker: dataclasses.replace(m, **changes)})


def _launched(s: RunState, e) -> RunState:
    """A process was launched (``worker_launched``; ``worker_relaunched``: in a dead member's place)."""
    return _member(s, e["worker"], role=e.get("role", TRAINER), host=e.get("host") or "",
                   replaces=e.get("replaces", ""))


def _sampler_relaunched(s: RunState, e) -> RunState:   # (older logs: a sampler's relaunch had its own kind)
    return _member(s, e["worker"], role=SAMPLER, replaces=e["replaces"])


def _registered(s: RunState, e) -> RunState:
    return _member(s, e["worker"], info=_worker_info(e["worker"], e))


def _loaded(*fields: str):
    """Members that loaded their programs: the ``workers`` (or ``worker``, or keys of ``compile_seconds``) of an
    event; ``role``: a sampler's events say so (older logs recorded no sampler's launch)."""
    def fold(s: RunState, e) -> RunState:
        names = e.get("worker")
        names = [names] if isinstance(names, str) else list(e.get(fields[0], ()))
        role = SAMPLER if e["kind"].startswith("sampler") else None
        for w in names:
            s = _member(s, w, loaded=True, **({"role": role} if role else {}))
        return s
    return fold


def _client_attached(s: RunState, e) -> RunState:
    """A restarted client took the run over: the same attempt goes on (nothing reset), the workers that
    answered it registered anew (their addresses), those that did not are dead (their own events say so)."""
    for w, i in e["workers"].items():
        s = _member(s, w, info=_worker_info(w, i))
    answered = {w: i["stage"] for w, i in e["workers"].items() if i.get("stage") is not None}
    return _replace(s, steps=e["steps"], generation=e["generation"], stages={**s.stages, **answered},
                    fenced=s.fenced - set(e["workers"]),
                    dead={w: why for w, why in s.dead.items() if w not in e["workers"]})


def _first_placement(s: RunState, e) -> RunState:
    return _replace(s, placement=_placement(s, e))


def _placement_changed(s: RunState, e) -> RunState:
    return _replace(s, placement=_placement(s, e))


def _state_initialized(s: RunState, e) -> RunState:
    return _replace(s, replicas=_active(s), state_bytes=e.get("state_bytes", 0))


def _run_resumed(s: RunState, e) -> RunState:
    sums = e.get("loss_sums")
    return _replace(s, losses=Series(map(_loss, e.get("losses", [None] * e["step"]))),
                    loss_sums=Series(map(_loss, sums) if sums is not None else [float("nan")] * e["step"]),
                    dispatched=e["step"], replicas=_active(s), state_bytes=e.get("state_bytes", 0))


def _truncated(s: RunState, e) -> RunState:
    return _replace(s, steps=e["steps"])


def _dispatched(s: RunState, e) -> RunState:
    return _replace(s, dispatched=max(s.dispatched, e["step"] + 1))


def _committed(s: RunState, e) -> RunState:
    changes = {"losses": s.losses.appended(_loss(e.get("loss"))),
               "loss_sums": s.loss_sums.appended(_loss(e.get("loss_sum")))}
    if not e.get("recovered"):
        changes["deferred"] = ()   # the recovery's first step is done: its replacements start now
    return _replace(s, **changes)


def _worker_dead(s: RunState, e) -> RunState:
    w = e["worker"]
    s = _replace(s, dead={**s.dead, w: e.get("reason") or e.get("cause") or "dead"}, fenced=s.fenced - {w})
    if w in s.weights or w in s.installed:   # (an RL run: what it held is held no longer)
        s = _replace(s, weights={k: v for k, v in s.weights.items() if k != w},
                     installed={k: v for k, v in s.installed.items() if k != w})
    return s


def _samplers_attached(s: RunState, e) -> RunState:
    """A restarted client took over the samplers that answered (fenced no more)."""
    s = _loaded("workers")(s, e)
    return _replace(s, fenced=s.fenced - set(e["workers"]))


def _lease_granted(s: RunState, e) -> RunState:
    return _replace(s, leases={**s.leases, e["worker"]: (e["host"], e["lease"])}, pool_waiting=None, pooled=True)


def _lease_returned(s: RunState, e) -> RunState:
    return _replace(s, leases={w: x for w, x in s.leases.items() if w != e["worker"]})


def _pool_waiting(s: RunState, e) -> RunState:
    return _replace(s, pool_waiting=e["status"], pooled=True)


def _fenced(s: RunState, e) -> RunState:
    return _replace(s, fenced=s.fenced | {e["worker"]})


def _failure(s: RunState, e) -> RunState:
    return _replace(s, recoveries=s.recoveries + 1)


def _decision(s: RunState, e) -> RunState:
    if e["action"] in _UNADOPTED:
        return s
    return _replace(s, placement=_placement(s, e))


def _deferred(s: RunState, e) -> RunState:
    return _replace(s, deferred=s.deferred + tuple(w for w in e["workers"] if w not in s.deferred))


def _recovered(s: RunState, e) -> RunState:
    """The run is whole at ``resume_step``: every active slice holds it; later steps are undone."""
    step = e.get("resume_step", s.committed)   # (a log that names no step: nothing undone)
    active = _active(s)
    return _replace(s, losses=s.losses.upto(step), loss_sums=s.loss_sums.upto(step), dispatched=step, replicas=active,
                    shadows=frozenset() if e.get("restore_tier") in ("snapshot", "checkpoint")
                    else s.shadows - active)


def _remapped(s: RunState, e) -> RunState:
    placement = _placement(s, e)
    return _replace(s, placement=placement, replicas=frozenset(placement.active),
                    shadows=s.shadows - frozenset(placement.active),
                    swaps=tuple(w for w in s.swaps if w != e.get("slow")))


def _let_go(s: RunState, e) -> RunState:
    """A boundary change that sent workers home (``released``: given back to a pool; ``straggler_replaced``: the
    slow one)."""
    gone = e.get("given") or ([e["slow"]] if e.get("slow") else [])
    return _replace(_remapped(s, e), left=s.left | frozenset(gone))


def _straggler(s: RunState, e) -> RunState:
    if e.get("queued") and e["worker"] not in s.swaps:
        return _replace(s, swaps=s.swaps + (e["worker"],))
    return s


def _straggler_kept(s: RunState, e) -> RunState:
    return _replace(s, swaps=tuple(w for w in s.swaps if w != e["worker"]))


def _stage(s: RunState, e) -> int | None:
    """The pipeline stage a backup reported by ``e`` is of: the event's, else its worker's (None: unpipelined)."""
    stage = e.get("stage")
    return stage if stage is not None else s.stages.get(e["worker"])


def _checkpoint_saved(s: RunState, e) -> RunState:
    return _replace(s, backups=s.backups | {Backup("checkpoint", e["step"], _stage(s, e))})


def _evaluated(s: RunState, e) -> RunState:
    return _replace(s, evaluated=s.evaluated | {e["step"]})


def _snapshot_saved(s: RunState, e) -> RunState:
    return _kept(s, Backup("snapshot", e["step"], _stage(s, e), e.get("host") or e["worker"]))


def _snapshot_copied(s: RunState, e) -> RunState:
    """A copy to a peer (``host``: "" when the client that ordered it is gone and its peer unknown)."""
    return _kept(s, Backup("snapshot", e["step"], _stage(s, e), e.get("host") or e.get("peer") or ""))


def _kept(s: RunState, new: Backup) -> RunState:
    """``s`` with snapshot ``new``, each host's stage directory keeping its newest KEPT."""
    here = {b for b in s.backups if b.tier == "snapshot" and (b.host, b.stage) == (new.host, new.stage)} | {new}
    drop = set(sorted(here, key=lambda b: b.step)[:-KEPT])
    return _replace(s, backups=(s.backups | {new}) - drop)


def _shadow_synced(s: RunState, e) -> RunState:
    return _replace(s, shadows=s.shadows | {e["dest"]})


def _shadows_started(s: RunState, e) -> RunState:
    return _replace(s, shadows=s.shadows | frozenset(e["workers"]))


def _shadow_dropped(s: RunState, e) -> RunState:
    return _replace(s, shadows=s.shadows - {e["worker"]})


def _newest(held: tuple[int, ...], versions, keep: int) -> tuple[int, ...]:
    """``held`` with ``versions`` added, the newest ``keep`` (as a worker's outbox keeps them)."""
    return tuple(sorted({*held, *versions})[-keep:])


def _weights_published(s: RunState, e) -> RunState:
    """Trainers kept their current weights as a version: each one's answer names every version it holds now
    (``held``; an older log: the version alone, added to what it held)."""
    held = e.get("held")
    if held is None:
        held = {w: _newest(s.weights.get(w, ()), (e["version"],), TRAINER_WEIGHTS_KEPT) for w in e["workers"]}
    return _replace(s, weights={**s.weights, **{w: tuple(sorted(v)) for w, v in held.items() if w not in s.dead}})


def _weights_synced(s: RunState, e) -> RunState:
    """A sampler installed a version: its rollouts use it, and it holds it for its peers."""
    w, v = e["worker"], e["version"]
    if w in s.dead:
        return s
    return _replace(s, weights={**s.weights, w: _newest(s.weights.get(w, ()), (v,), SAMPLER_WEIGHTS_KEPT)},
                    installed={**s.installed, w: v})


def _rl_step(s: RunState, e) -> RunState:
    """An RL step committed: the trainers that applied it hold the version after it."""
    trainers = [w for w in e.get("trainers", ()) if w not in s.dead]
    if not trainers:
        return s
    v = e["step"] + 1
    return _replace(s, weights={**s.weights, **{w: _newest(s.weights.get(w, ()), (v,), TRAINER_WEIGHTS_KEPT)
                                                 for w in trainers}})


_FOLDS = {
    "run_started": _run_started,
    "client_attached": _client_attached,
    "worker_registered": _registered,
    "worker_launched": _launched,
    "worker_relaunched": _launched,
    "sampler_relaunched": _sampler_relaunched,
    "samplers_started": _loaded("workers"),
    "samplers_attached": _samplers_attached,
    "sampler_joined": _loaded("worker"),
    "placement": _first_placement,
    "placement_changed": _placement_changed,
    "state_initialized": _state_initialized,
    "run_resumed": _run_resumed,
    "run_truncated": _truncated,
    "step_dispatched": _dispatched,
    "step_committed": _committed,
    "worker_dead": _worker_dead,
    "worker_fenced": _fenced,
    "lease_granted": _lease_granted,
    "lease_returned": _lease_returned,
    "pool_waiting": _pool_waiting,
    "failure_detected": _failure,
    "recovery_decision": _decision,
    "relaunch_deferred": _deferred,
    "recovered": _recovered,
    "grown": _remapped,
    "straggler_replaced": _let_go,
    "released": _let_go,
    "straggler": _straggler,
    "straggler_kept": _straggler_kept,
    "checkpoint_saved": _checkpoint_saved,
    "eval_completed": _evaluated,
    "eval_skipped": _evaluated,
    "snapshot_saved": _snapshot_saved,
    "snapshot_copied": _snapshot_copied,
    "shadow_synced": _shadow_synced,
    "shadow_behind": _shadow_dropped,
    "shadows_started": _shadows_started,
    "weights_published": _weights_published,
    "weights_synced": _weights_synced,
    "rl_step": _rl_step,
}


# -- a pipelined run's stages ----------------------------------------------------------------

def _programs_loaded(s: RunState, e) -> RunState:
    s = _loaded("compile_seconds")(s, e)
    return _replace(s, stages={**s.stages, **e["stages"]}) if e.get("stages") else s


def _warmed(s: RunState, e) -> RunState:
    """A newcomer loaded its programs (a pipelined run's spare: stage 0's)."""
    s = _loaded("worker")(s, e)
    return _replace(s, stages={**s.stages, e["worker"]: e["stage"]}) if "stage" in e else s


def _stage_loaded(s: RunState, e) -> RunState:
    return _replace(s, stages={**s.stages, e["worker"]: e["stage"]})


def _stage_shadowed(s: RunState, e) -> RunState:
    """A spare shadows one stage of a pipelined run: its programs are that stage's."""
    s = _shadow_synced(s, e)
    return _replace(s, stages={**s.stages, e["dest"]: e["stage"]}) if "stage" in e else s


_FOLDS.update({
    "programs_loaded": _programs_loaded,
    "stage_loaded": _stage_loaded,
    "worker_warmed": _warmed,
    "shadow_synced": _stage_shadowed,
})


class RunLedger:
    """The run's one current :class:`RunState`, shared by every reader of one client (the controller, the worker
    group, the health monitor): it folds every event its :class:`~runtime.core.events.EventLog` writes, under the
    log's lock, so a fact is the state's as soon as its event is written, for every thread at once. Nothing else
    keeps a copy of a fact the state holds (who is dead, which spares shadow, which backups are held).

    ``state``: the state to start from (a restarted client's: replayed from the log). ``last_event_t``: the time
    of the newest event folded (a client that takes its run back measures its silence from it).
    """

    def __init__(self, events, state: RunState | None = None):
        self.state = state if state is not None else RunState()
        self.last_event_t = time.time()
        self._events = events
        events.subscribe(self._fold)

    def _fold(self, event: Mapping[str, Any]) -> None:
        self.state = self.state.apply(event)   # one reference swap: readers on any thread see whole states
        self.last_event_t = event.get("t", self.last_event_t)

    def close(self) -> None:
        """Stops folding (the client is done with the run)."""
        self._events.unsubscribe(self._fold)


@dataclasses.dataclass(frozen=True)
class Transition:
    """One event of a log with the run state just before and just after it, and the attempt it belongs to
    (:func:`attempts`: 0 for the first)."""

    event: Mapping[str, Any]
    before: RunState
    after: RunState
    attempt: int


def transitions(events: Iterable[Mapping[str, Any]]) -> Iterator[Transition]:
    """The run's log as its run state's transitions, one per event, in order: what every reader of a log
    (the report, the judge, ``elastic status``, the resume logic) folds from, so a fact has one reading."""
    state, attempt = RunState(), -1
    for e in events:
        if _opens_attempt(attempt < 0, e):
            attempt += 1
        after = state.apply(e)
        yield Transition(e, state, after, attempt)
        state = after


def attempts(events: Iterable[Mapping[str, Any]]) -> list[list[Mapping[str, Any]]]:
    """A run's log cut into its attempts (each ``elastic run`` of the run directory): each starts at its
    ``job_started`` (the first at the log's first event). The one rule of where an attempt starts."""
    out: list[list] = []
    for e in events:
        if _opens_attempt(not out, e):
            out.append([])
        out[-1].append(e)
    return out


def _opens_attempt(first: bool, e: Mapping[str, Any]) -> bool:
    return first or e.get("kind") == "job_started"


def replay_file(path) -> RunState:
    """The run state a run's ``events.jsonl`` leaves (read with :func:`runtime.core.events.read_events`)."""
    return RunState.replay(read_events(path))
