"""The controller's side of an RL run's samplers: who makes which rollouts with which weights version, and when.

An RL run's trainers are the training grid as any run's (placement, tiers,
recoveries: nothing changes for them). Its samplers are worker processes of
their own (members of role ``sampler``, ids ``s<n>``),
never placed in the grid, each holding one weights version and the
``rollout`` program (:mod:`runtime.worker.sampler`). This module orders their
work into the run's one schedule:

- **Which weights.** Step ``s`` trains on rollouts made with weights version
  ``max(s - k, 0)`` (:func:`weights_version`), ``k`` = ``rl_off_policy_steps``:
  0 is strictly on-policy (a step's rollouts wait for the previous step's
  commit), 1 lets the samplers make step ``s + 1``'s rollouts while the
  trainers train step ``s`` (overlap). Version ``v`` is the policy after ``v``
  steps: every trainer publishes it when it applies step ``v - 1`` (the step
  request's ``publish_leaves``), and the version the run stands at is
  published by a ``PublishWeights`` at the start and whenever the trainers
  change (a recovery).
- **Who makes what.** The missing microbatches of the steps a version allows
  are split among the samplers holding that version, in contiguous runs; a
  free sampler holding an older version first syncs the newer one, pulled
  whole from a trainer (or a peer sampler) over the data plane
  (:func:`runtime.worker.weights.pull_weights`; a source lost midway is passed
  over for the next).
- **Nothing recomputed.** A microbatch's rollout is a pure function of the run's
  seed, its step, its index and the weights version, so it is the same bits
  on any sampler. The client keeps each step's rollouts until the step commits
  (a recovery re-sends them with the step); a sampler lost drops only the
  microbatches it had not answered, which go to the others, and a fresh
  process is launched in its place.
- **Who holds which version** is the run state's
  (:attr:`runtime.control.run_state.RunState.weights` and ``installed``, a
  fold of this module's events), never a copy here: a restarted client reads
  it from the log, and the trainers' answers to the ``PublishWeights`` after
  every change of the trainers (a recovery, a re-attach) bring it up to date
  with what their outboxes hold.

Events: ``weights_published`` (each trainer's versions held), ``weights_synced``,
``rollouts_made`` (a step's rollouts complete) and ``rl_step`` (at the step's
commit: its weights version, the trainers that applied it, mean reward,
rollout seconds), from this module alone.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping

import grpc
import numpy as np

from runtime._proto import elastic_pb2 as pb
from runtime.control.calls import wait_any
from runtime.control.run_state import SAMPLER
from runtime.core.errors import CapacityExhaustedError, StateLostError
from runtime.core.fingerprint import programs_fingerprint
from runtime.core.programs import SamplerPrograms
from runtime.wire.batches import decode_batch

__all__ = ["Feed", "Sampling", "split", "weights_version"]


#: A live sampler whose calls fail this many times in a row (it answers, but cannot sync or sample) is replaced.
FAILURES_IN_A_ROW = 3


def weights_version(step: int, off_policy_steps: int) -> int:
    """The weights version step ``step``'s rollouts are made with."""
    return max(step - off_policy_steps, 0)


def split(items: list[int], parts: int) -> list[list[int]]:
    """``items`` cut into ``parts`` contiguous runs as even as possible (the first ones longer); no empty run."""
    parts = max(min(parts, len(items)), 1)
    size, extra = divmod(len(items), parts)
    out, at = [], 0
    for i in range(parts):
        n = size + (1 if i < extra else 0)
        out.append(items[at:at + n])
        at += n
    return [p for p in out if p]


@dataclasses.dataclass(frozen=True)
class Feed:
    """What an RL trainer's step request carries: each microbatch's batch, and which leaves to publish after it."""

    batches: Mapping[int, pb.FedBatch]
    publish_leaves: tuple[int, ...]
    publish_dtype: str


@dataclasses.dataclass
class _Call:
    kind: str              # "sync" or "rollout" or "load"
    future: grpc.Future
    started: float
    version: int = -1
    step: int = -1
    microbatches: tuple[int, ...] = ()


