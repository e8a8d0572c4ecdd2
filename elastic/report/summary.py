"""A short terminal summary of a run, printed by ``elastic run`` at the end.

:func:`print_summary` draws a rich panel from ``report.json`` (a dict);
:func:`summary_text` renders the same panel without colour, for logs and
tests. Both are pure apart from writing to the console, and tolerate fields
missing from older reports.
"""

from __future__ import annotations

import collections
import io

from rich.console import Console
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

__all__ = ["attempt_text", "bubble_text", "failures_text", "pool_text", "print_summary", "resumed_text", "rl_text",
           "summary_panel", "summary_text"]

_VERDICT_STYLE = {"pass": "bold white on green", "fail": "bold white on red"}


def _hit(fault: dict) -> str:
    """Whom a fault hit: its workers (slices), each with the host it hit and those retired with it, if any."""
    if not fault["workers"]:
        return "client"
    hosts, retired = fault.get("hosts") or {}, fault.get("retired") or {}

    def others(w) -> str:   # the slice's other hosts, stopped with it: "(host 0 retired with it)"
        names = list(map(str, retired.get(w) or []))
        return f" (host{'s' if len(names) > 1 else ''} {'+'.join(names)} retired with it)" if names else ""

    return ",".join(w + (f" host {hosts[w]}" if w in hosts else "") + others(w) for w in fault["workers"])


def _seconds(x: float | None) -> str:
    if x is None:
        return "—"
    return f"{1000 * x:.0f} ms" if abs(x) < 1 else f"{x:.1f} s"


def resumed_text(report: dict) -> str:
    """Where the run's last attempt resumed from, in words ("" when it did not): tier, step, directory."""
    r = report.get("resumed_from")
    if not isinstance(r, dict):
        return ""
    text = f"{r.get('tier') or 'checkpoint'} at step {r.get('step')}"
    if r.get("directory"):
        text += f" ({r['directory']})"
    if r.get("comparison"):
        text += f", {r['comparison']}"
    return text


def bubble_text(pipeline: dict) -> str:
    """A pipelined run's schedule and bubble in words (the report's ``pipeline`` section)."""
    def num(x, digits: int = 3) -> str | None:
        return f"{x:.{digits}f}" if isinstance(x, (int, float)) and not isinstance(x, bool) else None

    p = pipeline
    m, share = p.get("microbatches"), p.get("microbatches_per_replica")
    per = f" ({share} per replica)" if share and m and share != m else ""
    shape = f"{p.get('schedule') or '?'}, {p.get('stages')} stages x {m or '?'} microbatches{per}"
    theory = num(p.get("bubble_theoretical")) or "—"
    if num(p.get("bubble_median")) is None:
        return f"{shape}: bubble {theory} in theory, none measured"
    ratio = num(p.get("bubble_ratio"), 2)
    return (f"{shape}: bubble {num(p['bubble_median'])} measured (median of {p.get('steps_measured')} steps), "
            f"{theory} in theory" + (f", ratio {ratio}" if ratio else ""))


def _number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x and abs(x) != float("inf")


def rl_text(rl: dict) -> str:
    """An RL run's reward in words (the report's ``rl`` section): the mean reward of its first steps and of its
    last (3 each), how many steps, and the overlap of the samplers' and the trainers' time."""
    steps = rl.get("steps") if isinstance(rl.get("steps"), list) else []
    first, last, overlap = rl.get("reward_first"), rl.get("reward_last"), rl.get("overlap")
    reward = f"{first:.3f} → {last:.3f}" if _number(first) and _number(last) else "—"
    return (f"{reward} ({len(steps)} steps" + (f"; overlap {100 * overlap:.0f} %" if _number(overlap) else "")
            + ")")


def pool_text(pool: dict) -> str:
    """A pool run's leases in words (the report's ``pool`` section): how many hosts it was leased, how many of
    those leases it gave back because the pool asked (preempted), and its time in the pool's queue."""
    leases = [x for x in pool.get("leases") or [] if isinstance(x, dict)]
    preempted = sum(1 for x in leases if x.get("why") == "preempted")
    queue = pool.get("queue_seconds")
    return (f"{len(leases)} lease(s), {preempted} preempted, "
            + (f"{queue:.1f} s queued" if _number(queue) else "time queued unknown"))


