"""The run report: the fold of ``events.jsonl``, goodput, ``report.html`` and the terminal summary.

Sits below its users: the trainer (``elastic``), the chaos harness
(``chaos``) and ``elastic report`` import it; it imports only ``runtime``'s
public surface and itself (a layout test enforces that).

- :mod:`~elastic.report.fold`: :func:`build_report`, ``report.json`` as a pure fold of the log.
- :mod:`~elastic.report.goodput`: :func:`goodput`, :func:`intervals`, where the wall time went.
- :mod:`~elastic.report.html` (with :mod:`~elastic.report.charts`): :func:`render_html`, the page.
- :mod:`~elastic.report.render`: :func:`render_run`, the one writer of a run's report files.
- :mod:`~elastic.report.summary`: :func:`print_summary`, :func:`summary_text`, the terminal panel.
- :mod:`~elastic.report.chromium`: headless Chromium on a rendered page (screenshots, DOM).
"""

from elastic.report.chromium import CHROMIUM, ChromiumError, chromium_dom, chromium_screenshot
from elastic.report.fold import REPORT_VERSION, build_report
from elastic.report.goodput import BADPUT_LABELS, LABELS, goodput, intervals
from elastic.report.html import render_html, write_html
from elastic.report.render import render_run, write_report
from elastic.report.summary import print_summary, summary_panel, summary_text

__all__ = [
    "BADPUT_LABELS",
    "CHROMIUM",
    "ChromiumError",
    "LABELS",
    "REPORT_VERSION",
    "build_report",
    "chromium_dom",
    "chromium_screenshot",
    "goodput",
    "intervals",
    "print_summary",
    "render_html",
    "render_run",
    "summary_panel",
    "summary_text",
    "write_html",
    "write_report",
]
