"""The schema of ``events.jsonl``: every event kind, its fields and their types, declared once.

Who uses it: :meth:`runtime.core.events.EventLog.emit` checks every event against
:data:`EVENT_KINDS` before writing it (an unknown kind, a missing required
field, a field not declared, a field of the wrong type is a ``ValueError``: a
programming error, which the tests catch, never a reason to write a malformed
line); the report's fold (``elastic/report/fold.py``) checks what it reads
against the same table, tolerating what old logs lack (unknown kinds, missing
fields it does not read, fields not declared here).

Types are judged on the event as it is written (after JSON encoding: a tuple
is a list, a NumPy scalar a number), so the writer and every reader of the log
agree. Each event also has ``t`` (wall seconds, a finite number) and ``kind``.

Imports nothing of the project (``elastic``, ``chaos`` and ``integrations``
declare their kinds here too: the log has one schema).
"""

from __future__ import annotations

import math
import reprlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, NamedTuple

__all__ = ["COMMON_FIELDS", "EVENT_KINDS", "LEGACY_KINDS", "EventKind", "FieldType", "check_event"]


class FieldType(NamedTuple):
    """What an event field must hold: ``what`` names it in errors, ``ok`` tests a (JSON-decoded) value."""

    what: str
    ok: Callable[[Any], bool]