def attempt_text(a: dict) -> str:
    """One later attempt in words: how the one before ended, the gap, where its state came from, what it redid."""
    after = {"finished": "extended a finished run", "died": "restarted after the client was lost",
             "failed": "restarted after a failure", "stopped": "continued after the user stopped it"}.get(str(a.get("after")), "started again")
    gap = a.get("gap_before_s")
    start = a.get("started_from")
    again = a.get("reattached")
    where = ("no state yet" if not isinstance(start, dict)
             else f"re-attached {len(again.get('workers') or [])} live workers at step {start.get('step')}"
             if isinstance(again, dict) and again.get("workers")
             else f"from {start.get('tier') or 'an unrecorded state'} at step {start.get('step')}")
    text = f"{after}" + (f" ({_seconds(gap)} later)" if isinstance(gap, (int, float)) else "") + f", {where}"
    if a.get("steps_recomputed"):
        text += f", {a['steps_recomputed']} committed steps recomputed"
    if a.get("end") != "finished":
        text += f"; {a.get('end')}"
    return text


def loss_text(losses: list) -> str:
    """The first and last recorded loss ("—" for none); steps with no recorded loss (``None``: they came from a
    checkpoint that recorded none) are named, not formatted."""
    recorded = [(i, x) for i, x in enumerate(losses) if isinstance(x, (int, float)) and not isinstance(x, bool)]
    if not recorded:
        return "—" if not losses else f"none recorded ({len(losses)} steps)"
    (first, a), (_, b) = recorded[0], recorded[-1]
    text = f"{a:.4f} → {b:.4f}"
    if first:
        text += f" (steps 0-{first - 1}: no loss recorded)" if first > 1 else " (step 0: no loss recorded)"
    return text


def eval_text(evals: list) -> str:
    """The first and last eval loss, how many evals, and how many were skipped ("" for a run without eval)."""
    done = [e for e in evals if isinstance(e.get("loss"), (int, float))]
    skipped = len(evals) - len(done)
    if not evals:
        return ""
    text = (f"{done[0]['loss']:.4f} → {done[-1]['loss']:.4f} (after steps {done[0]['step']}-{done[-1]['step']}, "
            f"{len(done)} evals)" if done else "none computed")
    return text + (f", {skipped} skipped" if skipped else "")


def failures_text(report: dict) -> str:
    """How many failures the run met, by the path each took: the step loop's (``failures``) and an RL run's
    samplers lost (``rl.samplers_lost``: no failure of the step loop, their rollouts were made by the other
    samplers, path ``reassign``, as their faults say)."""
    failures = [f for f in report.get("failures") or [] if isinstance(f, dict)]
    paths = collections.Counter(f.get("path") or "undecided" for f in failures)
    rl = report.get("rl")
    lost = rl.get("samplers_lost") if isinstance(rl, dict) else None
    if _number(lost) and lost > 0:
        paths["reassign"] += int(lost)
    total = sum(paths.values())
    return f"{total}" + (" (" + ", ".join(f"{n} {p}" for p, n in sorted(paths.items())) + ")" if total else "")


def _checkpoint_failures(report: dict) -> str:
    errors = "; ".join(report.get("checkpoint_errors") or ["no error recorded"])
    return f"{report['checkpoints_failed']} saves ({errors[:160]})"


