"""The SVG pieces of ``report.html``: the timeline, the loss and reward curves and the goodput bar.

Pure functions from events, intervals and numbers to SVG text (inline, no
scripts); every piece of text is escaped. :mod:`elastic.report.html` lays
them out on the page.
"""

from __future__ import annotations

import html
import math
import sys

from runtime import RunState

__all__ = ["COLORS", "PHASE_COLORS", "bar_svg", "esc", "finite", "first_time", "fmt_seconds", "loss_svg", "phase_color",
           "reward_svg", "slice_counts", "timeline_svg"]


def esc(x: object) -> str:
    """``x`` as text safe inside HTML or SVG (``None`` is empty)."""
    return html.escape("" if x is None else str(x), quote=True)


def first_time(events: list[dict]) -> float:
    """When the first event happened (unix seconds); 0.0 for no events."""
    return min(float(e["t"]) for e in events) if events else 0.0


#: Fill colour of each goodput label (bands, bar, legend).
COLORS = {"productive": "#43a047", "startup": "#1e88e5", "compile": "#8e24aa", "data": "#00897b",
          "checkpoint_save": "#6d4c41", "checkpoint_restore": "#a1887f", "detection": "#fb8c00",
          "recovery": "#fdd835", "wasted_progress": "#e53935", "other": "#9e9e9e"}
#: Fill colour of a worker's step phases (a pipeline stage's bar): computing green, waiting for a neighbouring
#: stage red, the stage's reduction blue, the update purple; any other phase grey (:func:`phase_color`).
PHASE_COLORS = {"forward": "#66bb6a", "backward": "#2e7d32", "pipeline_wait": "#e53935", "pipeline_send": "#fb8c00",
                "local_sum": "#90caf9", "send": "#64b5f6", "wait_for_peers": "#1e88e5", "reduce_add": "#1565c0",
                "gather_copy": "#0d47a1", "apply": "#8e24aa"}
_MARKERS = {"fault_injected": "#d32f2f", "failure_detected": "#ef6c00", "recovered": "#2e7d32", "grown": "#2e7d32",
            "released": "#0277bd", "attempt_started": "#6a1b9a", "run_resumed": "#6a1b9a"}


def fmt_seconds(x: float | None) -> str:
    """Seconds for people: ``—`` for None, ms below one second."""
    if x is None:
        return "—"
    return f"{1000 * x:.0f} ms" if abs(x) < 1 else f"{x:.2f} s"


def finite(v: object) -> bool:
    """Whether ``v`` is a number (not a bool) with a finite float value, something a chart can place."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:   # an int beyond the float range
        return False


def _half_span(lo: float, hi: float) -> float:
    """``(hi - lo) / 2`` without overflowing when both are near the float maximum."""
    return hi / 2 - lo / 2


def _ticks(lo: float, hi: float, n: int = 8, integer: bool = False) -> list[float]:
    """Round tick values covering [lo, hi], about ``n`` of them (whole numbers only if ``integer``).

    Any finite ``lo`` and ``hi`` work, up to the float maximum; a range that is empty, not finite or too
    narrow to divide gives ``[lo]`` (``[]`` when ``lo`` is not finite either).
    """
    lo, hi = float(lo), float(hi)
    if not math.isfinite(lo):
        return []
    half = _half_span(lo, hi)
    raw = half / n * 2   # (hi - lo) / n
    if integer:
        raw = max(raw, 1.0)
    if not (hi > lo and raw > 0 and math.isfinite(raw)):
        return [lo]
    mag = 10.0 ** math.floor(math.log10(raw))
    step = next((m * mag for m in ((1, 2, 5, 10) if integer else (1, 2, 2.5, 5, 10)) if m * mag >= raw), math.inf)
    if not math.isfinite(step):
        return [lo, hi]
    first = math.ceil(lo / step - 1e-9) * step
    return [first + i * step for i in range(int(_half_span(first, hi) / step * 2 + 1e-9) + 1)]


def _tick_label(v: float) -> str:
    return f"{v:.0f}" if abs(v - round(v)) < 1e-9 else f"{v:g}"


def _text(x: float, y: float, s: object, size: int = 11, anchor: str = "start", fill: str = "#444",
          extra: str = "") -> str:
    return (f"<text x='{x:.1f}' y='{y:.1f}' font-size='{size}' text-anchor='{anchor}' fill='{fill}' {extra}>"
            f"{esc(s)}</text>")


def _marker_label(e: dict) -> str:
    kind = e["kind"]
    if kind == "fault_injected":
        what = str(e.get("fault_kind") or e.get("fault") or "")
        return f"fault #{e.get('index', '?')} {what[:28]}".strip()
    if kind == "failure_detected":
        return f"detected: {e.get('worker') or e.get('error', '')}"
    if kind == "recovered":
        return f"recovered: {e.get('path', '')}"
    if kind == "attempt_started":   # html.py's marker for a later attempt's job_started
        gap = e.get("gap_before_s")
        after = {"finished": "idle", "died": "down", "failed": "down"}.get(str(e.get("after")), "after")
        return (f"attempt {e.get('attempt', '?')}" + (f" ({after} {fmt_seconds(gap)})" if finite(gap) else ""))
    if kind == "run_resumed":
        return f"resumed from {e.get('tier', '?')} step {e.get('step', '?')}"
    if kind == "released":
        return f"gave back to the pool: {len(e.get('active') or [])} left"
    return f"grown to {len(e.get('active') or [])}"


def slice_counts(events: list[dict]) -> list[tuple[float, int]]:
    """``(seconds since the first event, active slices)`` each time the count changes, as the run's
    :class:`~runtime.RunState` folds its placement (every event that moves it: the first placement, an adopted
    recovery, a grow, a swap, a release to a shared pool), so the lane says what the run's state says."""
    t0, state, out = first_time(events), RunState(), []
    for e in events:
        before, state = state, state.apply(e)
        if state.placement is not before.placement and state.placement is not None:
            k = len(state.placement.active)
            if not out or out[-1][1] != k:
                out.append((float(e["t"]) - t0, k))
    return out


