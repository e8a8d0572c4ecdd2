"""The run's goodput as ml-goodput-measurement events, where MaxText users look for it.

MaxText records goodput with ml-goodput-measurement's ``GoodputRecorder``
(config key ``enable_goodput_recording``): timestamps of job start and end,
accelerator initialisation, training preparation and every step's start go to
Cloud Logging, and ``GoodputCalculator`` (or MaxText's monitor) computes
goodput and badput from them. :func:`recorder_calls` turns a run's event log
into the same recorder calls; :func:`write_goodput_log` replays them through
the library's own recorder into ``goodput_log.jsonl`` in the run directory
(one JSON entry per line, exactly what the recorder writes), and into Cloud
Logging too when asked.

The mapping (pure, from :func:`elastic.report.goodput.intervals`):

- job start: the first event; job end: ``run_finished`` (or the last event);
- accelerator init (``tpu_init``): as long as the ``startup`` time before the
  first productive second, from the job start; training preparation: then
  as long as the ``compile`` time before it (so both durations are exact;
  the library takes one interval of each);
- step ``s`` starts when step ``s-1`` committed (step 0: the first productive
  second). After a failure, the step the failure interrupted starts again at
  ``recovered``: the library sees a step recorded twice, a disruption, and
  counts what was lost as badput.

Imports the library only in :func:`write_goodput_log` (an optional
dependency: ``pip install jax-elastic[goodput]``).
"""

from __future__ import annotations

import datetime
import json
import pathlib

from elastic.report.goodput import intervals
from runtime import attempts

__all__ = ["GOODPUT_LOG", "recorder_calls", "write_goodput_log"]

#: The file written in the run directory.
GOODPUT_LOG = "goodput_log.jsonl"


def recorder_calls(events: list[dict]) -> list[tuple[str, tuple]]:
    """``[(GoodputRecorder method name, args)]`` with unix-second times, in order; ``[]`` for an empty log."""
    if not events:
        return []
    events = sorted(events, key=lambda e: e["t"])
    t0 = float(events[0]["t"])
    ivs = intervals(events)
    first = next((s for s, _, lab in ivs if lab == "productive"), None)
    end = t0 + (ivs[-1][1] if ivs else 0.0)
    before = [(s, e, lab) for s, e, lab in ivs if first is None or e <= first]
    startup = sum(e - s for s, e, lab in before if lab == "startup")
    compile_ = sum(e - s for s, e, lab in before if lab == "compile")
    calls = [("record_job_start_time", (t0,)),
             ("record_tpu_init_start_time", (t0,)), ("record_tpu_init_end_time", (t0 + startup,)),
             ("record_training_preparation_start_time", (t0 + startup,)),
             ("record_training_preparation_end_time", (t0 + startup + compile_,))]
    if first is not None:
        next_step, interrupted = 0, False
        calls.append(("record_step_start_time", (0, t0 + first)))
        last = len(events) - len(attempts(events)[-1])   # the last attempt's first event
        for i, e in enumerate(events):
            kind = e["kind"]
            if kind == "run_finished" and i >= last:   # the last attempt's (an earlier one was extended later)
                break
            if kind == "step_committed" and e["step"] == next_step:
                next_step += 1
                calls.append(("record_step_start_time", (next_step, float(e["t"]))))
            elif kind == "failure_detected":
                interrupted = True
            elif kind == "recovered" and interrupted:
                interrupted = False
                calls.append(("record_step_start_time", (next_step, float(e["t"]))))
        finished = any(e["kind"] == "run_finished" for e in events[last:])
        if calls[-1][0] == "record_step_start_time" and (finished or calls[-1][1][1] >= end):
            calls.pop()   # the step after the last commit never started
    calls.append(("record_job_end_time", (end,)))
    return calls


class _FileLogger:
    """What GoodputRecorder writes through: its entries as JSON lines (the library's logger interface)."""

    def __init__(self, path: pathlib.Path, job_name: str):
        self.path, self.job_name, self.lines = path, job_name, []

    def write_cloud_logging_entry(self, entry) -> None:
        if entry is not None:
            self.lines.append(json.dumps(entry, sort_keys=True))

    def flush(self) -> None:
        self.path.write_text("".join(line + "\n" for line in self.lines))


def _replay(recorder, calls) -> None:
    for name, args in calls:
        *rest, t = args
        getattr(recorder, name)(*rest, datetime.datetime.fromtimestamp(t, datetime.timezone.utc))
    recorder.flush()


def write_goodput_log(run_dir, events: list[dict], job_name: str, *, cloud_logging: bool = False) -> pathlib.Path:
    """Replays the run through ``GoodputRecorder`` into ``run_dir/goodput_log.jsonl``; returns its path.

    ``cloud_logging=True`` also sends each entry to Cloud Logging under the
    logger ``goodput_<job_name>`` (MaxText's name), with the credentials of
    the environment. Raises ImportError (saying what to install) without
    ml-goodput-measurement.
    """
    try:
        from ml_goodput_measurement.src import goodput as gp
    except ImportError as e:
        raise ImportError("goodput recording needs ml-goodput-measurement: pip install 'jax-elastic[goodput]'") from e
    logger_name, calls = f"goodput_{job_name}", recorder_calls(events)
    sink = _FileLogger(pathlib.Path(run_dir) / GOODPUT_LOG, job_name)
    _replay(gp.GoodputRecorder(job_name, logger_name, logging_enabled=True, cloud_logger=sink), calls)
    if cloud_logging:   # the recorder's own Cloud Logging client, as MaxText uses it
        _replay(gp.GoodputRecorder(job_name, logger_name, logging_enabled=True), calls)
    return sink.path