def _is_number(v: Any) -> bool:
    """A number (not a bool) a float can hold: inf and nan are, an int beyond the float range is not."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        float(v)
    except OverflowError:
        return False
    return True


def _is_finite(v: Any) -> bool:
    return _is_number(v) and math.isfinite(v)


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and _is_number(v) and v >= 0


def _or_null(t: FieldType) -> FieldType:
    return FieldType(f"{t.what} or null", lambda v: v is None or t.ok(v))


ANY = FieldType("anything", lambda v: True)
TEXT = FieldType("a string", lambda v: isinstance(v, str))
TEXT_OR_NULL = _or_null(TEXT)
BOOL = FieldType("true or false", lambda v: isinstance(v, bool))
BOOL_OR_NULL = _or_null(BOOL)
NUMBER = FieldType("a number", _is_number)
NUMBER_OR_NULL = _or_null(NUMBER)
FINITE = FieldType("a finite number", _is_finite)
FINITE_OR_NULL = _or_null(FINITE)
COUNT = FieldType("a whole number >= 0", _is_count)
COUNT_OR_NULL = _or_null(COUNT)
LIST = FieldType("a list", lambda v: isinstance(v, list))
NAMES = FieldType("a list of strings", lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v))
OBJECT = FieldType("an object", lambda v: isinstance(v, dict))
OBJECT_OR_NULL = _or_null(OBJECT)
NUMBERS_BY_NAME = FieldType("an object of numbers",
                            lambda v: isinstance(v, dict) and all(_is_number(x) for x in v.values()))
NUMBERS_BY_NAME_BY_NAME = FieldType("an object of objects of numbers",
                                    lambda v: isinstance(v, dict) and all(NUMBERS_BY_NAME.ok(x) for x in v.values()))
COUNTS_BY_NAME = FieldType("an object of lists of whole numbers >= 0",
                           lambda v: isinstance(v, dict) and all(isinstance(x, list) and all(map(_is_count, x))
                                                                 for x in v.values()))

#: Fields of every event: when (unix seconds) and what.
COMMON_FIELDS: Mapping[str, FieldType] = MappingProxyType({"t": FINITE, "kind": TEXT})


@dataclass(frozen=True)
class EventKind:
    """One kind of event: what it records, the fields every one has (``required``) and may have (``optional``)."""

    name: str
    doc: str
    required: Mapping[str, FieldType] = field(default_factory=dict)
    optional: Mapping[str, FieldType] = field(default_factory=dict)

    def fields(self) -> dict[str, FieldType]:
        return {**self.required, **self.optional}


def _kinds(*kinds: EventKind) -> Mapping[str, EventKind]:
    table = {k.name: k for k in kinds}
    assert len(table) == len(kinds), "an event kind is declared twice"
    return MappingProxyType(table)


_W = {"worker": TEXT}
_COPY = {"source": TEXT, "dest": TEXT, "step": COUNT, "bytes": COUNT, "seconds": FINITE, "digest": TEXT}
# Logs from before the digest named its algorithm have sha256 instead of digest; transport (shared_memory, tcp,
# grpc: how the copy travelled) is in logs since same-host copies.
_COPY_OPTIONAL = {"sha256": TEXT, "transport": TEXT}
_REMAP = {"epoch": COUNT, "promoted": NAMES, "active": NAMES, "spares": NAMES, "bytes_moved": COUNT, "step": COUNT}
_FAULT = {"index": COUNT, "fault": TEXT, "fault_kind": TEXT, "step": COUNT}

#: Every kind of event a run's log may hold, by name.
EVENT_KINDS: Mapping[str, EventKind] = _kinds(
    # -- the job (elastic.trainer: the distributed and the reference path alike) --------------------------
    EventKind("job_started", "an attempt of the run starts (recorded once it may start)",
              {"mode": TEXT, "config": OBJECT_OR_NULL, "global_batch_size": COUNT, "microbatches": COUNT}),
    EventKind("programs_built", "the step programs were traced and exported",
              {"seconds": FINITE, "program_bytes": NUMBERS_BY_NAME, "state_bytes": COUNT, "grad_size": COUNT},
              {"fingerprints": OBJECT}),
    EventKind("run_failed", "the attempt ended with an error", {"error": TEXT}),
    EventKind("attach_refused", "a restarted client was refused by its run's live workers (other programs): the "
              "attempt ends, nothing changed on them", {"error": TEXT}),
    EventKind("run_stopped", "the attempt was stopped on purpose (Ctrl-C: SIGINT; the command's SIGTERM): its workers "
              "were sent home", {"signal": TEXT}),
    # -- the controller's run ------------------------------------------------------------------------
    EventKind("run_started", "the controller (or the reference path) starts its run",
              {"run_id": TEXT, "slices": COUNT, "devices_per_slice": COUNT, "microbatches": COUNT, "steps": COUNT},
              {"spares": COUNT, "stages": COUNT, "controller": TEXT_OR_NULL, "controller_host": TEXT_OR_NULL,
               "generation": COUNT}),
    EventKind("client_attached", "a restarted client took over the run's live workers (a new client generation)",
              {"run_id": TEXT, "generation": COUNT, "steps": COUNT, "workers": OBJECT, "lost": NAMES,
               "committed": COUNT, "downtime_seconds": FINITE},
              {"controller": TEXT_OR_NULL, "previous_pid": COUNT_OR_NULL}),
    EventKind("placement", "the first placement of virtual slices on workers",
              {"epoch": COUNT, "active": NAMES, "spares": NAMES, "seconds": FINITE}),
    EventKind("programs_loaded", "every member loaded (compiled) the programs (a pipelined run: each its stage's)",
              {"compile_seconds": NUMBERS_BY_NAME, "program_bytes": ANY}, {"stages": NUMBERS_BY_NAME}),
    EventKind("state_initialized", "the train state was initialized from the seed (its parameters then replaced "
              "by those of parameters_from: load_parameters_path)",
              {"seed": ANY, "state_bytes": COUNT}, {"parameters_from": TEXT}),
    EventKind("run_resumed", "the run resumed from a checkpoint of an earlier attempt",
              {"step": COUNT, "directory": TEXT, "tier": TEXT, "bytes": COUNT, "state_bytes": COUNT,
               "resharded_from": OBJECT_OR_NULL, "losses": LIST, "losses_recorded": BOOL},
              {"loss_sums": LIST}),
    EventKind("run_truncated", "the run's deadline cut its step count", {"steps": COUNT, "reason": TEXT}),
    EventKind("step_dispatched", "a step was sent to the active slices",
              {"step": COUNT, "epoch": COUNT, "workers": NAMES}),
    EventKind("step_committed", "a step's loss was committed (the one place: Controller._record)",
              {"step": COUNT, "epoch": COUNT, "loss": NUMBER},
              {"loss_sum": NUMBER, "seconds": NUMBER, "recovered": BOOL, "microbatches": OBJECT, "grad_seconds": NUMBER,
               "reduce_seconds": NUMBER, "apply_seconds": NUMBER, "bytes_sent": COUNT, "phases": NUMBERS_BY_NAME,
               # a pipelined run's: stage ("0", "1", ...) -> its slowest replica's phases; the measured bubble
               "stage_phases": NUMBERS_BY_NAME_BY_NAME, "bubble": FINITE}),
    EventKind("eval_completed", "the held-out loss after a step, recorded when that step committed (eval_interval)",
              {"step": COUNT, "loss": NUMBER, "batches": COUNT, "seconds": NUMBER},
              # the sums behind loss (loss = total_loss / total_weights); before_step: computed on that step's
              # request, before its gradient (owed: a recovery lost the step's replies)
              {"total_loss": NUMBER, "total_weights": NUMBER, "before_step": COUNT}),
    EventKind("eval_skipped", "an eval due after a step could not be computed on that step's state",
              {"step": COUNT, "reason": TEXT}),
    # An RL run's samplers (runtime.control.sampling)
    EventKind("samplers_started", "an RL run's samplers registered and loaded their rollout program",
              {"workers": NAMES}),
    EventKind("samplers_attached", "a restarted client took over the samplers that answered, and launched the rest",
              {"workers": NAMES, "launched": NAMES}),
    EventKind("sampler_joined", "a sampler launched in a lost one's place loaded its program", {"worker": TEXT}),
    EventKind("sampler_lost", "the planner's decision for a lost sampler (runtime.control.plan.plan_sampler_loss): "
              "its rollouts to the others and a fresh one in its place (reassign), or the end (fail)",
              {"worker": TEXT, "action": TEXT, "reason": TEXT, "relaunched": BOOL}),
    EventKind("sampler_relaunched", "a fresh sampler process was launched in a lost one's place (older logs: "
              "``worker_relaunched`` with ``role`` sampler now)",
              {"replaces": TEXT, "worker": TEXT}),
    EventKind("weights_published", "trainers kept their current policy weights as a version for the samplers",
              {"version": COUNT, "workers": NAMES, "bytes": COUNT},
              {"held": COUNTS_BY_NAME}),   # each trainer's answer: every version it holds now (older logs: none)
    EventKind("weights_synced", "a sampler installed a weights version, pulled whole from a trainer or a peer",
              {"worker": TEXT, "version": COUNT, "bytes": COUNT, "seconds": NUMBER, "source": TEXT},
              {"failed": NAMES}),   # the sources tried first (lost midway, or without that version), and why
    EventKind("rollouts_made", "every rollout microbatch of a step was made",
              {"step": COUNT, "version": COUNT, "seconds": NUMBER}),
    EventKind("rl_step", "an RL step committed: the weights version its rollouts were made with, their reward",
              {"step": COUNT, "version": COUNT, "rollout_seconds": NUMBER, "rollout_bytes": COUNT},
              # mean_reward: absent for a step a restarted client committed from its workers' reports (an earlier
              # client held its rollouts); trainers: those that applied the step, which hold the version after it
              {"mean_reward": NUMBER, "trainers": NAMES}),
    # -- the shared pool: a pool's own log (runtime.pool.ledger folds it) --------------------------------------
    EventKind("pool_started", "a pool serves (again, after a restart: restarted), with the hosts and leases its log had",
              {"address": TEXT, "hosts": COUNT, "leases": COUNT, "restarted": BOOL}),
    EventKind("pool_stopped", "the pool was stopped", {"reason": TEXT}),
    EventKind("pool_host_joined", "a host (an agent) joined the pool, or joined again",
              {"host": TEXT, "devices": COUNT, "platform": TEXT}, {"address": TEXT, "pid": COUNT}),
    EventKind("pool_host_lost", "a host was removed from the pool", {"host": TEXT, "reason": TEXT}),
    EventKind("pool_run_joined", "a run's client asked the pool for hosts (again, when its terms changed)",
              {"run": TEXT, "tenant": TEXT, "priority": NUMBER, "min_hosts": COUNT, "devices": COUNT},
              {"platform": TEXT, "name": TEXT, "grace": NUMBER}),
    EventKind("pool_run_queued", "a run waits for its minimum of hosts", {"run": TEXT, "hosts": COUNT, "free": COUNT}),
    EventKind("pool_run_ended", "a run left the pool: it finished, or its client was silent past its grace",
              {"run": TEXT, "reason": TEXT}),
    EventKind("pool_lease_granted", "a host was leased to a run, to serve as one of its workers",
              {"lease": TEXT, "run": TEXT, "worker": TEXT, "host": TEXT}),
    EventKind("pool_lease_serving", "the host started the lease's worker", {"lease": TEXT}),
    EventKind("pool_lease_reclaimed", "a lease is being taken back: its worker is stopped and its host wiped",
              {"lease": TEXT, "why": TEXT}),
    EventKind("pool_lease_ended", "a lease's worker is gone and its host wiped (wiped false: the host left the pool)",
              {"lease": TEXT, "host": TEXT, "exit_code": NUMBER, "wiped": BOOL}, {"leftovers": NAMES}),
    EventKind("pool_give_back", "a run of a lower priority was asked to give hosts back to one of a higher (a "
                                "negative count: no run of a higher priority waits any more; for_run empty)",
              {"run": TEXT, "count": NUMBER, "for_run": TEXT}),
    EventKind("pool_calls_refused", "calls to the pool refused for their credentials",
              {"method": TEXT, "peer": TEXT, "reason": TEXT, "count": COUNT}),
    # -- the shared pool: a run's own log (its lease timeline; runtime.pool.client) ----------------------------
    EventKind("pool_waiting", "the run waits in the pool's queue", {"status": TEXT}),
    EventKind("lease_granted", "the pool leased the run a host for one of its workers",
              {"worker": TEXT, "host": TEXT, "lease": TEXT}),
    EventKind("lease_returned", "the run gave a worker's host back to the pool",
              {"worker": TEXT, "why": TEXT}),
    EventKind("lease_preempted", "the pool asked the run for hosts back (a run of a higher priority needs them): "
                                 "the run shrinks at a step boundary", {"count": COUNT, "workers": NAMES}),
    EventKind("step_watchdog", "a step took far longer than the median: what the watchdog found",
              {"step": COUNT, "seconds": FINITE, "median_seconds": NUMBER_OR_NULL, "pending": NAMES,
               "suspects": NAMES, "progress": OBJECT}),
    EventKind("straggler", "a slow worker was seen", {
        "worker": TEXT, "step": COUNT, "seconds": NUMBER, "median_seconds": NUMBER, "action": TEXT},
        {"queued": BOOL,     # true: its slice moves onto a spare at the next step boundary
         "stacks": TEXT}),   # its stacks were kept in this file when it was flagged (runtime.core.stacks)
    EventKind("straggler_kept", "a straggler waiting for a swap stays where it is", {**_W, "reason": TEXT}),
    EventKind("run_finished", "the run committed its last step",
              {"steps_completed": COUNT, "final_state_digest": TEXT_OR_NULL, "replica_hashes": OBJECT,
               "wall_seconds": FINITE, "client_peak_rss_bytes": COUNT_OR_NULL},
              {"final_state_sha256": TEXT_OR_NULL}),   # older logs, instead of final_state_digest: sha256 hex
    # -- failures and recovery -----------------------------------------------------------------------
    EventKind("failure_detected", "a failure stopped the step loop",
              {"error": TEXT, "detail": TEXT, "worker": TEXT_OR_NULL, "committed": COUNT}),
    EventKind("recovery_decision", "what the policy decided to do about it",
              {"action": TEXT, "reason": TEXT, "dead": NAMES, "epoch": COUNT, "active": NAMES, "spares": NAMES}),
    EventKind("recovered", "the run is whole again and resumes",
              {"path": TEXT, "epoch": COUNT, "resume_step": COUNT, "dead": NAMES, "bytes_moved": COUNT,
               "seconds": FINITE}, {"restore_tier": TEXT}),
    EventKind("relaunch_deferred", "dead workers whose replacements start after the next commit",
              {"workers": NAMES}),
    EventKind("rolled_back", "a replica dropped its uncommitted steps", {**_W, "to_step": COUNT}),
    EventKind("checkpoint_restored", "no replica was left: a checkpoint came back",
              {"step": COUNT, "bytes": COUNT, "steps_lost": COUNT, "directory": TEXT}),
    EventKind("snapshot_restored", "no replica was left: a snapshot came back",
              {"step": COUNT, "bytes": COUNT, "steps_lost": COUNT, "worker": TEXT, "host": TEXT_OR_NULL}),
    EventKind("transfer_started", "a state copy between workers starts",
              {"source": TEXT, "dest": TEXT, "step": COUNT}),
    EventKind("stage_loaded", "a worker taking a pipeline stage's slice loaded that stage's programs first (a spare "
              "warms with stage 0's)", {**_W, "stage": COUNT, "compile_seconds": FINITE, "seconds": FINITE}),
    EventKind("state_transferred", "a state copy between workers ended (and its digest checked)", _COPY, _COPY_OPTIONAL),
    EventKind("placement_changed", "a step boundary changes the placement (spares warmed or dropped, a grow or a "
              "swap begins)", {"epoch": COUNT, "active": NAMES, "spares": NAMES, "why": TEXT}),
    EventKind("grown", "spares were promoted to bring the run back to its slice count", _REMAP),
    EventKind("straggler_replaced", "a straggler's slice moved to a spare", {**_REMAP, "slow": TEXT}),
    EventKind("released", "slices were given back to a shared pool at a step boundary (spares, then a shrink)",
              _REMAP, {"given": NAMES}),
    EventKind("capacity_wait", "too few workers: the run waits for more",
              {"needed": COUNT, "timeout_seconds": NUMBER_OR_NULL},
              {"seconds": FINITE_OR_NULL}),   # older logs: a wait reported when it ended
    EventKind("capacity_wait_ended", "the wait for capacity ended (found or timed out)",
              {"seconds": FINITE_OR_NULL, "found": NAMES}),
    # -- backups: snapshots, checkpoints, shadows ------------------------------------------------------
    EventKind("snapshot_saved", "a worker saved a snapshot (a pipelined run: of its stage)",
              {**_W, "host": TEXT_OR_NULL, "step": COUNT}, {"stage": COUNT}),
    EventKind("snapshot_copied", "a worker copied its snapshot to a peer (a pipelined run: of its stage)",
              {**_W, "peer": TEXT_OR_NULL, "host": TEXT_OR_NULL, "step": COUNT}, {"stage": COUNT}),
    EventKind("snapshot_failed", "a snapshot save failed", {**_W, "error": TEXT}),
    EventKind("snapshot_unusable", "a snapshot could not be restored", {**_W, "error": TEXT}),
    EventKind("checkpoint_saved", "a checkpoint was committed (a pipelined run: of its stage)",
              {**_W, "step": COUNT, "directory": TEXT}, {"stage": COUNT}),
    EventKind("checkpoint_failed", "a checkpoint save failed", {**_W, "error": TEXT}),
    EventKind("checkpoint_skipped", "a checkpoint could not be read and was passed over", {**_W, "detail": TEXT}),
    EventKind("checkpoint_unavailable", "the checkpoint directory cannot be used",
              {"directory": TEXT, "error": TEXT}),
    EventKind("checkpoint_leftovers_removed", "partial checkpoints of a dead writer were removed",
              {"directory": TEXT, "paths": NAMES}),
    EventKind("shadow_synced", "a spare got a copy of the committed state (a pipelined run: of one stage's)", _COPY,
              {**_COPY_OPTIONAL, "stage": COUNT}),
    EventKind("shadow_behind", "a shadowing spare fell behind", {**_W, "step": COUNT, "error": TEXT}),
    EventKind("shadows_started", "spares that start with the run's first state (from the seed or the same "
              "checkpoint) shadow it from then on", {"workers": LIST, "step": COUNT}),
    # -- workers -------------------------------------------------------------------------------------
    EventKind("workers_awaited", "the controller waits for workers started by hand",
              {"count": COUNT, "controller": TEXT, "run_id": TEXT, "command": TEXT}),
    EventKind("worker_registered", "a worker registered (a slice of several hosts: once all of them did; "
              "``hosts`` has each host's address, data_address, pid and host, in host order)",
              {**_W, "address": TEXT, "devices": COUNT, "platform": TEXT, "pid": COUNT, "host": TEXT_OR_NULL},
              {"data_address": TEXT, "hosts": LIST}),
    EventKind("register_refused", "a registration was refused", {**_W, "rejoin": BOOL, "reason": TEXT}),
    EventKind("device_probe", "a worker's devices were probed",
              {**_W, "ok": BOOL, "devices": COUNT, "seconds": FINITE}, {"error": TEXT}),
    EventKind("worker_warmed", "a newcomer compiled the programs (a pipelined run's: stage 0's)",
              {**_W, "compile_seconds": FINITE}, {"stage": COUNT}),
    EventKind("worker_suspect", "a worker went silent", {**_W, "silent_seconds": NUMBER}),
    EventKind("worker_fenced", "a member fenced itself (its client was silent past its lease) and waits: the client "
              "takes it back (a new generation)", {**_W, "reason": TEXT}),
    EventKind("worker_dead", "a worker was declared dead (a slice of several hosts: ``host`` is the one that "
              "failed, ``retired`` the others, stopped with their slice)",
              {**_W, "reason": TEXT, "cause": TEXT_OR_NULL},
              {"host": COUNT, "retired": LIST, "stacks": TEXT}),   # stacks: the file its stacks were kept in
    EventKind("worker_launched", "a worker process was launched (``role``: trainer or an RL run's sampler)",
              {**_W, "host": TEXT_OR_NULL, "role": TEXT}),
    EventKind("worker_relaunched", "a dead worker was replaced by a new one (``role``: trainer or sampler)",
              {"replaces": TEXT, **_W}, {"host": TEXT_OR_NULL, "role": TEXT}),
    EventKind("security_refused", "calls refused for want of credentials (a worker may batch them)",
              {**_W, "method": TEXT_OR_NULL, "peer": TEXT_OR_NULL, "count": COUNT, "reason": TEXT_OR_NULL}),
    # -- the log itself ------------------------------------------------------------------------------
    EventKind("events_dropped", "events the log could not write (written by EventLog.close)",
              {"count": COUNT, "error": TEXT}),
    # -- chaos (the fault injector and the harness) ----------------------------------------------------
    EventKind("chaos_started", "the fault injector attached to the run",
              {"spec": TEXT, "seed": ANY, "mtbf_seconds": NUMBER_OR_NULL, "duration_seconds": NUMBER_OR_NULL,
               "scenario": TEXT_OR_NULL}),
    EventKind("fault_injected", "a fault was injected (``hosts``: which host of each slice of several it hit)",
              {**_FAULT, "workers": NAMES, "errors": OBJECT, "seconds": FINITE}, {"hosts": OBJECT}),
    EventKind("fault_skipped", "a fault could not be injected", {**_FAULT, "reason": TEXT}),
    EventKind("verdict", "the chaos harness's verdict on the run (appended after it)",
              {"verdict": TEXT_OR_NULL, "verdict_reasons": LIST, "trajectory": TEXT_OR_NULL,
               "first_diverging_step": COUNT_OR_NULL, "exactly_once": BOOL_OR_NULL, "exactly_once_detail": OBJECT,
               "reference": OBJECT_OR_NULL}, {"promises": LIST, "run_state_replayed": BOOL_OR_NULL}),
)

#: Kinds declared for the readers of old logs and emitted nowhere today (the source-walking test checks
#: every other declared kind is emitted somewhere).
LEGACY_KINDS: frozenset[str] = frozenset({"sampler_relaunched"})


def check_event(event: Mapping[str, Any]) -> None:
    """Raises ``ValueError`` unless ``event`` (as written: JSON-decoded) is of a declared kind and has exactly
    its declared fields, each of its type. For the writer (``EventLog.emit``); readers of old logs are laxer."""
    for name, ftype in COMMON_FIELDS.items():
        if name not in event or not ftype.ok(event[name]):
            raise ValueError(f"event {name!r} must be {ftype.what}, got {reprlib.repr(event.get(name))}")
    kind = EVENT_KINDS.get(event["kind"])
    if kind is None:
        raise ValueError(f"unknown event kind {event['kind']!r}: declare it in runtime/core/event_kinds.py")
    declared = kind.fields()
    missing = [n for n in kind.required if n not in event]
    if missing:
        raise ValueError(f"event {kind.name!r} has no {', '.join(map(repr, missing))} (runtime/core/event_kinds.py)")
    unknown = [n for n in event if n not in declared and n not in COMMON_FIELDS]
    if unknown:
        raise ValueError(f"event {kind.name!r} has undeclared fields {', '.join(map(repr, unknown))} "
                         "(declare them in runtime/core/event_kinds.py)")
    for name, ftype in declared.items():
        if name in event and not ftype.ok(event[name]):
            raise ValueError(f"event {kind.name!r}: {name!r} must be {ftype.what}, got {reprlib.repr(event[name])}")
