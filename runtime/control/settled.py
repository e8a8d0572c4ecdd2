"""A ``grpc.Future`` that its owner settles once: a reply, an error, or cancelled.

The controller's futures that are not gRPC's own are this: a step on a step
stream (:class:`runtime.control.step_stream.StepFuture`) and a call to every
host of a slice (:class:`runtime.control.slice_calls.SliceFuture`). Callers
wait on them as on any RPC's future (``result``, ``exception``,
``add_done_callback``); a failed outcome is the ``grpc.RpcError`` the call
would have raised.
"""

from __future__ import annotations

import threading

import grpc

__all__ = ["SettledFuture"]


class SettledFuture(grpc.Future):
    """Settled once by :meth:`_settle`; its callbacks run then (or at once when added after). Thread-safe.
    ``cancel`` settles it cancelled (a subclass adds what cancelling does to its call)."""

    def __init__(self):
        self._cond = threading.Condition()
        self._reply = None
        self._error: grpc.RpcError | None = None
        self._cancelled = False
        self._callbacks: list = []

    def _settle(self, reply=None, error: grpc.RpcError | None = None, cancelled: bool = False) -> bool:
        """Settles it (the first call only: False after); runs the callbacks."""
        with self._cond:
            if self._done():
                return False
            self._reply, self._error, self._cancelled = reply, error, cancelled
            callbacks, self._callbacks = self._callbacks, []
            self._cond.notify_all()
        for fn in callbacks:
            fn(self)
        return True

    def _done(self) -> bool:
        return self._cancelled or self._reply is not None or self._error is not None

    def cancel(self) -> bool:
        return self._settle(cancelled=True)

    def cancelled(self) -> bool:
        return self._cancelled

    def running(self) -> bool:
        return not self.done()

    def done(self) -> bool:
        with self._cond:
            return self._done()

    def _wait(self, timeout: float | None) -> None:
        with self._cond:
            if not self._cond.wait_for(self._done, timeout):
                raise grpc.FutureTimeoutError()

    def result(self, timeout: float | None = None):
        self._wait(timeout)
        if self._cancelled:
            raise grpc.FutureCancelledError()
        if self._error is not None:
            raise self._error
        return self._reply

    def exception(self, timeout: float | None = None):
        self._wait(timeout)
        if self._cancelled:
            raise grpc.FutureCancelledError()
        return self._error

    def traceback(self, timeout: float | None = None):
        self._wait(timeout)
        return None

    def add_done_callback(self, fn) -> None:
        with self._cond:
            if not self._done():
                self._callbacks.append(fn)
                return
        fn(self)
