"""The report's ``pool`` section: a run whose workers were leased from a shared pool (``elastic_pool=HOST:PORT``).

A pure function of the config and the event log (:func:`pool_section`), as
the rest of the report is; None for a run that is not a pool's (the config's
``elastic_pool`` empty and no ``lease_granted`` in the log). It reads the
run's own lease timeline (``runtime/core/event_kinds.py``):

- ``pool_waiting``: the run waits in the pool's queue (its status line);
- ``lease_granted``: a host leased for one of its workers;
- ``lease_returned``: a worker's host given back (``why``: ``returned``,
  ``preempted``, ``run ended``);
- ``lease_preempted``: the pool asked for hosts back, and the workers the
  run gave; the ``released`` event after it is the step boundary where the
  run gave them (spares dropped, then a shrink);
- ``grown``: the run grew back onto a host granted again.

Times are seconds since the log's first event. ``queue_seconds`` runs from
the first ``pool_waiting`` to the first ``lease_granted`` after it (to the
log's last event when none came; 0.0 for a run that never waited). A lease
is held from its grant to its worker's next return; ``hosts_max`` and
``hosts_at_end`` count the leases held at once.
"""

from __future__ import annotations

__all__ = ["pool_section"]


def _names(workers: list) -> str:
    return ", ".join(map(str, workers)) or "none"


def pool_section(config: dict | None, events: list[dict]) -> dict | None:
    """The ``pool`` section of a run's report; None for a run whose workers were not leased from a pool."""
    config = config or {}
    if not config.get("elastic_pool") and not any(e["kind"] == "lease_granted" for e in events):
        return None
    t_first = events[0]["t"] if events else 0.0
    leases: list[dict] = []
    open_lease: dict[str, dict] = {}   # worker -> its lease not returned yet
    preemptions: list[dict] = []
    pending: dict | None = None        # the preemption whose ``released`` is still to come
    timeline: list[dict] = []
    asked: list[tuple[dict, dict]] = []   # (timeline entry, its preemption): worded once its step is known
    waited_at = granted_at = None
    held = hosts_max = 0
    for e in events:
        kind, t = e["kind"], e["t"] - t_first
        if kind == "job_started":
            pending = None   # a new attempt: a release after it is none of the last attempt's preemptions
        elif kind == "pool_waiting":
            waited_at = t if waited_at is None else waited_at
            timeline.append({"t": t, "kind": "waiting", "worker": None, "detail": e["status"]})
        elif kind == "lease_granted":
            if waited_at is not None and granted_at is None:
                granted_at = t
            lease = {"worker": e["worker"], "host": e["host"], "lease": e["lease"], "granted_t": t,
                     "returned_t": None, "why": None}
            if e["worker"] not in open_lease:
                held += 1
            open_lease[e["worker"]] = lease   # granted again without a return: the newer lease is the held one
            leases.append(lease)
            hosts_max = max(hosts_max, held)
            timeline.append({"t": t, "kind": "granted", "worker": e["worker"],
                             "detail": f"{e['worker']} on host {e['host']} ({e['lease']})"})
        elif kind == "lease_returned":
            lease = open_lease.pop(e["worker"], None)
            if lease is not None:
                lease.update(returned_t=t, why=e["why"])
                held -= 1
            timeline.append({"t": t, "kind": "returned", "worker": e["worker"],
                             "detail": f"{e['worker']} given back ({e['why']})"})
        elif kind == "lease_preempted":
            entry = {"t": t, "count": e["count"], "workers": list(e["workers"]), "step": None}
            preemptions.append(entry)
            pending = entry if entry["workers"] else None   # none given: no release follows
            asked.append(({"t": t, "kind": "preempted", "worker": None, "detail": ""}, entry))
            timeline.append(asked[-1][0])
        elif kind == "released" and pending is not None:
            pending["step"], pending = e["step"], None
        elif kind == "grown":
            promoted, step = e.get("promoted") or [], e.get("step")
            timeline.append({"t": t, "kind": "grown", "worker": None,
                             "detail": f"grew back to {len(e['active'])} slice(s)"
                                       + (f" at step {step}" if step is not None else "")
                                       + (f": {_names(promoted)} promoted" if promoted else "")})
    for item, p in asked:
        item["detail"] = (f"{p['count']} host(s) asked back; gave {_names(p['workers'])}"
                          + (f" at step {p['step']}" if p["step"] is not None else ""))
    if waited_at is None:
        queue = 0.0
    else:
        queue = (granted_at if granted_at is not None else events[-1]["t"] - t_first) - waited_at
    return {
        "address": config.get("elastic_pool") or None,
        "priority": config.get("elastic_pool_priority"),
        "queue_seconds": queue,
        "leases": leases,
        "preemptions": preemptions,
        "hosts_max": hosts_max,
        "hosts_at_end": held,
        "timeline": sorted(timeline, key=lambda x: x["t"]),
    }
