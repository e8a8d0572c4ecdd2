"""Run logs in tests: building events by hand, reading a run directory's ``events.jsonl``, picking events out.

Events are the dicts ``runtime.EventLog`` writes, one JSON object a line: ``{"t": ..., "kind": ..., **fields}``.
"""

import json
import pathlib

EPOCH = 1_700_000_000.0   # a wall-clock time (2023-11-14) for hand-built logs whose times are read as dates


def events_from(t0: float):
    """An event builder for hand-built logs: ``ev(t, kind, **fields)`` is the event ``kind`` at ``t0 + t`` seconds.

    ``t`` and ``kind`` are positional only, so any field name (``epoch``, ``step``...) is free for ``fields``.
    """
    def ev(t, kind, /, **fields):
        return {"t": t0 + t, "kind": kind, **fields}
    return ev


ev = events_from(EPOCH)


def timeless(kind, /, **fields):
    """An event for code that ignores the times (``t`` is 0.0 for every event): ``timeless(kind, **fields)``."""
    return events_from(0.0)(0.0, kind, **fields)


def run_events(run_dir) -> list[dict]:
    """Every event of a finished run: ``run_dir/events.jsonl``, each line one event.

    A missing log, or a line that is no JSON (cut off, garbled), fails the test that reads it.
    """
    return [json.loads(line) for line in (pathlib.Path(run_dir) / "events.jsonl").read_text().splitlines()]


def live_events(run_dir) -> list[dict]:
    """The events a run (perhaps still running) has written to ``run_dir/events.jsonl`` so far: its complete
    lines ([] before the log exists)."""
    path = pathlib.Path(run_dir) / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.endswith("}")]


def kinds(events, kind):
    """The events of one kind, in log order."""
    return [e for e in events if e["kind"] == kind]


def committed_steps(events):
    """The step of every ``step_committed`` event, in log order (a step committed twice appears twice)."""
    return [e["step"] for e in events if e["kind"] == "step_committed"]
