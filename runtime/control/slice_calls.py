"""A slice of several hosts behind one stub: every call goes to each of its hosts, and their answers are one.

The control plane decides in slices (the failure unit, :mod:`runtime.core.hosts`);
a slice of H hosts runs one SPMD program over its hosts' devices, so every
call of the run (load the programs, initialize, a step, abort, pull a state,
a digest) is made to each of its hosts with the same request, and they
answer together. :class:`SliceStub` has a ``WorkerStub``'s interface
(``stub.Method(request, timeout=...)`` and ``stub.Method.future(...)``) over
the H hosts' stubs, and is every slice's stub, a slice of one host's too
(its calls are that host's own, unwrapped); :class:`SliceFuture` is the ``grpc.Future`` of one call
to them all. It fails as soon as one host's call fails (the others may be
stuck in a collective with the failed one: waiting for them would wait for
gloo's or NCCL's timeout), and it succeeds once every host answered, with
the hosts' replies made one (:func:`merge_replies`).
"""

from __future__ import annotations

import grpc

from runtime.control.settled import SettledFuture
from runtime.state.state_copy import slice_digest

__all__ = ["SliceFuture", "SliceStub", "merge_replies", "slice_future"]

#: Reply fields that are each host's part of the slice's: summed.
_SUMMED = {"bytes", "state_bytes", "devices_probed", "bytes_sent", "rss_bytes"}
#: Reply fields that say which state a host holds: the hosts must agree, else the slice holds no one state.
_POSITION = {"step", "applied_steps"}
#: Reply fields that hold for the slice only when they hold on every host.
_ALL = {"idle"}


def merge_replies(replies: list):
    """One slice's answer from its hosts' (the same message type, in host order).

    Host 0's, with: a ``digest`` the hosts' combined (:func:`slice_digest`; "" when they hold states of
    different steps, and the step the oldest host's: a restore that ended on different steps is done again);
    byte and device counts summed; ``idle`` only if every host is; seconds the slowest host's; an error any host's (the first). Pure.
    """
    if len(replies) == 1:
        return replies[0]
    out = type(replies[0])()
    out.CopyFrom(replies[0])
    names = {f.name for f in out.DESCRIPTOR.fields}
    agree = all(getattr(r, name) == getattr(out, name) for name in names & _POSITION for r in replies)
    for field in out.DESCRIPTOR.fields:
        name = field.name
        if field.is_repeated or field.message_type is not None:
            continue
        values = [getattr(r, name) for r in replies]
        if name == "digest":
            setattr(out, name, slice_digest(values) if agree else "")
        elif name in _POSITION:
            setattr(out, name, min(values))
        elif name.endswith("error") and field.type == field.TYPE_STRING:
            setattr(out, name, next((v for v in values if v), ""))
        elif name in _SUMMED:
            setattr(out, name, sum(values))
        elif name in _ALL:
            setattr(out, name, all(values))
        elif name.endswith("seconds") and field.type in (field.TYPE_DOUBLE, field.TYPE_FLOAT):
            setattr(out, name, max(values))
    return out


class SliceFuture(SettledFuture):
    """One call to every host of a slice: a ``grpc.Future`` of their one answer (:func:`merge_replies`).

    Done when every host answered, or at the first host's failure (that error, or its cancellation, is its
    outcome, and the other hosts' calls are cancelled); cancelling it cancels every host's call. Thread-safe.
    """

    def __init__(self, futures: list[grpc.Future]):
        super().__init__()
        self._futures = list(futures)
        self._left = len(self._futures)
        for f in self._futures:
            f.add_done_callback(self._host_done)

    def _host_done(self, f: grpc.Future) -> None:
        if f.cancelled() or f.exception() is not None:
            settled = self._settle(cancelled=True) if f.cancelled() else self._settle(error=f.exception())
            if settled:   # the others are left to their own ends: cancel them
                for g in self._futures:
                    if g is not f:
                        g.cancel()
            return
        with self._cond:
            self._left -= 1
            last = self._left == 0
        if last:
            try:
                reply = merge_replies([g.result() for g in self._futures])
            except Exception as e:  # noqa: BLE001 - replies that do not merge: the call failed
                self._settle(error=_Unmerged(e))
                return
            self._settle(reply=reply)

    def cancel(self) -> bool:
        if self.done():
            return False
        for f in self._futures:
            f.cancel()
        return True


class _Unmerged(grpc.RpcError):
    """The hosts of a slice answered what is not one answer (a bug, not a lost host)."""

    def __init__(self, error: Exception):
        super().__init__(f"the hosts' answers do not merge: {error}")
        self._details = str(self)

    def code(self):
        return grpc.StatusCode.INTERNAL

    def details(self):
        return self._details


def slice_future(futures: list[grpc.Future]) -> grpc.Future:
    """One call to a slice's hosts as one future: a slice of one host's is its host's own."""
    return futures[0] if len(futures) == 1 else SliceFuture(futures)


class _FanOut:
    """One method of a :class:`SliceStub`: called (blocking) or ``.future(...)``, on every host at once."""

    def __init__(self, methods: list):
        self._methods = methods

    def future(self, request, timeout: float | None = None, **kwargs) -> grpc.Future:
        return slice_future([m.future(request, timeout=timeout, **kwargs) for m in self._methods])

    def __call__(self, request, timeout: float | None = None, **kwargs):
        if len(self._methods) == 1:   # a slice of one host: its own call (its errors as they are)
            return self._methods[0](request, timeout=timeout, **kwargs)
        return self.future(request, timeout=timeout, **kwargs).result()


class SliceStub:
    """A ``WorkerStub`` of a whole slice: ``stub.Method`` calls ``Method`` on each host's stub (in host order);
    ``hosts``: those stubs (one for a slice of one host)."""

    def __init__(self, stubs: list):
        if not stubs:
            raise ValueError("a slice has at least one host")
        self.hosts = list(stubs)

    def __getattr__(self, method: str) -> _FanOut:
        if method.startswith("_"):
            raise AttributeError(method)
        return _FanOut([getattr(s, method) for s in self.hosts])
