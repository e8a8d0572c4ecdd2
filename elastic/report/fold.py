"""The run report: ``report.json`` folded from ``events.jsonl``.

:func:`build_report` is a pure function of the event log, so a report can
always be re-rendered from the log alone. Field meanings are documented in
``docs/report.md``. Injected faults are folded by the ``fault_kind`` their
``fault_injected``/``fault_skipped`` events recorded; this module knows
nothing of the chaos package that emits them.

Every event is checked once, before the fold, against :data:`READS` (each
kind's fields that the fold, goodput or the renderers read) with the types the
log's one schema declares for them (``runtime.EVENT_KINDS``, from
``runtime/core/event_kinds.py``, which the writer checks every event against): a
malformed event (not an object, a missing field, a field of the wrong type, a
time that is not a finite number) raises ``ValueError`` naming the event
(1-based) and the field. The fold is laxer than the writer so that old logs
still fold: it needs only the fields it reads, ignores fields it does not,
and checks kinds it does not read only for ``t`` and ``kind``. Fields it
copies into the report verbatim ("anything") are not type-checked: schema
validation judges their values, and the renderers show whatever they hold.
"""

from __future__ import annotations

import os
import reprlib
from typing import Any

from elastic.report.goodput import goodput
from elastic.report.pipeline import pipeline_section
from elastic.report.pool import pool_section
from elastic.report.rl import rl_section, sampler_fault, samplers_in
from runtime import EVENT_COMMON_FIELDS, EVENT_KINDS, EventFieldType, read_events, transitions

__all__ = ["EVENT_FIELDS", "FAILURE_KIND_OF_FAULT", "READS", "REPORT_VERSION", "build_report"]

#: 2: the final state's digest names its algorithm (``final_state_digest``, ``digest_algorithm``); 1 had
#: ``final_state_sha256``. Logs written before fold into version 2 all the same (their sha256 digest named).
REPORT_VERSION = 2


#: Marks a field the fold reads with the type the schema declares for it (``runtime/core/event_kinds.py``).
TYPED = None
#: Marks a field the fold copies into the report verbatim: any value folds (report schema validation judges it).
_ANY = EventFieldType("anything", lambda v: True)

