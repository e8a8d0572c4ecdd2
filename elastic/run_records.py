"""A run directory's records across the attempts of one run (each ``fit`` of the same ``run_name``).

Called by ``fit`` before anything is written, and after the run: what the
earlier attempts left (``events.jsonl``, read whole: a log that does not
parse is moved aside, never appended to), whether this attempt continues
that run (its log appended) or starts it again, a resume refused because
its programs differ from those that wrote the checkpoint (before any
worker starts, naming the config keys that changed), and, at the end, which
of the run's records could not be written (:class:`RunRecordsLostError`).
See ``docs/report.md`` ("Attempts").
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import sys

from elastic.config import ConfigError
from elastic.report import build_report, render_run
from runtime import READ_ONLY_PROGRAMS, ElasticError, EventLog, ProgramSet, attempts, checkpoint_steps, read_events

_STAGE = re.compile(r"stage\d+")   # a pipeline stage's checkpoint directory, inside the run's
EARLIER = "earlier"   # <run dir>/earlier/<n>: the records of a run this one did not continue, kept aside
# What a run directory holds that is the directory's, not an attempt's record: never moved aside.
_RUN_FILES = frozenset({EARLIER, "client.json", "checkpoints"})

__all__ = ["EARLIER", "RunRecordsLostError", "client_died", "continues", "finished_already", "keep_aside", "open_log",
           "read_history", "records_lost", "refuse_other_programs", "render"]


class RunRecordsLostError(ElasticError):
    """The run ended, but its records are incomplete: the event log could not record every event (a full disk,
    an I/O error) or ``report.json`` / ``report.html`` could not be written.

    Raised by ``fit`` after the run, in place of returning its report: ``report`` is the report of what was
    recorded (built in memory when it could not be written), ``str()`` is one line saying what was lost. What
    was written before the failure is left whole (the log stays a clean prefix, the old report files stay
    until new ones replace them atomically).
    """

    def __init__(self, message: str, report: dict | None = None):
        super().__init__(message, report)
        self.message, self.report = message, report

    def __str__(self) -> str:
        return self.message


def read_history(run_dir: pathlib.Path) -> list[dict]:
    """The events of the run directory's earlier attempts ([] for none); read before anything is written.

    A log that is not an event log (a line that is not JSON, not UTF-8) is moved aside to
    ``events.jsonl.unreadable`` (one warning), never appended to nor deleted."""
    path = run_dir / "events.jsonl"
    try:
        return read_events(path)
    except FileNotFoundError:
        return []
    except ValueError as e:
        aside = path.with_name("events.jsonl.unreadable")
        try:
            os.replace(path, aside)
        except OSError as moved:
            raise ConfigError(f"cannot move the unreadable event log {path} aside: {moved.strerror or moved}; "
                              "remove it or choose another run_name") from None
        print(f"elastic: warning: {e}; moved it to {aside}", file=sys.stderr)
        return []
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror or e}; choose a readable directory (config key "
                          "'base_output_directory') or another run_name") from None


def _checkpoints_recorded(history: list[dict], directory: str, steps: int) -> list[tuple[int, int]]:
    """``(step, attempt index)`` of each ``checkpoint_saved`` in ``directory`` (or, for a pipelined run, in one
    of its ``stage<k>`` directories) at or before ``steps``; in a local directory only those still complete
    there, in whatever layout wrote them (:func:`runtime.checkpoint_steps`: one host's, ``host<k>-of-<H>``'s; one
    removed by hand is no longer resumed from)."""
    held: dict[str, set[int]] = {}

    def there(saved: str, step: int) -> bool:
        if "://" in directory:
            return True   # a remote store is listed by the controller, not here (no round trip before the start)
        if saved not in held:
            try:
                held[saved] = set(checkpoint_steps(saved))
            except OSError:
                held[saved] = set()   # unreadable: nothing to resume from (the controller says why)
        return step in held[saved]

    return [(e["step"], i) for i, attempt in enumerate(attempts(history)) for e in attempt
            if e.get("kind") == "checkpoint_saved" and _within(e.get("directory"), directory)
            and isinstance(e.get("step"), int) and e["step"] <= steps and there(e["directory"], e["step"])]


def _within(saved, directory: str) -> bool:
    """Whether a checkpoint recorded in ``saved`` is one of ``directory``'s: the directory itself, or a pipeline
    stage's ``<directory>/stage<k>``."""
    if not isinstance(saved, str):
        return False
    parent, _, name = saved.rstrip("/").rpartition("/")
    return saved == directory or (parent == directory.rstrip("/") and _STAGE.fullmatch(name) is not None)