class Sampling:
    """The samplers of one RL run, driven by the controller's loop (:meth:`pump`, :meth:`ready`, :meth:`feed`,
    :meth:`committed`, :meth:`lost`). Not thread-safe: the controller's thread calls it. ``ledger``: the run's
    :class:`~runtime.control.run_state.RunLedger` (its ``state`` says who holds which weights version)."""

    def __init__(self, group, opts, events, programs: SamplerPrograms, ledger):
        self.group, self.opts, self.events, self.programs, self.ledger = group, opts, events, programs, ledger
        self.count = opts.rl_samplers
        self.off = opts.rl_off_policy_steps
        self.num_microbatches = int(programs.layout["num_microbatches"])
        self.seed = 0
        self.calls: dict[str, _Call] = {}            # sampler -> its one call in flight
        self.made: dict[int, dict[int, pb.FedBatch]] = {}   # step -> microbatch -> its rollout
        self.resync: set[str] = set()                # samplers whose rollout failed: they sync before the next
        self.step_seconds: dict[int, float] = {}     # step -> seconds from its first rollout call to its last answer
        self._first_call: dict[int, float] = {}
        self._retry_at: dict[str, float] = {}
        self.failed: dict[str, int] = {}             # sampler -> its calls failed in a row (it answered each)
        self.last_error = ""                         # the last of them, for the run's error if none is left

    @property
    def live(self) -> list[str]:
        """The samplers that loaded their program and are not declared dead, in launch order (the run state's)."""
        s = self.ledger.state
        return [w for w in s.of_role(SAMPLER) if s.members[w].loaded]

    @property
    def launching(self) -> list[str]:
        """The samplers launched and not loaded yet, none of their loads in flight (the run state's)."""
        s = self.ledger.state
        return [w for w in s.of_role(SAMPLER) if not s.members[w].loaded and w not in self.calls]

    # -- start --------------------------------------------------------------------

    def start(self, trainers, seed: int) -> None:
        """Launches and loads the samplers, and has ``trainers`` publish the version the run stands at."""
        self.seed = seed
        ids = [self.group.launch(role=SAMPLER) for _ in range(self.count)]
        live = [w for w in self.group.wait_for_samplers(ids, self.opts.register_timeout_seconds)
                if self.group.load_sampler(w, self.programs) is not None]
        if not live:
            raise CapacityExhaustedError(f"none of the {self.count} samplers registered and loaded its program")
        self.events.emit("samplers_started", workers=live)
        self.publish(trainers)

    def reattach(self, known: dict, seed: int) -> None:
        """A restarted client takes the samplers of ``known`` (``{worker: WorkerInfo}`` from the log) over; the
        ones that answer keep serving with the versions the run state says they hold, fresh ones are launched
        for the rest. (The trainers answer what they hold when the first turn of the loop sees them:
        :meth:`trainers_changed`.)"""
        self.seed = seed
        self.calls, self.made, self.resync = {}, {}, set()
        live = self.group.attach_samplers(known, programs_fingerprint(self.programs.programs())) if known else []
        launched = [self.group.launch(role=SAMPLER) for _ in range(self.count - len(live))]
        self.events.emit("samplers_attached", workers=live, launched=launched)

    def publish(self, trainers) -> None:
        """``trainers`` keep their current weights as the version they stand at (the run's start, a recovery, a
        re-attach), and answer every version they hold (``weights_published``'s ``held``: the run state's)."""
        replies = self.group.publish_weights(list(trainers), list(self.programs.weight_leaves),
                                             self.programs.weights_dtype)
        if replies:
            r = next(iter(replies.values()))
            self.events.emit("weights_published", version=r.version, workers=sorted(replies), bytes=r.bytes,
                             held={w: sorted({x.version, *x.held}) for w, x in sorted(replies.items())})

    def _installed(self, worker: str) -> int | None:
        """The version ``worker`` (a sampler) has installed, as the run state knows it (None: none, or it must
        sync again)."""
        return None if worker in self.resync else self.ledger.state.installed.get(worker)

    # -- the schedule ---------------------------------------------------------------

    def ready(self, step: int) -> bool:
        """Every microbatch of ``step`` has its rollout."""
        return len(self.made.get(step, ())) == self.num_microbatches

    def feed(self, step: int) -> Feed:
        """What the trainers' request of ``step`` carries (call once :meth:`ready`)."""
        return Feed(self.made[step], tuple(self.programs.weight_leaves), self.programs.weights_dtype)

    def pump(self, committed: int, steps: int, dead: Mapping[str, str]) -> None:
        """Takes in what ended, then starts what can start now: rollouts of the steps whose weights version
        exists (steps ``committed .. committed + k``), syncs of samplers to the version those need, loads of
        relaunched samplers. Never waits."""
        now = time.monotonic()
        self._take_in(dead)
        self._adopt_launched()
        last = min(steps, committed + self.off + 1)
        for step in range(committed, last):
            version = weights_version(step, self.off)
            missing = [m for m in range(self.num_microbatches) if m not in self.made.get(step, {})
                       and not any(c.kind == "rollout" and c.step == step and m in c.microbatches
                                   for c in self.calls.values())]
            if not missing:
                continue
            free = [w for w in self.live if w not in self.calls and w not in dead and self._retry_at.get(w, 0) <= now]
            ready = [w for w in free if self._installed(w) == version]
            if ready:
                for w, mbs in zip(ready, split(missing, len(ready))):
                    self.calls[w] = _Call("rollout", self.group.start_rollout(w, step, mbs, version, self.seed),
                                          now, version, step, tuple(mbs))
                    self._first_call.setdefault(step, now)
            for w in [w for w in free if w not in self.calls and self._installed(w) != version]:
                sources = self._sources(version, w, dead)
                if sources:   # (the earliest step's version first: a sampler moves back to it if it must)
                    self.calls[w] = _Call("sync", self.group.start_sync(w, version, sources), now, version)
            if step == committed and version < committed and not self._sources(version, "", dead) and not any(
                    c.version == version for c in self.calls.values()) and \
                    not any(self._installed(w) == version for w in self.live if w not in dead):
                raise StateLostError(
                    f"step {step}'s rollouts need weights version {version}, and every trainer and sampler that "
                    f"held it was lost (rl_off_policy_steps={self.off}: the run stands at version {committed}); its "
                    "rollouts cannot be made again bit for bit")

    def _sources(self, version: int, worker: str, dead) -> list[str]:
        """Who can send ``version``: the active trainers that hold it (rotated per sampler, so syncs spread), then
        the samplers holding it (the run state's ``weights``)."""
        s = self.ledger.state
        active = s.placement.active if s.placement is not None else ()
        trainers = sorted(w for w in active if version in s.weights.get(w, ()) and w not in dead)
        if trainers:
            k = self.live.index(worker) % len(trainers) if worker in self.live else 0
            trainers = trainers[k:] + trainers[:k]
        peers = [w for w in self.live if w != worker and version in s.weights.get(w, ()) and w not in dead]
        return trainers + peers

    def _take_in(self, dead) -> None:
        """The calls that ended: installed versions, rollouts made, samplers loaded."""
        for w, call in list(self.calls.items()):
            if not call.future.done():
                continue
            del self.calls[w]
            self.group.settle(w, call.future)
            try:
                reply = call.future.result()
            except (grpc.RpcError, grpc.FutureCancelledError) as e:
                if w not in dead:   # alive: try again a little later (a dead one is dropped by lost())
                    self._retry_at[w] = time.monotonic() + 0.2
                    self.failed[w] = self.failed.get(w, 0) + 1
                    self.last_error = f"{call.kind} on {w}: {_why(e)}"[:300]
                    if call.kind == "load":
                        self.group.declare_dead(w, f"failed to load the sampler's program: {_why(e)}",
                                                cause="load_failed")
                    elif self.failed[w] >= FAILURES_IN_A_ROW:   # it answers, but cannot do its work: replaced
                        self.group.declare_dead(w, f"{self.failed[w]} calls in a row failed, the last: "
                                                   f"{self.last_error}", cause="failed")
                    elif call.kind == "rollout":
                        self.resync.add(w)   # sync again before its next rollout
                continue
            self.failed.pop(w, None)
            if call.kind == "load":
                self.events.emit("sampler_joined", worker=w)   # (live from now on: the run state's)
            elif call.kind == "sync":
                self.resync.discard(w)
                self.events.emit("weights_synced", worker=w, version=reply.version, bytes=reply.bytes,
                                 seconds=reply.seconds, source=reply.source, failed=list(reply.failed))
            else:
                got = self.made.setdefault(call.step, {})
                for b in reply.batches:
                    got[b.microbatch] = b
                if self.ready(call.step):
                    self.step_seconds[call.step] = time.monotonic() - self._first_call.pop(call.step, call.started)
                    self.events.emit("rollouts_made", step=call.step, version=call.version,
                                     seconds=self.step_seconds[call.step])

    def _adopt_launched(self) -> None:
        """Relaunched samplers that registered start loading their program."""
        launching = self.launching
        if not launching:
            return
        for w in self.group.wait_for_samplers(launching, 0.0):
            self.calls[w] = _Call("load", self.group.start_sampler_load(w, self.programs), time.monotonic())

    def wait(self, timeout: float, also=()) -> None:
        """Blocks up to ``timeout`` until some call ends, or one of the futures ``also`` (a trainers' step); with
        nothing in flight and nothing in ``also``, returns at once."""
        wait_any([*(c.future for c in self.calls.values()), *also], timeout)

    def starved(self, dead) -> bool:
        """No sampler is left, and none is on its way: the run cannot make rollouts."""
        return not [w for w in self.live if w not in dead] and not self.launching and \
            not any(c.kind == "load" for c in self.calls.values())

    # -- commits and losses -----------------------------------------------------------

    def committed(self, step: int, workers) -> None:
        """Step ``step`` committed on ``workers``: its ``rl_step`` is recorded (they hold version ``step + 1``),
        and its rollouts are let go."""
        batches = self.made.pop(step, {})
        self._first_call.pop(step, None)   # (a step whose rollouts were not all made here)
        rewards = [decode_batch(b)["rewards"] for _, b in sorted(batches.items()) if
                   any(a.name == "rewards" for a in b.arrays)]
        versions = sorted({b.version for b in batches.values()})
        # A step a restarted client commits from its workers' reports had its rollouts made for the client before:
        # its version is the rule's, its reward is not known here.
        reward = {"mean_reward": float(np.mean(np.concatenate(rewards)))} if rewards else {}
        self.events.emit("rl_step", step=step, version=versions[0] if versions else weights_version(step, self.off),
                         trainers=sorted(workers), rollout_seconds=self.step_seconds.pop(step, 0.0),
                         rollout_bytes=sum(b.ByteSize() for b in batches.values()), **reward)

    def forget(self, worker: str) -> None:
        """Sampler ``worker`` was lost: its call in flight is dropped, so its unanswered microbatches go to the
        others at the next :meth:`pump` (what else follows is the planner's:
        :func:`runtime.control.plan.plan_sampler_loss`)."""
        self.calls.pop(worker, None)
        self.resync.discard(worker)
        self.failed.pop(worker, None)
        self._retry_at.pop(worker, None)

    def trainers_changed(self, trainers) -> None:
        """The trainers changed (a recovery, a restarted client's first turn): the ones now active publish the
        version the run stands at and answer every version they hold, which the run state takes as theirs (a trainer that applied steps its client never recorded holds versions the log does not
        name; a spare promoted holds none)."""
        self.publish(trainers)


def _why(e) -> str:
    """A failed call in one line: its status and details (a bare error: its type)."""
    if callable(getattr(e, "code", None)) and callable(getattr(e, "details", None)):
        return f"{e.code().name}: {e.details()}"
    return type(e).__name__
