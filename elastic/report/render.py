"""A run's report files: ``report.json`` and ``report.html`` from ``events.jsonl``.

:func:`render_run` is the one writer of a run's reports: the trainer calls it
at the end of a run, the chaos harness after its verdict, ``elastic report``
on demand. Both files are written atomically (temp file + ``os.replace``), so
a reader never sees half a report.
"""

from __future__ import annotations

import json
import os
import pathlib

from elastic.report.fold import build_report
from elastic.report.html import write_html
from runtime import read_events

__all__ = ["render_run", "write_report"]


def render_run(run_dir, *, events_dropped: int = 0) -> dict:
    """Folds ``run_dir/events.jsonl`` into ``report.json`` and ``report.html``; returns the report.

    Every writer of a run's reports goes through here (the trainer at the end
    of a run, the chaos harness after its verdict, ``elastic report``).
    ``events_dropped``: events the writer's log could not record (its
    ``EventLog.dropped``); the log's own ``events_dropped`` line says the same
    when the disk allowed it, and the report keeps the larger count. Raises
    ``OSError`` when the files cannot be read or written.
    """
    events = read_events(pathlib.Path(run_dir) / "events.jsonl")
    report = build_report(events)
    report["events_dropped"] = max(report["events_dropped"], events_dropped)
    write_report(run_dir, report)
    write_html(run_dir, report, events)
    return report


def write_report(run_dir, report: dict) -> pathlib.Path:
    """Writes ``report.json`` atomically (temp file + rename)."""
    path = pathlib.Path(run_dir) / "report.json"
    tmp = path.with_suffix(".json.tmp")
    try:
        tmp.write_text(json.dumps(report, indent=2, sort_keys=False) + "\n")
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)   # a full disk leaves no half-written temp file behind
        e.filename = e.filename or str(path)   # a failed write() names no file: say which one was lost
        raise
    return path