#: kind -> (fields the fold, goodput or the renderers read unguarded, fields they read when present): what a
#: log's event must have for the fold, laxer than what the writer checks (old logs lack fields added since).
#: The types are the schema's (:data:`TYPED`), except for fields copied verbatim.
READS: dict[str, tuple[dict[str, EventFieldType | None], dict[str, EventFieldType | None]]] = {
    "job_started": ({"mode": _ANY, "config": TYPED, "global_batch_size": _ANY, "microbatches": _ANY}, {}),
    "programs_built": ({"program_bytes": _ANY, "state_bytes": _ANY}, {}),
    "run_started": ({"run_id": _ANY, "slices": _ANY, "devices_per_slice": _ANY, "steps": _ANY}, {}),
    "programs_loaded": ({"compile_seconds": TYPED}, {}),
    "state_initialized": ({"state_bytes": _ANY}, {}),
    "run_resumed": ({"step": TYPED, "directory": _ANY, "tier": _ANY, "bytes": _ANY, "losses": TYPED,
                     "losses_recorded": _ANY, "state_bytes": _ANY}, {"resharded_from": TYPED}),
    "step_committed": ({"step": TYPED, "loss": TYPED},
                       {"seconds": TYPED, "recovered": _ANY, "stage_phases": TYPED, "bubble": TYPED}),
    "placement": ({"active": TYPED}, {}),
    "failure_detected": ({"error": _ANY, "detail": _ANY, "committed": _ANY}, {"worker": _ANY}),
    "worker_dead": ({"worker": TYPED}, {"cause": TYPED, "host": TYPED, "retired": TYPED, "stacks": TYPED}),
    "worker_registered": ({"worker": TYPED}, {"hosts": TYPED}),
    "recovery_decision": ({"action": TYPED, "dead": TYPED, "active": TYPED}, {}),
    "checkpoint_skipped": ({"detail": _ANY}, {}),
    "checkpoint_failed": ({"error": _ANY}, {}),
    "eval_completed": ({"step": TYPED, "loss": TYPED},
                       {"total_loss": TYPED, "total_weights": TYPED, "batches": TYPED, "seconds": TYPED,
                        "before_step": TYPED}),
    "eval_skipped": ({"step": TYPED, "reason": _ANY}, {}),
    "recovered": ({"resume_step": _ANY, "bytes_moved": _ANY}, {"path": _ANY}),
    "grown": ({"active": TYPED}, {"step": TYPED, "promoted": TYPED}),
    "straggler_replaced": ({"active": TYPED}, {}),
    "straggler": ({"worker": TYPED, "step": _ANY, "seconds": TYPED, "median_seconds": TYPED, "action": _ANY},
                  {"stacks": TYPED}),
    "fault_injected": ({"index": _ANY, "fault": _ANY, "fault_kind": TYPED, "workers": TYPED, "step": _ANY},
                       {"hosts": TYPED}),
    "fault_skipped": ({"index": _ANY, "fault": _ANY, "fault_kind": TYPED, "reason": _ANY, "step": _ANY}, {}),
    "chaos_started": ({k: _ANY for k in ("spec", "seed", "mtbf_seconds", "duration_seconds", "scenario")}, {}),
    "capacity_wait": ({}, {"seconds": TYPED}),
    "capacity_wait_ended": ({}, {"seconds": TYPED}),
    "run_truncated": ({"steps": _ANY}, {}),
    "security_refused": ({}, {"count": TYPED, "method": _ANY}),
    "events_dropped": ({}, {"count": TYPED}),
    "run_failed": ({"error": _ANY}, {}),
    "run_stopped": ({"signal": _ANY}, {}),
    "attach_refused": ({"error": _ANY}, {}),
    "verdict": ({"verdict": TYPED, "verdict_reasons": TYPED, "trajectory": _ANY, "first_diverging_step": _ANY,
                 "exactly_once": _ANY, "exactly_once_detail": _ANY, "reference": _ANY},
                {"promises": TYPED, "run_state_replayed": TYPED}),
    # final_state_digest, or in logs from before it named its algorithm, final_state_sha256 (bare sha256 hex).
    "rl_step": ({"step": TYPED, "version": TYPED, "rollout_seconds": TYPED, "rollout_bytes": TYPED},
                {"mean_reward": TYPED}),
    "rollouts_made": ({"step": TYPED, "seconds": TYPED}, {}),
    "weights_synced": ({"bytes": TYPED, "seconds": TYPED}, {"failed": TYPED}),
    "samplers_started": ({"workers": TYPED}, {}),
    "samplers_attached": ({"workers": TYPED, "launched": TYPED}, {}),
    "sampler_relaunched": ({"worker": TYPED}, {}),
    "worker_launched": ({"worker": TYPED}, {"role": TYPED}),
    "worker_relaunched": ({"worker": TYPED}, {"role": TYPED}),
    "sampler_joined": ({"worker": TYPED}, {}),
    "step_dispatched": ({"step": TYPED}, {}),
    # a shared pool's run (elastic.report.pool): its lease timeline
    "pool_waiting": ({"status": TYPED}, {}),
    "lease_granted": ({"worker": TYPED, "host": TYPED, "lease": TYPED}, {}),
    "lease_returned": ({"worker": TYPED, "why": TYPED}, {}),
    "lease_preempted": ({"count": TYPED, "workers": TYPED}, {}),
    "released": ({"step": TYPED}, {}),
    "run_finished": ({"replica_hashes": _ANY, "client_peak_rss_bytes": _ANY},
                     {"final_state_digest": TYPED, "final_state_sha256": TYPED}),
}

_UNDECLARED = sorted(f"{k}.{f}" for k, (need, may) in READS.items() for f in {**need, **may}
                     if k not in EVENT_KINDS or f not in EVENT_KINDS[k].fields())
assert not _UNDECLARED, f"the fold reads fields runtime/core/event_kinds.py does not declare: {_UNDECLARED}"

#: kind -> (required fields, optional fields), each with the type the fold checks: :data:`READS` with the
#: schema's types filled in (besides ``t``, a finite number, and ``kind``, a string, which every event has).
#: Kinds not listed are checked only for ``t`` and ``kind``.
EVENT_FIELDS: dict[str, tuple[dict[str, EventFieldType], dict[str, EventFieldType]]] = {
    k: tuple({f: EVENT_KINDS[k].fields()[f] if t is TYPED else t for f, t in part.items()} for part in parts)
    for k, parts in READS.items()
}