def timeline_svg(events: list[dict], ivs: list, lo: float, hi: float, *, svg_id: str, max_slices: int,
                 slices: list[tuple[float, int]] | None = None) -> str:
    """Steps committed over wall time in [lo, hi] s, goodput bands, fault markers and a slices lane (``slices``:
    :func:`slice_counts` of ``events``, computed here when not given)."""
    t0 = first_time(events)
    labelled = any(e["kind"] in _MARKERS and lo <= float(e["t"]) - t0 <= hi for e in events)
    W, L, R, top, ph, rib, gap, sh, bot = 1200, 58, 18, 50 if labelled else 16, 170, 10, 14, 50, 30
    H = top + ph + rib + gap + sh + bot
    span = max(hi - lo, 1e-9)

    def x(t: float) -> float:
        return L + (min(max(t, lo), hi) - lo) / span * (W - L - R)

    commits, seen = [], 0
    for e in events:
        if e["kind"] == "step_committed" and int(e.get("step", seen)) >= seen:
            seen = int(e.get("step", seen)) + 1
            commits.append((float(e["t"]) - t0, seen, bool(e.get("recovered"))))
    ymax = max(seen, 1)

    def y(n: float) -> float:
        return top + ph - n / ymax * ph

    out = [f"<svg id='{svg_id}' viewBox='0 0 {W} {H}' width='100%' role='img' "
           f"aria-label='committed steps over wall time'>"]
    for s, e, lab in ivs:
        if e <= lo or s >= hi:
            continue
        out.append(f"<rect x='{x(s):.1f}' y='{top}' width='{max(x(e) - x(s), 0.5):.1f}' height='{ph}' "
                   f"fill='{COLORS[lab]}' fill-opacity='0.13'><title>{esc(lab)} {esc(fmt_seconds(e - s))}</title></rect>")
        out.append(f"<rect x='{x(s):.1f}' y='{top + ph}' width='{max(x(e) - x(s), 0.5):.1f}' height='{rib}' "
                   f"fill='{COLORS[lab]}'/>")
    for v in _ticks(0, ymax, 5, integer=True):
        out.append(f"<line x1='{L}' x2='{W - R}' y1='{y(v):.1f}' y2='{y(v):.1f}' stroke='#e3e6ea'/>")
        out.append(_text(L - 6, y(v) + 4, _tick_label(v), anchor="end"))
    ybase = top + ph + rib + gap + sh
    for v in _ticks(lo, hi, 10):
        out.append(f"<line x1='{x(v):.1f}' x2='{x(v):.1f}' y1='{ybase}' y2='{ybase + 4}' stroke='#888'/>")
        out.append(_text(x(v), ybase + 17, _tick_label(v), anchor="middle"))
    out.append(_text(W - R, H - 2, "seconds since run start", anchor="end", fill="#777"))
    out.append(_text(14, top + ph / 2, "steps committed", anchor="middle",
                     extra=f"transform='rotate(-90 14 {top + ph / 2})'"))
    # the committed-steps staircase
    before = [c for c in commits if c[0] < lo]
    n = before[-1][1] if before else 0
    path = [f"M{x(lo):.1f},{y(n):.1f}"]
    for t, count, _ in commits:
        if lo <= t <= hi:
            path.append(f"H{x(t):.1f}V{y(count):.1f}")
    path.append(f"H{x(min(hi, ivs[-1][1] if ivs else hi)):.1f}")
    out.append(f"<path d='{''.join(path)}' fill='none' stroke='#1a237e' stroke-width='2'/>")
    shown = [c for c in commits if lo <= c[0] <= hi]
    if len(shown) <= 300:
        out += [f"<circle cx='{x(t):.1f}' cy='{y(c):.1f}' r='{3.2 if rec else 2.2}' "
                f"fill='{'#2e7d32' if rec else '#1a237e'}'/>" for t, c, rec in shown]
    # the active-slices lane
    lane_top = top + ph + rib + gap
    changes = slice_counts(events) if slices is None else slices
    smax = max(max_slices, *(k for _, k in changes), 1)
    out.append(f"<rect x='{L}' y='{lane_top}' width='{W - L - R}' height='{sh}' fill='#f7f9fb' stroke='#e3e6ea'/>")
    out.append(_text(L - 6, lane_top + sh / 2 + 4, "slices", anchor="end"))
    if changes:
        ys = lambda k: lane_top + sh - 4 - k / smax * (sh - 14)  # noqa: E731
        cur = 0
        pts = [f"{x(lo):.1f},{ys(0):.1f}"]
        for t, k in changes:
            if t > lo:
                pts.append(f"{x(t):.1f},{ys(cur):.1f}")
            pts.append(f"{x(t):.1f},{ys(k):.1f}")
            if lo <= t <= hi:
                out.append(_text(x(t) + 3, ys(k) - 3, k, size=10, fill="#0d47a1"))
            cur = k
        end = x(ivs[-1][1] if ivs else hi)
        pts += [f"{end:.1f},{ys(cur):.1f}", f"{end:.1f},{ys(0):.1f}"]
        out.append(f"<polygon points='{' '.join(pts)}' fill='#90caf9' fill-opacity='0.6' stroke='#1565c0'/>")
    else:
        out.append(_text(L + 8, lane_top + sh / 2 + 4, "no slices (reference mode: one process)", fill="#777"))
    # markers: faults, detections, recoveries; labels in three rows, dropped where they would overlap
    row_end = [-1e9, -1e9, -1e9]
    for e in events:
        color = _MARKERS.get(e["kind"])
        t = float(e["t"]) - t0
        if color is None or not lo <= t <= hi:
            continue
        xm = x(t)
        out.append(f"<line x1='{xm:.1f}' x2='{xm:.1f}' y1='{top - 6}' y2='{lane_top + sh}' stroke='{color}' "
                   f"stroke-width='1.6' stroke-dasharray='5 3'><title>{esc(_marker_label(e))}</title></line>")
        label = _marker_label(e)
        width = 7.0 * len(label)   # bold 11 px text, a little wider than the average character
        # right of the line, or left of it near the right edge: a row whose labels all end before this one's
        # left end takes it
        anchor, lx, left, right = (("end", xm - 3, xm - 3 - width, xm - 3) if xm + 3 + width > W - R
                                   else ("start", xm + 3, xm + 3, xm + 3 + width))
        row = next((r for r in range(3) if row_end[r] < left - 6), None)
        if row is not None:
            out.append(_text(lx, 14 + 14 * row, label, size=11, anchor=anchor, fill=color,
                             extra="font-weight='bold'"))
            row_end[row] = right
    out.append("</svg>")
    return "".join(out)


