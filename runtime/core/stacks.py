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

__all__ = ["MAX_STACKS_CHARS", "STACKS_DIR", "file_name", "format_stacks", "idle_place", "pick_processes",
           "stacks_path", "stacks_text", "thread_stacks"]

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


def stacks_text(processes, *, idle: bool = True) -> str:
    """Several processes' stacks as one text: per process a header ``== <name> on <host>, pid <pid> ==`` then
    its stacks, or ``(no stacks: <error>)``. ``processes``: mappings with ``name``, ``host``, ``pid``, ``text``
    and ``error`` (what ``elastic stacks`` prints and a hung worker's file holds). ``idle`` False: the threads
    waiting in an idle place (:func:`idle_place`) are left out, and one line per process counts them by place."""
    parts = []
    for p in processes:
        where = f" on {p['host']}" if p.get("host") else ""
        pid = f", pid {p['pid']}" if p.get("pid") else ""
        body = p.get("text") or f"(no stacks: {p.get('error') or 'no answer'})\n"
        if p.get("text") and not idle:
            body = _busy_only(body)
        parts.append(f"== {p['name']}{where}{pid} ==\n{body}")
    return "\n".join(parts)


def pick_processes(processes, workers=(), *, client: bool = False) -> list:
    """The ``processes`` (as :func:`stacks_text` reads them) of the ``workers`` named (a worker id: its process,
    or every host's of its slice, ``<id>/...``) and, with ``client``, the client's; all of them when neither is
    asked (``elastic stacks --worker ID --client``). ``ValueError`` naming a worker the run has no process of."""
    processes = list(processes)
    if not workers and not client:
        return processes
    names = [p["name"] for p in processes]

    def of(worker, name):
        return name == worker or name.startswith(f"{worker}/")

    for worker in workers:
        if not any(of(worker, n) for n in names):
            raise ValueError(f"no worker {worker!r} in this run (its processes: {', '.join(names)})")
    return [p for p in processes if (client and p["name"] == "client") or any(of(w, p["name"]) for w in workers)]


# Where a thread waits when it has nothing to do: (file name, function) of its innermost frame -> the place.
_IDLE_AT = {
    ("thread.py", "_worker"): "thread-pool workers waiting for work",     # concurrent.futures, waiting for work
    ("_server.py", "_serve"): "gRPC pollers",                  # a gRPC server's completion queue
    ("threading.py", "run"): "in native code (gRPC's pollers)",    # a thread whose target is compiled code
    ("selectors.py", "select"): "event loops in a selector",
    ("socket.py", "accept"): "accepting connections",
}
# ... or a frame among its innermost three: a data-plane connection or stream waiting for its next message.
_IDLE_WITHIN = {("dataplane_wire.py", "read_frame_head"): "streams waiting for their next message"}
_WAITS = {("threading.py", "wait"), ("queue.py", "get"), ("threading.py", "_wait_for_tstate_lock")}
_FRAME = re.compile(r'^ *File "(?P<path>[^"]*)", line \d+, in (?P<function>\S+)', re.MULTILINE)
_LIBRARY = re.compile(r"/(?:lib/python\d[.\d]*|site-packages|dist-packages)/(?!(?:runtime|elastic|chaos|integrations)/)")


def idle_place(block: str) -> str | None:
    """Where the thread of one ``Thread ...`` block of :func:`format_stacks` waits idle, or None when it may be
    doing (or waiting on) the run's work: its innermost frame a thread pool's worker waiting for work, gRPC's
    polling, compiled code with no Python frame above its thread's start, a selector, ``accept``; a data-plane
    stream waiting for its next message; a condition or queue wait with no frame of jax-elastic's (or the user's)
    code on the stack (gRPC's health watches). A wait in jax-elastic's own code (a step waiting for its turn, a
    reduction for a peer's part, the client for its workers' replies) is never idle: in a hang it is the answer."""
    frames = [(m["path"].rsplit("/", 1)[-1], m["function"], m["path"]) for m in _FRAME.finditer(block)]
    if not frames:
        return None
    name, function, _ = frames[-1]
    if (name, function) in _IDLE_AT:
        return _IDLE_AT[name, function]
    for name, function, _ in frames[-3:]:
        if (name, function) in _IDLE_WITHIN:
            return _IDLE_WITHIN[name, function]
    if frames[-1][:2] in _WAITS and all(_LIBRARY.search(path) for _, _, path in frames):
        return "library waits (gRPC health watches)"
    return None


def _busy_only(text: str) -> str:
    """One process's :func:`format_stacks` text without its idle threads, and a line counting them by place."""
    blocks = re.split(r"\n(?=Thread )", text.rstrip("\n"))
    kept, hidden = [], {}
    for block in blocks:
        place = idle_place(block) if block.startswith("Thread ") else None
        if place is None:
            kept.append(block)
        else:
            hidden[place] = hidden.get(place, 0) + 1
    if hidden:
        places = ", ".join(f"{n} {place}" for place, n in sorted(hidden.items(), key=lambda kv: -kv[1]))
        kept.append(f"({sum(hidden.values())} idle threads hidden: {places}; elastic stacks --all shows them)")
    return "\n".join(kept) + "\n"


def file_name(worker: str, step: int) -> str:
    """The file a worker's stacks kept at ``step`` go in: ``<worker>-<step>.txt`` (a worker id made safe for a
    file name: anything but letters, digits, ``_``, ``.`` and ``-`` becomes ``_``)."""
    return f"{_UNSAFE.sub('_', worker) or '_'}-{int(step)}.txt"


def stacks_path(worker: str, step: int) -> str:
    """Where a worker's stacks kept at ``step`` lie, relative to the run directory (as its events record it:
    the run directory may move)."""
    return f"{STACKS_DIR}/{file_name(worker, step)}"