def continues(history: list[dict], opts, steps: int) -> bool:
    """Whether this distributed attempt continues the run the log holds (append) rather than starting it again.

    It does when the log's last attempt was a distributed one that did not finish (its client died, or it
    failed: running the same command again continues that run), or when the run's checkpoint directory holds
    a checkpoint an earlier attempt recorded (the controller resumes from it: a finished run extended)."""
    if not history:
        return False
    last = attempts(history)[-1]
    started = next((e for e in last if e.get("kind") == "job_started"), {})
    if started.get("mode") == "distributed" and not any(e.get("kind") == "run_finished" for e in last):
        return True
    return bool(opts.checkpoint_directory and _checkpoints_recorded(history, opts.checkpoint_directory, steps))


def finished_already(history: list[dict], opts, steps: int) -> bool:
    """Whether the run the log holds already finished ``steps`` steps with a checkpoint of the last one in its
    checkpoint directory (still there): running the same command again has nothing to compute, so it ends at
    once (no worker started, nothing written)."""
    if not history or not opts.checkpoint_directory:
        return False
    last = attempts(history)[-1]
    done = next((e for e in last if e.get("kind") == "run_finished"), None)
    return (done is not None and done.get("steps_completed") == steps
            and any(step == steps for step, _ in _checkpoints_recorded(history, opts.checkpoint_directory, steps)))


def client_died(history: list[dict]) -> bool:
    """Whether the log's last attempt was a distributed one whose client died: it neither finished nor failed
    (a failed attempt sent its workers home; a dead client's may still wait for a new one). Attempts that
    were refused the re-attach (other programs: nothing changed on the workers) are passed over."""
    kept = [a for a in attempts(history) if not _refused_attach(a)]
    if not kept:
        return False
    last = kept[-1]
    started = next((e for e in last if e.get("kind") == "job_started"), {})
    ended = ("run_finished", "run_failed", "run_stopped")   # a stopped attempt sent its workers home too
    return started.get("mode") == "distributed" and not any(e.get("kind") in ended for e in last)


def _refused_attach(attempt: list[dict]) -> bool:
    """Whether ``attempt`` was a restarted client refused by the live workers (``attach_refused``; in logs from
    before that event, the ``run_failed`` it wrote instead)."""
    return any(e.get("kind") == "attach_refused" or (e.get("kind") == "run_failed" and str(e.get("error", ""))
                                                     .startswith("AttachRefusedError")) for e in attempt)