def _value_range(series: list[float]) -> tuple[float, float]:
    """The y range of a chart of ``series`` (finite numbers, not empty): 8 % of its range on each side; a single
    value gets 5 % of its size (at least 0.5), so the range never has zero width, and it stays inside the floats
    however close to the maximum the values come."""
    lo, hi = min(series), max(series)
    pad = _half_span(lo, hi) * 0.16 or max(abs(lo) * 0.05, 0.5)
    return max(lo - pad, -sys.float_info.max), min(hi + pad, sys.float_info.max)


class _Plot:
    """A chart's frame: ``W`` x ``H`` with margins ``L``, ``R``, ``T``, ``B``, x from ``x0`` to ``x1`` (steps),
    y from ``lo`` to ``hi``; :meth:`x` and :meth:`y` place a value."""

    def __init__(self, W: int, H: int, L: int, R: int, T: int, B: int, x0: float, x1: float, lo: float,
                 hi: float):
        self.W, self.H, self.L, self.R, self.T, self.B = W, H, L, R, T, B
        self.x0, self.x1, self.lo, self.hi = x0, max(x1, x0 + 1), lo, hi
        self.half = _half_span(lo, hi)

    def x(self, i: float) -> float:
        return self.L + (i - self.x0) / (self.x1 - self.x0) * (self.W - self.L - self.R)

    def y(self, v: float) -> float:
        return self.T + (self.hi / 2 - v / 2) / self.half * (self.H - self.T - self.B)

    def grid(self) -> list[str]:
        """Horizontal grid lines with their values, and the step ticks under the x axis."""
        out = []
        for v in _ticks(self.lo, self.hi, 5):
            out.append(f"<line x1='{self.L}' x2='{self.W - self.R}' y1='{self.y(v):.1f}' y2='{self.y(v):.1f}' "
                       f"stroke='#e3e6ea'/>")
            out.append(_text(self.L - 6, self.y(v) + 4, f"{v:.3g}", anchor="end"))
        for v in self.step_ticks():
            out.append(_text(self.x(v), self.H - self.B + 16, _tick_label(v), anchor="middle"))
        return out

    def step_ticks(self) -> list[float]:
        return _ticks(self.x0, self.x1, 8, integer=True)

    def step_lines(self, steps: list, color: str, what: str) -> list[str]:
        """A dashed vertical line at each step (``what at step N`` as its tooltip)."""
        return [f"<line x1='{self.x(s):.1f}' x2='{self.x(s):.1f}' y1='{self.T}' y2='{self.H - self.B}' "
                f"stroke='{color}' stroke-dasharray='4 3'><title>{esc(what)} at step {esc(s)}</title></line>"
                for s in steps]

    def polyline(self, points: list[tuple[float, float]], style: str) -> str:
        pts = " ".join(f"{self.x(i):.1f},{self.y(v):.1f}" for i, v in points if finite(v))
        return f"<polyline points='{pts}' fill='none' {style}/>"

    def legend(self, items: list[tuple[str, str]], width: int = 90) -> list[str]:
        """``(colour, name)`` swatches in a row at the top right, above the plot (``T`` leaves room for it)."""
        out = []
        for i, (c, name) in enumerate(items):
            lx = self.W - self.R - width * len(items) + i * width
            out.append(f"<rect x='{lx}' y='{self.T - 16}' width='14' height='4' fill='{c}'/>"
                       + _text(lx + 18, self.T - 10, name))
        return out


