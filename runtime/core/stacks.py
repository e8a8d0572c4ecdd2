"""Python stacks of a process's threads, as text: what ``elastic stacks`` shows and what a hung worker leaves.

A worker answers its ``Stacks`` call with :func:`thread_stacks` of its own
process; the client adds its own. When the step watchdog finds a worker stuck
(or silent), or the straggler detector flags one, the client asks it for its
stacks before it is replaced and keeps
them as ``<run_dir>/stacks/<file_name(worker, step)>`` (:func:`stacks_path`),
recorded in the worker's ``worker_dead`` (or ``straggler``) event. Pure but
for reading this process's frames.
"""

from __future__ import annotations

import re
import sys
import threading
import traceback

__all__ = ["MAX_STACKS_CHARS", "STACKS_DIR", "file_name", "format_stacks", "stacks_path", "stacks_text",
           "thread_stacks"]

#: The run directory's folder of stacks kept at a hang.
STACKS_DIR = "stacks"
#: At most this much text per process (the controller's replies are bounded at 1 MiB): the end is cut.
MAX_STACKS_CHARS = 64 * 1024
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def format_stacks(frames: dict, names: dict[int, str], *, limit: int = MAX_STACKS_CHARS) -> str:
    """Every thread's stack, innermost frame last as ``traceback`` prints it, one block per thread headed
    ``Thread <name> (<ident>)``, ordered by name. ``frames``: ``{thread ident: frame}``
    (``sys._current_frames()``); ``names``: ``{ident: thread name}``. Cut to ``limit`` characters."""
    blocks = []
    for ident, frame in sorted(frames.items(), key=lambda kv: (names.get(kv[0], ""), kv[0])):
        stack = "".join(traceback.format_stack(frame))
        blocks.append(f"Thread {names.get(ident, '?')} ({ident}):\n{stack}")
    text = "\n".join(blocks)
    return text if len(text) <= limit else text[:limit] + f"\n... cut at {limit} characters\n"


def thread_stacks() -> str:
    """This process's threads' stacks now (see :func:`format_stacks`)."""
    names = {t.ident: t.name for t in threading.enumerate() if t.ident is not None}
    return format_stacks(sys._current_frames(), names)


def stacks_text(processes) -> str:
    """Several processes' stacks as one text: per process a header ``== <name> on <host>, pid <pid> ==`` then
    its stacks, or ``(no stacks: <error>)``. ``processes``: mappings with ``name``, ``host``, ``pid``, ``text``
    and ``error`` (what ``elastic stacks`` prints and a hung worker's file holds)."""
    parts = []
    for p in processes:
        where = f" on {p['host']}" if p.get("host") else ""
        pid = f", pid {p['pid']}" if p.get("pid") else ""
        body = p.get("text") or f"(no stacks: {p.get('error') or 'no answer'})\n"
        parts.append(f"== {p['name']}{where}{pid} ==\n{body}")
    return "\n".join(parts)


def file_name(worker: str, step: int) -> str:
    """The file a worker's stacks kept at ``step`` go in: ``<worker>-<step>.txt`` (a worker id made safe for a
    file name: anything but letters, digits, ``_``, ``.`` and ``-`` becomes ``_``)."""
    return f"{_UNSAFE.sub('_', worker) or '_'}-{int(step)}.txt"


def stacks_path(worker: str, step: int) -> str:
    """Where a worker's stacks kept at ``step`` lie, relative to the run directory (as its events record it:
    the run directory may move)."""
    return f"{STACKS_DIR}/{file_name(worker, step)}"
