"""``elastic status RUN_DIR`` and ``elastic stacks RUN_DIR``: the whole job from another terminal.

The run directory names where to ask: its ``client.json``
(:mod:`elastic.client_record`) holds the address of the run's client, and
``.secret`` beside it (mode 0600, written for the workers a client launched;
else ``$ELASTIC_RUN_SECRET``) the run secret every call of the run carries.
The client answers from what it holds (:func:`runtime.inspect_run`): each live
worker's step, phase, memory and when it was last heard, and, for ``stacks``,
every thread's Python stack of the client and of each worker's hosts.

The rest of the view is the event log, read, never written: the run state
replayed from it (:class:`runtime.RunState`: who serves which slice, who
died, what is committed), the recovery in progress (the last failure not yet
followed by ``recovered``) and the goodput so far (:func:`elastic.report.goodput`).
When the client is gone (finished, killed) the view is the log's alone.
On a terminal the view is redrawn in place; written to a file or a pipe it
is plain text, one frame per interval, flushed as written (:func:`watch`).

:func:`status_view` is pure (events, the client's answer, the time in); the
rest reads files and calls the client.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import socket
import sys
import time

from elastic import client_record

__all__ = ["BadRunDirError", "RunDir", "ask_client", "cmd_stacks", "cmd_status", "gather", "open_run_dir", "register",
           "render", "status_view", "watch"]

#: Event kinds that end an attempt: after one, no client drives it.
_ENDS = ("run_finished", "run_failed", "run_stopped", "attach_refused")


class BadRunDirError(ValueError):
    """Not a run directory, or a run that never started: the one line says which."""


@dataclasses.dataclass(frozen=True)
class RunDir:
    path: pathlib.Path
    events: list
    record: client_record.ClientRecord | None


def open_run_dir(run_dir) -> RunDir:
    """Reads ``run_dir``'s event log and client record, changing nothing; ``BadRunDirError`` when it is not a run
    directory or its run never started."""
    path = pathlib.Path(run_dir)
    log = path / "events.jsonl"
    if not path.is_dir():
        raise BadRunDirError(f"{path} is not a directory (give the run directory: <base_output_directory>/<run_name>)")
    if not log.is_file():
        raise BadRunDirError(f"{path} is not a run directory: it has no events.jsonl")
    from runtime import read_events

    try:
        events = read_events(log)
    except (OSError, ValueError) as e:
        raise BadRunDirError(f"cannot read {log}: {e}") from None
    if not any(e.get("kind") == "run_started" for e in events):
        raise BadRunDirError(f"the run of {path} never started: its event log has no run_started")
    return RunDir(path, events, client_record.read(path))


def _attempt(events: list) -> list:
    """The events of the log's last attempt (from its last ``job_started``, else the whole log)."""
    starts = [i for i, e in enumerate(events) if e.get("kind") == "job_started"]
    return events[starts[-1]:] if starts else events


def _ended(events: list) -> str | None:
    """The kind that ended the last attempt, or None while it runs (or its client died without a word)."""
    last = next((e for e in reversed(events) if e.get("kind") in (*_ENDS, "job_started", "client_attached")), None)
    return last["kind"] if last is not None and last["kind"] in _ENDS else None


def _recovery(events: list, now: float) -> dict | None:
    """The recovery in progress: the last ``failure_detected`` of the attempt with no ``recovered`` (nor end)
    after it; what it is doing is the last event since."""
    attempt = _attempt(events)
    at = next((i for i in range(len(attempt) - 1, -1, -1) if attempt[i].get("kind") == "failure_detected"), None)
    if at is None or any(e.get("kind") in ("recovered", *_ENDS) for e in attempt[at + 1:]):
        return None
    failure, last = attempt[at], attempt[-1]
    doing = last["kind"]
    for key in ("action", "worker", "reason"):
        if key in last and last is not failure:
            doing += f" ({key} {last[key]})"
            break
    return {"error": failure.get("error"), "detail": str(failure.get("detail", ""))[:200],
            "since_seconds": max(now - float(failure["t"]), 0.0), "doing": doing}