def loss_svg(losses: list[float], ref: list[float] | None, fail_steps: list[int], diverge: int | None, *,
             svg_id: str) -> str:
    """Loss per committed step, with the reference run's losses dashed when present.

    Values that are not finite numbers (a diverged loss, a step that is not a number) are left out.
    """
    W, H, L, R, T, B = 580, 270, 52, 12, 28, 40
    fail_steps = [s for s in fail_steps if finite(s)]
    diverge = diverge if finite(diverge) else None
    series = [float(v) for v in list(losses) + list(ref or []) if finite(v)]
    if not series:
        return f"<svg id='{svg_id}' viewBox='0 0 {W} 60' width='100%'>{_text(10, 30, 'no committed steps')}</svg>"
    n = max(len(losses), len(ref or []), 2)
    p = _Plot(W, H, L, R, T, B, 0, n - 1, *_value_range(series))
    out = [f"<svg id='{svg_id}' viewBox='0 0 {W} {H}' width='100%' role='img' aria-label='loss per step'>"]
    out += p.grid()
    out.append(_text(W - R, H - 4, "step", anchor="end", fill="#777"))
    out += p.step_lines(fail_steps, "#ef6c00", "failure")
    if diverge is not None:
        out.append(f"<line x1='{p.x(diverge):.1f}' x2='{p.x(diverge):.1f}' y1='{T}' y2='{H - B}' stroke='#c62828' "
                   f"stroke-width='2'/>" + _text(p.x(diverge) + 4, T + 12, f"diverged at {diverge}", fill="#c62828"))
    if ref:
        out.append(p.polyline(list(enumerate(ref)), "stroke='#9e9e9e' stroke-width='4' stroke-opacity='0.6'"))
    out.append(p.polyline(list(enumerate(losses)), "stroke='#1a237e' stroke-width='1.6'"))
    out += p.legend([("#1a237e", "this run")] + ([("#9e9e9e", "reference")] if ref else [])
                    + ([("#ef6c00", "failure")] if fail_steps else []))
    out.append("</svg>")
    return "".join(out)