def refuse_other_programs(history: list[dict], fingerprints: dict | None, programs: ProgramSet, directory: str,
                           steps: int, config: dict, run_dir: pathlib.Path) -> None:
    """Refuses, before anything is written, a resume the workers would refuse: the newest checkpoint this run
    would resume from (as the log recorded it) was written by other programs on the same mesh.

    A ``ConfigError`` naming the programs that differ, the config keys that changed since the attempt that
    wrote it, and how to extend a run. Nothing to say (returns) without checkpoints, without a recorded
    checkpoint or without the fingerprints the writer recorded (a log of an older build: the workers then
    refuse with their own message), or when the mesh changed (the workers reshard, or say why not)."""
    if not fingerprints or not directory:
        return
    saved = _checkpoints_recorded(history, directory, steps)
    if not saved:
        return
    step, index = max(saved)
    writer = attempts(history)[index]
    recorded = next((e.get("fingerprints") for e in writer if e.get("kind") == "programs_built"), None)
    started = next((e for e in writer if e.get("kind") == "job_started"), {})
    run = next((e for e in writer if e.get("kind") == "run_started"), {})
    if not isinstance(recorded, dict):
        return
    if (run.get("devices_per_slice"), started.get("microbatches")) != (programs.devices_per_slice,
                                                                      programs.num_microbatches):
        return
    # A program that only reads the state (eval) is no part of its math: a run that adds or drops eval resumes the
    # same training.
    differ = [name for name in fingerprints
              if name.rpartition("/")[2] not in READ_ONLY_PROGRAMS and recorded.get(name) != fingerprints[name]]
    if not differ:
        return
    then = started.get("config") if isinstance(started.get("config"), dict) else {}
    changed = [f"{k} ({then.get(k)!r} -> {config.get(k)!r})" for k in sorted(set(then) | set(config))
               if then.get(k) != config.get(k)]
    same = "the model's 'init' and 'grad'" if differ == ["apply"] else "the stages' other programs"
    what = (f" ({same} are the same: the optimizer's update changed, where a learning-rate schedule lives)"
            if all(d.rpartition("/")[2] == "apply" for d in differ) else "")
    keys = (f"config keys changed since: {', '.join(changed[:8])}{', ...' if len(changed) > 8 else ''}" if changed
            else "no config key changed, so the code did")
    names = " and ".join(repr(d) for d in differ)
    raise ConfigError(
        f"cannot resume {run_dir}: its checkpoint at step {step} ({directory}) was written by other programs "
        f"(attempt {index + 1}'s): this run's {names} program{'s differ' if len(differ) > 1 else ' differs'}"
        f"{what}; {keys}. To extend a run, keep "
        "everything its programs depend on: a learning-rate schedule must not be built from 'steps' (MaxText: set "
        "learning_rate_schedule_steps to the whole length from the first attempt on; your own optimizer: give "
        "its schedule a fixed length); to start afresh, use another run_name")


def open_log(run_dir: pathlib.Path, *, append: bool, take_over: bool = False, why: str = "",
             also: tuple[str, ...] = (), since: float | None = None) -> EventLog:
    """The run's event log: appended to (this attempt continues the run it holds), or new: an earlier run's
    records under the same name (its log, worker logs, report, TensorBoard files, kept stacks, and the files
    named in ``also``, such as its ``metrics_file``) are first moved aside (:func:`keep_aside`, saying ``why``
    in one line; the logs this attempt wrote since ``since`` stay), never deleted.

    ``take_over`` (a restarted client taking the run back): the log is copied to a new file that replaces
    it, so an earlier client of the run that still has the old one open (a stopped process that wakes up)
    writes only to a file that is no longer the run's: it can never interleave with this client's events."""
    try:
        if take_over:
            path = run_dir / "events.jsonl"
            tmp = run_dir / f".events.jsonl.{os.getpid()}.tmp"
            shutil.copyfile(path, tmp)
            os.replace(tmp, path)
        if not append:
            keep_aside(run_dir, why, also, since)
        return EventLog(run_dir / "events.jsonl")
    except OSError as e:
        raise ConfigError(f"cannot write run files to {run_dir}: {e.strerror or e}; choose a writable "
                          "directory (config key 'base_output_directory')") from None