def status_view(events: list, live: dict | None, *, now: float, client: dict | None = None) -> dict:
    """The view of one run, pure: ``events`` its log, ``live`` the client's answer (:func:`runtime.inspect_run`;
    None when the client is gone), ``now`` wall seconds, ``client`` what is known of its client.

    Returns ``{"run_id", "steps", "committed", "ended", "client", "goodput_fraction", "recovery", "slices",
    "spares", "workers", "pool"}``: ``pool`` a pool's run's hosts and queue place (None off a pool); ``slices`` one entry per virtual slice (its worker); ``workers`` one per worker of the
    placement, each sampler and each dead one, with ``role`` (``slice N``, ``spare``, ``sampler`` (an RL run's), ``dead``), ``host``, ``step`` (None
    unknown or none yet), ``phase``, ``lag`` (an active worker's steps behind the furthest one),
    ``heard_seconds``, ``rss_bytes`` and ``hosts`` (a slice of several). From the log alone, ``step`` is the committed step of the active workers.
    """
    from elastic.report import goodput
    from elastic.report.rl import samplers_in
    from runtime import RunState, transitions

    state, served = RunState(), set()   # the run state the log leaves, and every worker that served as a sampler
    for t in transitions(events):
        state, served = t.after, served | samplers_in(t)
    placement = state.placement
    active = list(placement.active) if placement is not None else []
    spares = list(placement.spares) if placement is not None else []
    live_workers = (live or {}).get("workers", {})
    samplers = sorted(served - set(state.dead), key=lambda w: (len(w), w))   # an RL run's
    workers = {}
    for w in [*active, *spares, *samplers, *sorted(state.dead)]:
        if w in workers:
            continue
        info = state.registered.get(w)
        facts = live_workers.get(w) if w not in state.dead else None
        answered = bool(facts and facts.get("answered"))
        role = ("dead" if w in state.dead else f"slice {active.index(w)}" if w in active else
                "sampler" if w in samplers else "spare")
        step = facts["step"] if answered and facts["step"] >= 0 else \
            (state.committed if live is None and w in active else None)
        workers[w] = {
            "role": role, "host": (info.host if info is not None else "") or "",
            "hosts": [h.host for h in info.hosts] if info is not None and info.hosts else [],
            "step": step, "phase": facts["phase"] if answered else ("dead" if w in state.dead else None),
            "phase_seconds": facts["seconds"] if answered else None,
            "heard_seconds": facts.get("heard_seconds") if facts else None,
            "rss_bytes": facts["rss_bytes"] if answered else None,
            "why": state.dead.get(w),
        }
    top = max((workers[w]["step"] for w in active if workers[w]["step"] is not None), default=None)
    for w, v in workers.items():   # a spare computes no step: it lags no one
        v["lag"] = top - v["step"] if top is not None and v["step"] is not None and w in active else None
    return {
        "run_id": state.run_id, "steps": state.steps, "committed": state.committed, "ended": _ended(events),
        "client": {**(client or {}), "answered": live is not None},
        "goodput_fraction": goodput(events)["goodput_fraction"] if events else 0.0,
        "recovery": _recovery(events, now),
        "slices": [{"slice": i, "worker": w} for i, w in enumerate(active)],
        "spares": spares,
        "workers": workers,
        "pool": {"hosts": len(state.leases), "waiting": state.pool_waiting} if state.pooled else None,
    }


def _secret(run_dir: pathlib.Path) -> str:
    return client_record.read_secret(run_dir) or os.environ.get("ELASTIC_RUN_SECRET", "")


def _tls():
    """The TLS files of ``elastic worker``'s variables, when all three are set (a run over mutual TLS)."""
    files = [os.environ.get(v, "") for v in ("ELASTIC_TLS_CERT", "ELASTIC_TLS_KEY", "ELASTIC_TLS_CA")]
    if not all(files):
        return None
    from runtime import TlsFiles

    return TlsFiles(*files)


