"""Who a worker process answers to, and how ``ps`` names it.

A locally launched worker (or standby) lives while the run's owner lives:
the client process that launched it, named by its pid (``--owner-pid``).
It watches that process, never its parent: a worker forked from the zygote
has the zygote as its parent, and the zygote is a helper whose death must
cost nothing but itself (each worker stands for a host of its own). When the
owner is gone, the worker exits (status 4).

:class:`Owner` watches one process without being its child: a pidfd where
Linux has them (``os.pidfd_open``: immune to pid reuse), else the process's
start time in ``/proc`` (a reused pid has another), else ``kill(pid, 0)``.

:func:`set_title` gives the process a command line ``ps`` shows (run id,
worker id, host), so an operator can tell a run's processes apart even when
they were all forked from one zygote.
"""

from __future__ import annotations

import os
import select

__all__ = ["Owner", "pid_alive", "set_title"]


class Owner:
    """The process ``pid``, watched from any process (a child, a grandchild, or none of its own)."""

    def __init__(self, pid: int):
        self.pid = pid
        self._fd: int | None = None
        self._start = _start_time(pid)
        self._gone = False
        try:
            self._fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._gone = True    # already gone before we looked
        except (AttributeError, OSError):
            self._fd = None      # no pidfds here: the start time (or kill) tells

    def alive(self) -> bool:
        """Whether the owner still runs (False once it ended, even if its pid was reused since)."""
        if self._gone:
            return False
        if self._fd is not None:
            readable, _, _ = select.select([self._fd], [], [], 0)
            self._gone = bool(readable)   # a pidfd turns readable when its process ends
        elif self._start is not None:
            self._gone = _start_time(self.pid) != self._start
        else:
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                self._gone = True
            except PermissionError:
                pass
        return not self._gone


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` runs now (another user's counts; a zombie does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True   # another user's process
    return not _zombie(pid)


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[:1] == ["Z"]
    except OSError:
        return False


def _start_time(pid: int) -> int | None:
    """The process's start time (clock ticks after boot) from ``/proc``; None when it or ``/proc`` is not there."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return None
    if fields and fields[0] == "Z":
        return None   # a zombie has ended
    return int(fields[19])


def set_title(title: str) -> None:
    """Sets this process's command line as ``ps`` shows it (best effort: unchanged without ``setproctitle``)."""
    try:
        from setproctitle import setproctitle
    except ImportError:
        return
    setproctitle(title)