def _rows(report: dict) -> list[tuple[str, str]]:
    rl = report.get("rl") if isinstance(report.get("rl"), dict) else None
    gp = report.get("goodput") or {}
    wall = report.get("wall_seconds")
    if wall is None:
        wall = gp.get("wall_seconds")
    rows = [
        ("steps", f"{report.get('steps_completed', 0)} / {report.get('steps_requested', '—')}"),
        # an RL run's loss is the clipped policy-gradient loss, about 0 whatever the policy learns: its reward says
        # how training goes (report.json keeps the losses)
        ("reward", rl_text(rl)) if rl is not None else ("loss", loss_text(report.get("losses") or [])),
        *([("eval loss", eval_text(report["evals"]))] if report.get("evals") else []),
        ("slices at end", "—" if report.get("slices_at_end") is None
         else f"{report['slices_at_end']} of {report.get('slices', '—')}"),
        *([("pool", pool_text(report["pool"]))] if isinstance(report.get("pool"), dict) else []),
        ("failures", failures_text(report)),
        ("steps lost", str(report.get("steps_lost", 0))),
        *([("resumed from", resumed_text(report))] if resumed_text(report) else []),
        *[(f"attempt {a.get('attempt')}", attempt_text(a)[:160]) for a in (report.get("attempts") or [])[1:]],
        *([("checkpoints failed", _checkpoint_failures(report))] if report.get("checkpoints_failed") else []),
        ("snapshot / checkpoint restores",
         f"{report.get('snapshot_restores') or 0} / {report.get('checkpoint_restores', 0)}"),
        *([("pipeline", bubble_text(report["pipeline"]))] if isinstance(report.get("pipeline"), dict) else []),
        ("goodput", f"{100 * gp['goodput_fraction']:.1f} %" if "goodput_fraction" in gp else "—"),
        ("wall time", _seconds(wall)),
    ]
    for f in report.get("faults") or []:
        if f.get("skipped"):
            rows.append((f"fault {f['index']}", f"{f['spec']}: skipped ({f['skipped']})"[:120]))
        else:
            rows.append((f"fault {f['index']}", f"{f['spec']} -> {_hit(f)}: detected "
                         f"{_seconds(f['detected_after_s'])}, recovered {_seconds(f['recovered_after_s'])}"
                         + (f" ({f['path']})" if f.get("path") else "")))
    if report.get("trajectory") is not None:
        rows.append(("trajectory", str(report["trajectory"])))
    if report.get("exactly_once") is not None:
        rows.append(("exactly once", "yes" if report["exactly_once"] else "NO"))
    security = report.get("security") or {}
    if security.get("refused_calls"):
        methods = sorted((security.get("by_method") or {}).items(), key=lambda kv: (-kv[1], kv[0]))
        rows.append(("refused calls", f"{security['refused_calls']} unauthenticated ("
                     + ", ".join(f"{m}: {n}" for m, n in methods[:4]) + (", ..." if len(methods) > 4 else "") + ")"))
    if security.get("refused_registrations"):
        rows.append(("refused registrations", str(security["refused_registrations"])))
    if report.get("events_dropped"):
        rows.append(("events dropped", f"{report['events_dropped']} (the event log could not be written; "
                                       "this report is incomplete)"))
    if not report.get("finished", True) and report.get("failure_reason"):
        reason = str(report["failure_reason"])
        rows.append(("failed", reason if len(reason) <= 200 else reason[:199] + "…"))
    return rows


def summary_panel(report: dict) -> Panel:
    """The summary as a rich renderable (a panel around a two-column table)."""
    table = Table.grid(padding=(0, 2))
    table.add_column(style="dim")
    table.add_column()
    verdict = report.get("verdict")
    if verdict is not None:
        # Text, not markup: reasons and values are data and may contain "[".
        table.add_row("verdict", Text(f" {str(verdict).upper()} ", style=_VERDICT_STYLE.get(verdict, "bold")))
        for reason in (report.get("verdict_reasons") or [])[:5]:
            table.add_row("", Text(f"- {reason}"))
    for k, v in _rows(report):
        table.add_row(k, Text(v))
    title = Text(f"run {report.get('run_id') or '?'} ({report.get('mode') or '?'})")
    border = {"pass": "green", "fail": "red"}.get(verdict or "", "blue")
    if not report.get("finished", True):
        border = "red"
    return Panel(table, title=title, title_align="left", border_style=border, expand=False)


def print_summary(report: dict, console: Console | None = None) -> None:
    """Prints the summary panel to ``console`` (default: a new stdout console)."""
    (console or Console()).print(summary_panel(report))


def summary_text(report: dict, width: int = 88) -> str:
    """The summary as plain text (no colour, no control codes), ``width`` columns at most."""
    buf = io.StringIO()
    console = Console(file=buf, width=width, color_system=None, force_terminal=False, legacy_windows=False)
    console.print(summary_panel(report))
    return buf.getvalue()