def _client_alive(record: client_record.ClientRecord) -> bool:
    """Whether the recorded client process runs (on this host; on another, it may: ask it)."""
    if record.host and record.host != socket.gethostname():
        return True
    if record.pid <= 0:
        return False
    try:
        os.kill(record.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def ask_client(rd: RunDir, *, stacks: bool = False, timeout: float = 2.0) -> tuple[dict | None, str]:
    """``(the client's answer, why there is none)``: None with a one-line reason when the run ended, its client is
    gone, no secret is at hand, or it did not answer."""
    from runtime import ElasticError, inspect_run

    if _ended(rd.events):
        return None, f"the run ended ({_ended(rd.events)})"
    if rd.record is None or not rd.record.controller:
        return None, "the run directory names no client (no client.json)"
    if not _client_alive(rd.record):
        return None, f"its client (pid {rd.record.pid}) is not running"
    secret = _secret(rd.path)
    if not secret:
        return None, "no run secret at hand (no readable .secret in the run directory; set ELASTIC_RUN_SECRET)"
    try:
        return inspect_run(rd.record.controller, secret, stacks=stacks, timeout=timeout, tls=_tls()), ""
    except ElasticError as e:
        return None, str(e)


def gather(run_dir, *, now: float | None = None) -> dict:
    """``elastic status --json``'s object for ``run_dir``: :func:`status_view` of its log and its client's answer
    (``client.note`` says why there is none)."""
    rd = open_run_dir(run_dir)
    live, why = ask_client(rd)
    record = rd.record
    client = {"pid": record.pid, "host": record.host, "address": record.controller,
              "generation": record.generation} if record is not None else {}
    if why:
        client["note"] = why
    return status_view(rd.events, live, now=time.time() if now is None else now, client=client)


def _fmt(x, unit: str = "") -> str:
    if x is None:
        return "—"
    if unit == "s":
        return f"{x:.1f} s"
    if unit == "B":
        return f"{x / 2**20:.0f} MiB"
    return str(x)


def render(view: dict):
    """The view as a rich renderable (a title line and a table of workers)."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    c = view["client"]
    head = (f"run {view['run_id']}: {view['committed']} of {view['steps']} steps committed; goodput so far "
            f"{view['goodput_fraction']:.1%}; ")
    head += f"ended ({view['ended']})" if view["ended"] else \
        f"client pid {c.get('pid')} answering" if c.get("answered") else f"from the event log: {c.get('note', '')}"
    lines = [Text(head)]
    if view["recovery"]:
        r = view["recovery"]
        lines.append(Text(f"recovering for {r['since_seconds']:.1f} s from {r['error']}: {r['doing']}", style="yellow"))
    if view.get("pool"):
        p = view["pool"]
        lines.append(Text(f"pool: {p['waiting']}" if p["waiting"] else f"pool: {p['hosts']} host(s) leased",
                          style="yellow" if p["waiting"] else None))
    table = Table(box=None)
    for col in ("worker", "role", "host", "step", "phase", "lag", "last heard", "memory"):
        table.add_column(col)
    for w, v in view["workers"].items():
        phase = v["phase"] or "—"
        if v["phase_seconds"] is not None:
            phase += f" {v['phase_seconds']:.1f} s"
        if v["why"]:
            phase += f": {v['why']}"[:80]
        host = v["host"] + (f" (+{len(v['hosts']) - 1} hosts)" if len(v["hosts"]) > 1 else "")
        table.add_row(w, v["role"], host, _fmt(v["step"]), phase, _fmt(v["lag"]),
                      _fmt(v["heard_seconds"], "s") + (" ago" if v["heard_seconds"] is not None else ""),
                      _fmt(v["rss_bytes"], "B"), style="red" if v["role"] == "dead" else None)
    return Group(*lines, table)


#: ``--interval``'s default: a terminal's live view, and the plain frames written to a file or a pipe.
_INTERVAL_SECONDS = {"terminal": 1.0, "plain": 10.0}


def cmd_status(args) -> int:
    """``elastic status``: once as JSON (``--json``) or as one frame (``--once``); else, until the run ends (or
    Ctrl-C), a live view on a terminal, or plain frames to a file or a pipe (:func:`watch`)."""
    from elastic.cli_support import usage_error

    try:
        view = gather(args.run_dir)
    except BadRunDirError as e:
        return usage_error(str(e))
    if args.json:
        print(json.dumps(view, indent=1))
        return 0
    once = args.once or view["ended"] or not view["client"]["answered"]
    watch(view, lambda: gather(args.run_dir), sys.stdout, interval=args.interval, once=once)
    return 0


def watch(view: dict, next_view, out, *, interval: float | None = None, once: bool = False, sleep=time.sleep) -> None:
    """Shows ``view``, then ``next_view()`` every ``interval`` seconds until the run ends or its client stops
    answering (``once``: ``view`` alone). On a terminal (``out.isatty()``) a live view redrawn in place; to a file
    or a pipe plain frames, each a line with the time and then the view as text (no colour, no cursor moves),
    written and flushed as it comes (default: one per 10 s), so a CI log or ``| cat`` shows the run as it goes,
    and whatever stops the command (SIGTERM, Ctrl-C) leaves every frame it wrote. Ctrl-C ends it quietly; a
    reader that went away (``| head``) ends it too."""
    from rich.console import Console

    terminal = out.isatty()
    interval = interval or _INTERVAL_SECONDS["terminal" if terminal else "plain"]
    if not terminal:
        console = Console(file=out, width=160, color_system=None, force_terminal=False, soft_wrap=True)
        try:
            while True:
                console.print(f"== {time.strftime('%Y-%m-%d %H:%M:%S')} ==", highlight=False)
                console.print(render(view), highlight=False)
                out.flush()
                if once or view["ended"] or not view["client"]["answered"]:
                    return
                sleep(interval)
                view = next_view()
        except KeyboardInterrupt:
            return
        except BrokenPipeError:
            return
    from rich.live import Live

    console = Console(file=out)
    if once:
        console.print(render(view))
        return
    try:
        with Live(render(view), console=console, refresh_per_second=4) as screen:
            while not view["ended"] and view["client"]["answered"]:
                sleep(interval)
                view = next_view()
                screen.update(render(view))
    except KeyboardInterrupt:
        pass


def cmd_stacks(args) -> int:
    """``elastic stacks``: every worker's and the client's Python stacks, asked of the live client."""
    from elastic.cli_support import usage_error
    from runtime import pick_processes, stacks_text

    try:
        rd = open_run_dir(args.run_dir)
    except BadRunDirError as e:
        return usage_error(str(e))
    live, why = ask_client(rd, stacks=True, timeout=args.timeout)
    if live is None:
        kept = rd.path / "stacks"
        also = f"; stacks kept when a worker hung are in {kept}" if kept.is_dir() else ""
        print(f"elastic: error: no stacks: {why} (stacks come from a running client){also}", file=sys.stderr)
        return 1
    try:
        processes = pick_processes(live["stacks"], args.worker or (), client=args.client)
    except ValueError as e:
        return usage_error(str(e))
    print(stacks_text(processes, idle=args.all), end="")
    return 0


def register(sub) -> None:
    """Adds ``status`` and ``stacks`` to the ``elastic`` command line."""
    st = sub.add_parser("status", help="every slice and worker of a run: step, phase, lag, memory, recovery",
                        description="Shows a run from another terminal: live from its client while it runs (the "
                                    "run directory names it), else from its event log.")
    st.add_argument("run_dir")
    st.add_argument("--json", action="store_true", help="print once as JSON (for scripts)")
    st.add_argument("--once", action="store_true", help="print the view once, as text, and exit")
    from runtime import positive_seconds   # (no JAX)

    st.add_argument("--interval", type=positive_seconds, default=None, metavar="SECONDS",
                    help="refresh period (default: 1 on a terminal; 10 for the plain frames written to a file or "
                         "a pipe)")
    st.set_defaults(handler=cmd_status)
    sk = sub.add_parser("stacks", help="the Python stacks of every worker and of the client of a running run",
                        description="Prints the Python stacks of a running run's processes, the threads that wait "
                                    "idle (thread pools' spare workers, gRPC's pollers, streams between messages, "
                                    "accept loops) counted in one line per process instead of shown.")
    sk.add_argument("run_dir")
    sk.add_argument("--worker", action="append", metavar="ID",
                    help="only this worker's stacks (a slice's hosts: all of them); repeat for more")
    sk.add_argument("--client", action="store_true", help="only the client's stacks (with --worker: those too)")
    sk.add_argument("--all", action="store_true", help="every thread, the idle ones too")
    sk.add_argument("--timeout", type=float, default=2.0, metavar="SECONDS",
                    help="how long each worker may take to answer (default: 2)")
    sk.set_defaults(handler=cmd_stacks)