def _check_event(n: int, e: Any) -> None:
    """Raises ValueError naming event ``n`` (1-based) unless ``e`` has the fields its kind declares."""
    if not isinstance(e, dict):
        raise ValueError(f"event {n} is not an object: {reprlib.repr(e)}")
    for name, field in EVENT_COMMON_FIELDS.items():
        if name not in e:
            raise ValueError(f"event {n} has no {name!r} (every event has 't' and 'kind')")
        if not field.ok(e[name]):
            raise ValueError(f"event {n}: {name!r} must be {field.what}, got {reprlib.repr(e[name])}")
    required, optional = EVENT_FIELDS.get(e["kind"], ({}, {}))
    for name, field in {**required, **optional}.items():
        if name not in e:
            if name in required:
                raise ValueError(f"event {n} ({e['kind']!r}) has no {name!r}")
        elif not field.ok(e[name]):
            raise ValueError(f"event {n} ({e['kind']!r}): {name!r} must be {field.what}, "
                             f"got {reprlib.repr(e[name])}")


def build_report(events_or_path) -> dict:
    """``report.json`` (a dict, ``docs/report.schema.json``) folded from a list of events or an events file.

    Raises ValueError naming the event (or, from a file, the line) for a
    malformed one; an empty log gives a report of nothing, goodput all zeros.
    """
    events = events_or_path
    if isinstance(events_or_path, (str, os.PathLike)):
        events = read_events(events_or_path)
    for n, e in enumerate(events, 1):
        _check_event(n, e)
    report = {
        "report_version": REPORT_VERSION,
        "mode": None,
        "run_id": None,
        "config": None,
        "slices": None,
        "devices_per_slice": None,
        "microbatches": None,
        "global_batch_size": None,
        "steps_requested": None,
        "steps_completed": 0,
        "losses": [],
        "final_state_digest": None,
        "digest_algorithm": None,
        "replica_hashes": {},
        "wall_seconds": None,
        "client_peak_rss_bytes": None,
        "state_bytes": None,
        "program_bytes": None,
        "compile_seconds": None,
        "step_seconds_median": None,
        "step_latency_seconds_median": None,
        "finished": False,
        "failures": [],
        "checkpoint_restores": 0,
        "snapshot_restores": 0,
        "resumed_from": None,
        "checkpoints_skipped": [],
        "checkpoints_failed": 0,
        "checkpoint_errors": [],
        "steps_lost": 0,
        "client_restarts": 0,
        "client_downtime_seconds": 0.0,
        "slices_at_end": None,
        "slice_hosts": None,
        "seed": None,
        "faults": [],
        "stragglers": [],
        "evals": [],
        "goodput": None,
        "chaos": None,
        "reference": None,
        "verdict": None,
        "verdict_reasons": [],
        "trajectory": None,
        "first_diverging_step": None,
        "exactly_once": None,
        "exactly_once_detail": {},
        "promises": [],
        "run_state_replayed": None,
        "failure_reason": None,
        "security": {"refused_calls": 0, "by_method": {}, "refused_registrations": 0},
        "events_dropped": 0,
        "attempts": [],
        "pipeline": None,
        "rl": None,
        "pool": None,
    }
    dead_at: dict[str, float] = {}   # worker -> when RunState first held it dead (s since start)
    step_seconds, latencies = [], []
    last_commit_t = None   # None after a failure: the interval that spans it is recovery, not a step
    t_first = events[0]["t"] if events else None
    attempt: dict | None = None   # the attempt the events belong to (see _new_attempt)
    samplers: set[str] = set()    # every worker that served an RL run as a sampler, in any attempt
    # The run's facts (placement, deaths, attempts) are RunState's: the report reads its transitions.
    for t in transitions(events):
        e, before, state, kind = t.event, t.before, t.after, t.event["kind"]
        samplers |= samplers_in(t)
        for w in state.dead.keys() - before.dead.keys():
            dead_at[w] = e["t"] - t_first
        if state.placement is not before.placement and state.placement is not None:
            report["slices_at_end"] = len(state.placement.active)
        if t.attempt == len(report["attempts"]):   # (a refused attach's attempt is one too)
            attempt = _new_attempt(report, e, t_first)
            last_commit_t = None
        attempt["ended_at"] = e["t"] - t_first
        if attempt["started_from"] is None and (
                kind in ("run_resumed", "step_committed", "checkpoint_restored", "snapshot_restored")
                or (kind == "client_attached" and e["workers"])
                or (kind == "state_initialized" and report["mode"] != "reference")):
            # Where this attempt's state came from; committed steps after that point are recomputed.
            origin = e["committed"] if kind == "client_attached" else e.get("step", 0)
            tier = (e["tier"] if kind == "run_resumed" else "live" if kind == "client_attached"
                    else kind.removesuffix("_restored") if kind.endswith("_restored") else "seed"
                    if kind == "state_initialized" or report["mode"] == "reference" else None)   # None: not recorded
            attempt["started_from"] = {"tier": tier, "step": origin, "directory": e.get("directory")}
            before = report["steps_completed"]
            attempt["steps_recomputed"] = max(0, before - origin)
            report["steps_lost"] += attempt["steps_recomputed"]
            if origin < before:   # rewound past what earlier attempts committed
                report["losses"] = report["losses"][:origin]
                report["steps_completed"] = origin
        if kind == "job_started":
            report.update(mode=e["mode"], config=e["config"], global_batch_size=e["global_batch_size"],
                          microbatches=e["microbatches"], seed=(e["config"] or {}).get("seed"))
            attempt["mode"] = e["mode"]
        elif kind == "programs_built":
            report.update(program_bytes=e["program_bytes"], state_bytes=e["state_bytes"])
        elif kind == "run_started":
            report.update(run_id=e["run_id"], slices=e["slices"], devices_per_slice=e["devices_per_slice"],
                          steps_requested=e["steps"])
            attempt.update(run_id=e["run_id"], steps_requested=e["steps"])
        elif kind == "client_attached":
            report.update(run_id=e["run_id"], steps_requested=e["steps"])
            report["client_restarts"] += 1
            report["client_downtime_seconds"] += e["downtime_seconds"]
            attempt.update(run_id=e["run_id"], steps_requested=e["steps"],
                           reattached={"generation": e["generation"], "workers": sorted(e["workers"]),
                                       "lost": list(e["lost"]), "downtime_seconds": e["downtime_seconds"]})
        elif kind == "programs_loaded":
            report["compile_seconds"] = max(e["compile_seconds"].values(), default=0.0)
        elif kind == "state_initialized":
            report["state_bytes"] = e["state_bytes"]
        elif kind == "run_resumed":
            # The steps before came from an earlier run: their losses as its checkpoint recorded them.
            report["resumed_from"] = {k: e[k] for k in ("step", "directory", "tier", "bytes", "losses_recorded")}
            report["resumed_from"].update(resharded_from=e.get("resharded_from"),
                                          comparison="within tolerance" if e.get("resharded_from") else "bit-identical")
            recorded = [x if isinstance(x, (int, float)) and x == x else None for x in e["losses"]]
            seen = report["losses"]   # what earlier attempts of this log committed fills what it did not record
            report["losses"] = [seen[i] if x is None and i < len(seen) else x for i, x in enumerate(recorded)]
            report.update(steps_completed=e["step"], state_bytes=e["state_bytes"])
        elif kind == "step_committed":
            attempt["_last_step"] = e["step"]
            if e["step"] < report["steps_completed"]:
                # A step committed again: the run had rewound past committed work.
                report["steps_lost"] += 1
                continue
            report["losses"].append(e["loss"])
            report["steps_completed"] += 1
            attempt["steps_committed"] += 1
            if "seconds" in e:
                latencies.append(e["seconds"])
            if last_commit_t is not None and not e.get("recovered"):
                step_seconds.append(e["t"] - last_commit_t)
            last_commit_t = e["t"]
        elif kind == "failure_detected":
            current = {"detected_at": e["t"] - t_first, "error": e["error"], "detail": e["detail"],
                       "step": e["committed"], "workers": [], "path": None, "recovered_after_s": None,
                       "bytes_moved": 0, "kind": "error", "detected_after_s": None}
            report["failures"].append(current)
            last_commit_t = None
        elif kind == "recovery_decision" and report["failures"]:
            failure = report["failures"][-1]
            failure["workers"] += [w for w in e["dead"] if w not in failure["workers"]]
            failure["path"] = e["action"]
        elif kind == "checkpoint_restored":
            report["checkpoint_restores"] += 1
        elif kind == "snapshot_restored":
            report["snapshot_restores"] += 1
        elif kind == "checkpoint_failed":
            report["checkpoints_failed"] += 1
            error = str(e["error"])
            if error not in report["checkpoint_errors"] and len(report["checkpoint_errors"]) < 10:
                report["checkpoint_errors"].append(error)   # each save of a broken directory fails the same way
        elif kind == "checkpoint_skipped" and e["detail"] not in report["checkpoints_skipped"]:
            report["checkpoints_skipped"].append(e["detail"])   # every worker reading it says the same
        elif kind == "recovered" and report["failures"]:
            # A failure during a recovery (say, the transfer source died) is
            # recovered by the same, final recovery.
            for f in report["failures"]:
                if f["recovered_after_s"] is None:
                    f.update(recovered_after_s=e["t"] - t_first - f["detected_at"], resume_step=e["resume_step"],
                             restore_tier=e.get("restore_tier", "replica"))
            report["failures"][-1].update(bytes_moved=e["bytes_moved"])
        elif kind in ("eval_completed", "eval_skipped"):
            _fold_eval(report["evals"], e)
        elif kind == "straggler":
            report["stragglers"].append({**{k: e[k] for k in ("worker", "step", "seconds", "median_seconds", "action")},
                                         **({"stacks": e["stacks"]} if "stacks" in e else {})})
        elif kind in ("fault_injected", "fault_skipped"):
            injected = kind == "fault_injected"
            report["faults"].append({"index": e["index"], "spec": e["fault"], "kind": e["fault_kind"],
                                     "workers": e["workers"] if injected else [],
                                     "injected_at": e["t"] - t_first if injected else None, "step": e["step"],
                                     "detected_after_s": None, "recovered_after_s": None, "path": None,
                                     "bytes_moved": 0, "skipped": None if injected else e["reason"],
                                     **({"hosts": dict(e["hosts"])} if e.get("hosts") else {})})
        elif kind == "worker_registered" and e.get("hosts"):   # a slice of several hosts
            report["slice_hosts"] = (report["slice_hosts"] or {}) | {e["worker"]: [
                {"host": h.get("host"), "pid": h.get("pid", 0), "address": h.get("address", "")} for h in e["hosts"]]}
        elif kind == "chaos_started":
            report["chaos"] = {k: e[k] for k in ("spec", "seed", "mtbf_seconds", "duration_seconds", "scenario")}
        elif kind == "run_truncated":
            report["steps_requested"] = e["steps"]
        elif kind == "security_refused":
            # ``count``: refusals this event stands for (a worker may batch them); 1 if absent.
            count = e.get("count", 1)
            security = report["security"]
            security["refused_calls"] += count
            method = str(e.get("method") or "?")
            security["by_method"][method] = security["by_method"].get(method, 0) + count
        elif kind == "register_refused":
            report["security"]["refused_registrations"] += 1
        elif kind == "events_dropped":
            report["events_dropped"] += e.get("count", 0)
        elif kind == "run_failed":
            report["failure_reason"] = attempt["failure_reason"] = e["error"]
            attempt["end"] = "failed"
        elif kind == "attach_refused":
            report["failure_reason"] = attempt["failure_reason"] = e["error"]
            attempt["end"] = "refused"
        elif kind == "run_stopped":
            last = attempt["_last_step"]
            where = f"after step {last}" if last is not None else "before any step was committed"
            report["failure_reason"] = attempt["failure_reason"] = f"stopped by the user ({e['signal']}) {where}"
            attempt["end"] = "stopped"
        elif kind == "verdict":
            for k in ("verdict", "verdict_reasons", "trajectory", "first_diverging_step", "exactly_once",
                      "exactly_once_detail", "reference"):
                report[k] = e[k]
            report["promises"] = e.get("promises", [])   # chaos.promise: one per recovery
            report["run_state_replayed"] = e.get("run_state_replayed")
        elif kind == "run_finished":
            digest, hashes = _final_digests(e)
            report.update(final_state_digest=digest, digest_algorithm=digest.partition(":")[0] if digest else None,
                          replica_hashes=hashes, client_peak_rss_bytes=e["client_peak_rss_bytes"], finished=True)
            attempt.update(end="finished", finished=True)
            report["wall_seconds"] = e["t"] - t_first
    last_steps = [a.pop("_last_step") for a in report["attempts"]]
    for i, a in enumerate(report["attempts"]):
        if a["end"] is None:
            a["end"] = "died"
            a["failure_reason"] = _died(a, last_steps[i], last=i == len(report["attempts"]) - 1)
    if report["attempts"] and not report["finished"] and report["failure_reason"] is None:
        report["failure_reason"] = report["attempts"][-1]["failure_reason"]
    if step_seconds:
        report["step_seconds_median"] = sorted(step_seconds)[len(step_seconds) // 2]
    if latencies:
        report["step_latency_seconds_median"] = sorted(latencies)[len(latencies) // 2]
    _attribute(report, events, dead_at, t_first, samplers)
    report["goodput"] = goodput(events)   # an empty log: all zeros
    report["pipeline"] = pipeline_section(report["config"], report["microbatches"], events)
    report["rl"] = rl_section(report["config"], events, samplers)
    report["pool"] = pool_section(report["config"], events)
    if report["finished"] and len(report["attempts"]) > 1:
        # First event to the last run_finished, less the idle time between a finished attempt and the next.
        report["wall_seconds"] = report["goodput"]["wall_seconds"]
    if report["mode"] == "reference":
        report["slices"] = 0
    return report


def _fold_eval(evals: list, e: dict) -> None:
    """One eval into the report's ``evals`` (by step; a step evaluated again, after a rewind or by a later
    attempt, keeps its last): the loss and what it was computed from, or why it was skipped."""
    if e["kind"] == "eval_skipped":
        entry = {"step": e["step"], "loss": None, "skipped": str(e["reason"])}
    else:
        entry = {"step": e["step"], "loss": e["loss"],
                 **{k: e[k] for k in ("total_loss", "total_weights", "batches", "seconds", "before_step") if k in e}}
    evals[:] = sorted([x for x in evals if x["step"] != e["step"]] + [entry], key=lambda x: x["step"])


def _new_attempt(report: dict, e: dict, t_first: float) -> dict:
    """Opens the report's next attempt at event ``e`` (a ``job_started``, or the first event of a log without one).

    A run directory's log holds every attempt of the run (``elastic run`` again after the client died, or to
    extend a finished run): each starts with ``job_started``. What describes the run as it ends (``finished``,
    ``failure_reason``, the final hashes, ``resumed_from``) is the last attempt's; steps, losses, failures and
    faults accumulate.
    """
    attempts = report["attempts"]
    # A refused re-attach changed nothing: the attempt after it follows the one before it (its gap, how it ended).
    previous = next((a for a in reversed(attempts) if a["end"] != "refused"), None)
    attempt = {"attempt": len(attempts) + 1, "mode": None, "run_id": None, "steps_requested": None,
               "started_at": e["t"] - t_first, "ended_at": e["t"] - t_first,
               "gap_before_s": None if previous is None else e["t"] - t_first - previous["ended_at"],
               "after": None if previous is None else ("finished" if previous["finished"] else "died"
                                                       if previous["end"] is None else previous["end"]),
               "started_from": None, "reattached": None, "steps_committed": 0, "steps_recomputed": 0, "end": None,
               "finished": False, "failure_reason": None, "_last_step": None}
    if attempts:
        report.update(finished=False, failure_reason=None, final_state_digest=None, digest_algorithm=None,
                      replica_hashes={}, resumed_from=None, client_peak_rss_bytes=None, wall_seconds=None)
    attempts.append(attempt)
    return attempt


def _final_digests(e: dict) -> tuple[str | None, Any]:
    """A ``run_finished`` event's final state digest and replica digests, each ``"<algorithm>:<hex>"``: as
    written, or in a log from before digests named their algorithm, its sha256 hex digits named so."""
    if "final_state_digest" in e:
        return e["final_state_digest"], e["replica_hashes"]
    old, hashes = e.get("final_state_sha256"), e["replica_hashes"]
    if isinstance(hashes, dict):
        hashes = {w: f"sha256:{h}" if isinstance(h, str) else h for w, h in hashes.items()}
    return (f"sha256:{old}" if isinstance(old, str) else None), hashes


def _died(attempt: dict, last_step: int | None, *, last: bool) -> str:
    """Why an attempt with neither ``run_finished`` nor ``run_failed`` ended: its client stopped writing.

    Only the client writes the log, so a log (or an attempt, when a later one follows) that ends without
    either says its client died: SIGKILL, an OOM kill, a crash of the interpreter, a lost machine. The last
    attempt of a log may also be one still running (``elastic report`` on a live run)."""
    where = f"after step {last_step}" if last_step is not None else "before any step was committed"
    what = "the event log ends" if last else f"attempt {attempt['attempt']} ends"
    return (f"{what} without run_finished {where}: the client died or was killed"
            + (" (or the run is still going)" if last else ""))


# The failure kind a fault causes, by the ``fault_kind`` its event recorded. A
# kind missing here leaves the failure's kind as the worker deaths said.
FAILURE_KIND_OF_FAULT = {"kill": "crash", "hang": "hang", "partition": "partition", "corrupt": "corrupt",
                         "straggle": "straggler", "kill_save": "crash"}


def _attribute(report: dict, events: list[dict], dead_at: dict[str, float], t_first: float,
               samplers: set[str]) -> None:
    """Matches each injected fault to the failure it caused; fills kinds and latencies.

    A fault causes the first failure detected after it that lost one of its
    workers (or, for a fault that kills nobody, such as a corrupt message,
    the first failure after it). Detection time is when the first of those
    workers was declared dead, else when the failure was detected.
    """
    failures = report["failures"]
    for f in failures:
        deaths = [e for e in events if e["kind"] == "worker_dead" and e["worker"] in f["workers"]]
        causes = {e.get("cause") for e in deaths}
        f["stacks"] = {e["worker"]: e["stacks"] for e in deaths if "stacks" in e}   # kept before it was replaced
        if f["error"] == "ClientLostError":   # the client was lost, whatever else its restart found lost
            f["kind"] = "client"
        elif causes:
            f["kind"] = "hang" if "hang" in causes else "straggler" if "stuck" in causes else "crash"
    for fault in report["faults"]:
        if fault["injected_at"] is None:
            continue
        if fault.get("hosts"):   # the hosts retired with each slice it cost (its first death after the fault)
            retired = {}
            for e in events:
                if (e["kind"] == "worker_dead" and e["worker"] in fault["hosts"] and "retired" in e
                        and e["worker"] not in retired and e["t"] - t_first >= fault["injected_at"] - 1e-6):
                    retired[e["worker"]] = list(e["retired"])
            fault["retired"] = retired
        if fault["kind"] == "straggle":
            hits = [e for e in events if e["kind"] == "straggler" and e["worker"] in fault["workers"]
                    and e["t"] - t_first >= fault["injected_at"]]
            if hits:
                fault["detected_after_s"] = hits[0]["t"] - t_first - fault["injected_at"]
                fault["path"] = "replace" if hits[0]["action"] == "replaced" else None
            continue
        if sampler_fault(fault, events, samplers, dead_at, t_first):   # an RL run's sampler: its rollouts go to the others
            continue
        client = not fault["workers"] and fault["kind"] in ("kill", "hang")   # kill:client, hang:client
        for f in failures:
            if f["detected_at"] < fault["injected_at"] - 1e-6:
                continue
            if client:
                if f["error"] != "ClientLostError":
                    continue   # a client fault causes the client's loss (which the restart recovers from)
            elif f["workers"] and not set(f["workers"]) & set(fault["workers"]) and fault["kind"] != "corrupt":
                continue
            seen = [dead_at[w] for w in fault["workers"] if w in dead_at and dead_at[w] >= fault["injected_at"]]
            detected = min(seen + [f["detected_at"]])
            fault.update(detected_after_s=detected - fault["injected_at"], path=f["path"],
                         bytes_moved=f["bytes_moved"])
            if f["recovered_after_s"] is not None:
                fault["recovered_after_s"] = f["detected_at"] + f["recovered_after_s"] - fault["injected_at"]
            if not client and f["kind"] != "client":
                f["kind"] = FAILURE_KIND_OF_FAULT.get(fault["kind"], f["kind"])
            f["detected_after_s"] = fault["detected_after_s"]
            break