def keep_aside(run_dir: pathlib.Path, why: str, also: tuple[str, ...] = (), since: float | None = None) -> pathlib.Path | None:
    """Moves the records of an earlier run in ``run_dir`` that this one does not continue into
    ``<run_dir>/earlier/<n>`` (``n`` the first free number from 1) and says so in one line on stderr; returns
    where they went (None: there were none). An earlier run is one whose event log is there.

    Records are everything the run directory holds but its own files (its lock and secret, ``client.json``,
    its checkpoints, ``earlier``): the event log, reports, logs, TensorBoard files, kept stacks; and each path
    of ``also`` that holds something (a ``metrics_file`` outside the directory). A log this attempt wrote to
    already (modified at or after ``since``, its start: the zygote's, started before the log opens) stays.
    Renames only: nothing is copied, nothing deleted; ``elastic report <run_dir>/earlier/<n>`` renders the
    earlier run again. Raises ``OSError`` when a move fails (what moved stays where it went)."""
    log = run_dir / "events.jsonl"
    earlier = log.is_file() and log.stat().st_size > 0   # (what a directory holds without one is this attempt's)
    moved = _records(run_dir, since) if earlier else []
    extra = [pathlib.Path(a) for a in also if a and os.path.isfile(a) and os.path.getsize(a) > 0
             and pathlib.Path(a).resolve().parent != run_dir.resolve()]
    if not moved and not extra:
        return None
    n = 1
    while (run_dir / EARLIER / str(n)).exists():
        n += 1
    aside = run_dir / EARLIER / str(n)
    aside.mkdir(parents=True)
    for name in moved:
        (aside / name).parent.mkdir(parents=True, exist_ok=True)
        os.replace(run_dir / name, aside / name)
    for path in extra:
        os.replace(path, aside / path.name)
    what = ", ".join(moved + [str(p) for p in extra])
    print(f"elastic: {run_dir} holds the records of an earlier run that this one does not continue"
          f"{f' ({why})' if why else ''}: moved {what} to {aside}", file=sys.stderr)
    return aside


def _records(run_dir: pathlib.Path, since: float | None) -> list[str]:
    """The paths, relative to ``run_dir``, that :func:`keep_aside` moves: its entries, and the logs in ``logs``
    one by one (but those written to at or after ``since``)."""
    out = []
    for p in sorted(run_dir.iterdir()):
        if p.name.startswith(".") or p.name in _RUN_FILES or _holds_checkpoints(p) or \
                (p.is_file() and p.stat().st_size == 0):   # (an empty file records nothing)
            continue
        if p.name == "logs" and p.is_dir():
            out += [f"logs/{c.name}" for c in sorted(p.iterdir()) if since is None or c.stat().st_mtime < since]
        else:
            out.append(p.name)
    return out


def _holds_checkpoints(path: pathlib.Path) -> bool:
    """Whether the directory ``path`` holds a complete checkpoint (a run's checkpoint directory under another
    name: never moved aside)."""
    try:
        return path.is_dir() and bool(checkpoint_steps(str(path)))
    except OSError:
        return True   # cannot tell: left where it is


def render(run_dir: pathlib.Path, events_dropped: int) -> tuple[dict, OSError | None]:
    """The run's report, written by render_run, and None; if the files cannot be written, the report built in
    memory and the error (one warning)."""
    try:
        return render_run(run_dir, events_dropped=events_dropped), None
    except OSError as e:
        error = e
        print(f"elastic: warning: cannot write the report files of {run_dir}: {e.strerror or e}", file=sys.stderr)
    try:
        events = read_events(run_dir / "events.jsonl")
    except OSError:
        events = []
    report = build_report(events)
    report["events_dropped"] = max(report["events_dropped"], events_dropped)
    return report, error


def records_lost(run_dir: pathlib.Path, report: dict, events: EventLog, unwritten: OSError | None) -> str:
    """One line saying what of a finished run's records was lost ("" when nothing was)."""
    lost = []
    if events.error is not None or events.dropped:
        why = events.error.strerror or str(events.error) if events.error is not None else "a write failed"
        lost.append(f"the event log {run_dir / 'events.jsonl'} stopped recording ({why}): "
                    f"{events.dropped} events were not recorded")
    if unwritten is not None:
        name = pathlib.Path(unwritten.filename).name.removesuffix(".tmp") if unwritten.filename else "report files"
        lost.append(f"{name} could not be written ({unwritten.strerror or unwritten}), so report.json and "
                    f"report.html in {run_dir} are missing or from before")
    if not lost:
        return ""
    return (f"the run finished, but its records are incomplete (they hold {report.get('steps_completed', 0)} of "
            f"{report.get('steps_requested')} steps): " + "; ".join(lost))