def reward_svg(steps: list[dict], fail_steps: list[int], sampler_steps: list[int], *, svg_id: str) -> str:
    """An RL run's mean reward per committed step (the report's ``rl.steps``), each point with the weights
    version its rollouts were made with: in its tooltip, and in a second row under the step ticks. Dashed
    lines mark the steps of failures (trainers lost) and of samplers lost (``sampler_steps``).

    Steps whose step or reward is not a finite number are left out.
    """
    W, H, L, R, T, B = 580, 280, 68, 12, 28, 54
    pts = sorted((s["step"], float(s["mean_reward"]), s.get("version")) for s in steps
                 if isinstance(s, dict) and finite(s.get("step")) and finite(s.get("mean_reward")))
    if not pts:
        return f"<svg id='{svg_id}' viewBox='0 0 {W} 60' width='100%'>{_text(10, 30, 'no committed steps')}</svg>"
    p = _Plot(W, H, L, R, T, B, pts[0][0], pts[-1][0], *_value_range([v for _, v, _ in pts]))
    fail_steps = [s for s in fail_steps if finite(s) and p.x0 <= s <= p.x1]
    sampler_steps = [s for s in sampler_steps if finite(s) and p.x0 <= s <= p.x1]
    out = [f"<svg id='{svg_id}' viewBox='0 0 {W} {H}' width='100%' role='img' "
           f"aria-label='mean reward per step, with the weights version of its rollouts'>"]
    out += p.grid()
    # the second row: the weights version of the step at each tick
    version = {s: v for s, _, v in pts}
    row = H - B + 32
    out.append(_text(4, H - B + 16, "step", size=10, fill="#777"))
    out.append(_text(4, row, "version", size=10, fill="#6a1b9a"))
    for s in p.step_ticks():
        v = version.get(int(s)) if s == int(s) else None
        if v is not None:   # a tick past the last step (one step: its axis spans two) has none
            out.append(_text(p.x(s), row, v, size=10, anchor="middle", fill="#6a1b9a"))
    out += p.step_lines(fail_steps, "#ef6c00", "failure")
    out += p.step_lines(sampler_steps, "#00897b", "sampler lost")
    out.append(p.polyline([(s, v) for s, v, _ in pts], "stroke='#2e7d32' stroke-width='1.6'"))
    dots = len(pts) <= 300
    for s, v, ver in pts:
        lag = f", {s - ver} behind" if finite(ver) and s - ver > 0 else ""
        tip = f"step {s}: mean reward {v:.4g}, weights v{ver if ver is not None else '?'}{lag}"
        out.append(f"<circle cx='{p.x(s):.1f}' cy='{p.y(v):.1f}' r='{2.6 if dots else 1}' fill='#2e7d32'>"
                   f"<title>{esc(tip)}</title></circle>")
    out += p.legend([("#2e7d32", "mean reward")] + ([("#ef6c00", "failure")] if fail_steps else [])
                    + ([("#00897b", "sampler lost")] if sampler_steps else []), width=100)
    out.append("</svg>")
    return "".join(out)


def phase_color(name: str) -> str:
    return PHASE_COLORS.get(name, COLORS["other"])


def bar_svg(parts: list[tuple[str, float]], wall: float, *, color=COLORS.__getitem__,
            what: str = "goodput breakdown") -> str:
    """One horizontal bar split by label (a goodput label, or with ``color`` any), widths proportional to
    seconds out of ``wall``."""
    W, H = 580, 34
    out = [f"<svg viewBox='0 0 {W} {H + 6}' width='100%' role='img' aria-label='{esc(what)}'>",
           f"<rect x='0' y='3' width='{W}' height='{H}' fill='#eceef1' rx='4'/>"]
    xpos = 0.0
    for lab, v in parts:
        w = v / wall * W if wall > 0 else 0.0
        if w <= 0:
            continue
        out.append(f"<rect x='{xpos:.1f}' y='3' width='{w:.1f}' height='{H}' fill='{color(lab)}'>"
                   f"<title>{esc(lab)} {v:.2f} s</title></rect>")
        if w > 42:
            out.append(_text(xpos + w / 2, H / 2 + 7, f"{100 * v / wall:.0f}%", size=12, anchor="middle",
                             fill="#fff" if lab not in ("recovery", "other") else "#222"))
        xpos += w
    out.append("</svg>")
    return "".join(out)
