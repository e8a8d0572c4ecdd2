"""The controller's end of the step stream: one long-lived ``Steps`` stream per worker instead of a unary ``Step``
call per worker per step (the worker's end: :mod:`runtime.worker.step_stream`).

:meth:`StepStreams.send` writes a step's request on its worker's stream and
returns a :class:`StepFuture`, a ``grpc.Future`` whose outcome is what the
unary call's would have been: the reply, a ``grpc.RpcError`` the worker
answered (:class:`runtime.wire.rpc.StatusError`, read by
:func:`runtime.wire.rpc.to_error` as a failed call), the stream's own error
when it broke (the worker died: UNAVAILABLE, as its call would have ended),
or ``DEADLINE_EXCEEDED`` once ``step_seconds`` passed without an answer.
Answers are matched to requests by ``(epoch, step)``: after a recovery the
same step is sent again in a new epoch, and a late answer of the old one
resolves nothing.

A stream lives at most ``stream_seconds`` for new requests (every call has
a deadline); the next request then opens a new one, and the old one ends
once the steps sent on it answered. A worker declared dead has its stream
closed (:meth:`StepStreams.drop`). One thread per open stream reads its
answers (a run has a few workers per client, not the thousands the health
monitor watches). On gRPC's sync API each message also wakes two threads
of gRPC's own (a request consumer and the channel's poller); on a
data-plane connection the request is one write from the caller's thread
and the answer one read on the stream's, which is why it is the default.
Every answer that is not an error is also passed to
``heard(worker, sent_at)`` (the health monitor's
:meth:`~runtime.control.health.HealthMonitor.heard`: a worker answering
steps needs no Check).
"""

from __future__ import annotations

import queue
import socket
import struct
import threading
import time
from collections.abc import Callable

import grpc

from runtime._proto import elastic_pb2 as pb
from runtime.control.settled import SettledFuture
from runtime.core.errors import ProtocolError
from runtime.wire.dataplane_client import RemoteError, check_reply
from runtime.wire.dataplane_wire import END, REPLY, STEP, parse_message, read_frame_head, recv_bytes, send_frame, shut
from runtime.wire.rpc import StatusError

__all__ = ["StepFuture", "StepStreams"]

STREAM_SECONDS = 3600.0   # a stream takes new requests this long (its deadline: that and a step's)


class StepFuture(SettledFuture):
    """One step of one worker in flight on a step stream: a ``grpc.Future`` of its ``StepReply``."""

    def __init__(self, key: tuple[int, int], sent: float, deadline: float, on_cancel: Callable[["StepFuture"], None]):
        super().__init__()
        self.key, self.sent, self.deadline, self._on_cancel = key, sent, deadline, on_cancel

    def cancel(self) -> bool:
        if not super().cancel():
            return False
        self._on_cancel(self)
        return True


class _Stream:
    """One open step stream to one worker: its requests' futures, and a thread reading its answers. The
    transport is a subclass's: gRPC's ``Steps`` (:class:`_GrpcStream`) or a data-plane connection
    (:class:`_SocketStream`)."""

    def __init__(self, forget: Callable[["_Stream"], None], heard: Callable[[float], None] | None):
        self.opened = time.monotonic()
        self._heard = heard
        self._lock = threading.Lock()
        self._pending: dict[tuple[int, int], StepFuture] = {}
        self._closed = False
        self._error: grpc.RpcError | None = None   # how it ended, when it ended with an error
        self._forget = forget

    def send(self, request: pb.StepRequest, step_seconds: float) -> StepFuture:
        now = time.monotonic()
        fut = StepFuture((request.fence.epoch, request.step), now, now + step_seconds, self._cancelled)
        with self._lock:
            if self._closed:   # a request that came after the stream ended fails as the stream did (refused...)
                fut._settle(error=self._error or StatusError(grpc.StatusCode.UNAVAILABLE, "the step stream is closed"))
                return fut
            self._pending[fut.key] = fut
        self._write(request)
        return fut

    def _cancelled(self, fut: StepFuture) -> None:
        with self._lock:
            if self._pending.get(fut.key) is fut:
                del self._pending[fut.key]

    def close(self, cancel: bool = False) -> None:
        """No more requests on this stream; ``cancel``: end it now (its steps in flight fail as the call would)."""
        with self._lock:
            first, self._closed = not self._closed, True
        if first:
            self._end()
        if cancel:
            self._cancel()

    def expire(self, now: float) -> None:
        """Fails the steps past their deadline (DEADLINE_EXCEEDED, as a unary call's deadline would)."""
        with self._lock:
            late = [f for f in self._pending.values() if f.deadline <= now]
            for f in late:
                del self._pending[f.key]
        for f in late:
            f._settle(error=StatusError(grpc.StatusCode.DEADLINE_EXCEEDED, "no answer to the step in time"))

    def idle(self) -> bool:
        with self._lock:
            return not self._pending

    # -- the transport's ------------------------------------------------------------

    def _write(self, request: pb.StepRequest) -> None:
        raise NotImplementedError

    def _end(self) -> None:
        """Our side is done: the worker answers what it has, then ends the stream."""
        raise NotImplementedError

    def _cancel(self) -> None:
        raise NotImplementedError

    # -- the reader's ------------------------------------------------------------------

    def _answer(self, reply: pb.StepReply) -> None:
        with self._lock:
            fut = self._pending.pop((reply.epoch, reply.step), None)
        if fut is None:
            return   # answers a step abandoned meanwhile (cancelled, or past its deadline)
        if reply.error_code:
            fut._settle(error=StatusError(grpc.StatusCode[reply.error_code], reply.error_details, reply.error_kind))
            return
        if self._heard is not None:
            self._heard(fut.sent)
        fut._settle(reply=reply)

    def _ended(self, error: grpc.RpcError | None) -> None:
        """The stream ended (``error``: how, None when the worker ended it); the steps it left fail."""
        with self._lock:
            self._closed, self._error = True, error
            left, self._pending = list(self._pending.values()), {}
        for f in left:   # the worker went away (or the stream was cancelled): as the calls would have ended
            f._settle(error=error or StatusError(grpc.StatusCode.UNAVAILABLE, "the step stream ended"))
        self._forget(self)


class _GrpcStream(_Stream):
    """A ``Steps`` stream (gRPC's sync API: a thread of gRPC's consumes the requests, one of ours reads)."""

    def __init__(self, stub, seconds: float, forget, heard=None):
        super().__init__(forget, heard)
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._call = stub.Steps(iter(self._requests.get, None), timeout=seconds)
        threading.Thread(target=self._read, name="step-stream", daemon=True).start()

    def _write(self, request: pb.StepRequest) -> None:
        self._requests.put(request)

    def _end(self) -> None:
        self._requests.put(None)

    def _cancel(self) -> None:
        self._call.cancel()

    def _read(self) -> None:
        error: grpc.RpcError | None = None
        try:
            for reply in self._call:
                self._answer(reply)
        except grpc.RpcError as e:
            error = e
        except Exception as e:  # noqa: BLE001 - an answer that does not parse: the stream is no good
            error = StatusError(grpc.StatusCode.INTERNAL, f"the step stream broke: {type(e).__name__}: {e}")
        self._requests.put(None)
        self._ended(error)


class _SocketStream(_Stream):
    """A step stream on a data-plane connection (:func:`runtime.worker.step_stream.serve_step_connection`).

    ``dial()`` opens and greets the connection; it runs on the reader's
    thread (a worker that does not answer the handshake holds up no
    caller), and requests sent before it is open wait for it. The stream
    lives until either side ends it: it needs no deadline of its own, each
    step has one. A request is written by the caller's thread (the
    dispatching controller, holding its calls' lock), so a write may block
    at most ``send_seconds`` (the kernel's ``SO_SNDTIMEO``: a hung worker
    whose socket buffer is full fails its stream, as lost, rather than
    stopping the controller).
    """

    def __init__(self, dial: Callable[[], socket.socket], forget, heard=None, send_seconds: float = 5.0):
        super().__init__(forget, heard)
        self._dial, self._send_seconds = dial, send_seconds
        self._send = threading.Lock()
        self._sock: socket.socket | None = None
        self._backlog: list[bytes | None] = []   # before the connection is open; None: the end
        self._gone = False
        threading.Thread(target=self._read, name="step-stream", daemon=True).start()

    def _out(self, data: bytes | None) -> None:
        with self._send:
            if self._sock is None:
                if not self._gone:
                    self._backlog.append(data)
                return
            try:
                self._frame(self._sock, data)
            except OSError:
                shut(self._sock)   # the reader sees the connection end and fails the steps

    @staticmethod
    def _frame(sock, data: bytes | None) -> None:
        if data is None:
            send_frame(sock, END)
        else:
            send_frame(sock, STEP, b"", data)

    def _write(self, request: pb.StepRequest) -> None:
        self._out(request.SerializeToString())

    def _end(self) -> None:
        self._out(None)

    def _cancel(self) -> None:
        with self._send:
            self._gone = True
            if self._sock is not None:
                shut(self._sock)

    def _read(self) -> None:
        error: grpc.RpcError | None = None
        sock = None
        try:
            sock = self._dial()
            sock.settimeout(None)
            seconds = int(self._send_seconds)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                            struct.pack("ll", seconds, int((self._send_seconds - seconds) * 1e6)))
            with self._send:
                if self._gone:
                    raise ConnectionError("cancelled before it was open")
                for data in self._backlog:
                    self._frame(sock, data)
                self._sock, self._backlog = sock, []
            while True:
                kind, header, plen = read_frame_head(sock)
                if kind == END:
                    break   # the worker answered every step and ended it
                payload = recv_bytes(sock, plen)
                if kind == REPLY:   # it refused the stream (a request that did not parse): RemoteError
                    check_reply(header, payload)
                    raise ProtocolError("a step stream ended with a REPLY of OK")
                if kind != STEP or header:
                    raise ProtocolError(f"a step stream's answer is a STEP frame, not kind {kind}")
                self._answer(parse_message(pb.StepReply, payload, "a step answer"))
        except RemoteError as e:   # refused: the handshake (UNAUTHENTICATED) or the stream
            code = grpc.StatusCode.__members__.get(e.code, grpc.StatusCode.INTERNAL)
            error = StatusError(code, e.message)
        except (OSError, ProtocolError, struct.error) as e:   # the worker went away, or was cancelled
            error = StatusError(grpc.StatusCode.UNAVAILABLE, f"the step connection ended: {e}")
        except Exception as e:  # noqa: BLE001 - a bug here must still fail the steps, not leave them waiting
            error = StatusError(grpc.StatusCode.INTERNAL, f"the step stream broke: {type(e).__name__}: {e}")
        finally:
            with self._send:
                self._gone, self._sock = True, None
            if sock is not None:
                shut(sock)
        self._ended(error)


class StepStreams:
    """The controller's step streams, one per worker, opened on first use. Thread-safe.

    ``step_seconds``: how long a step may go unanswered (the unary call's
    deadline); ``stream_seconds``: how long a stream takes new requests;
    ``heard(worker, sent_at)``: told of every answer that is not an error;
    ``dial(data_address)``: opens and greets a data-plane connection (the
    run secret's handshake, TLS): a worker sent a step with its data
    address gets its stream there, one without on gRPC's ``Steps``;
    ``send_seconds``: the longest a request's write to a data-plane
    connection may block (see :class:`_SocketStream`).
    """

    def __init__(self, step_seconds: float, stream_seconds: float = STREAM_SECONDS,
                 heard: Callable[[str, float], None] | None = None,
                 dial: Callable[[str], socket.socket] | None = None, send_seconds: float = 5.0):
        self.step_seconds, self.stream_seconds, self.send_seconds = step_seconds, stream_seconds, send_seconds
        self._heard, self._dial = heard, dial
        self._lock = threading.Lock()
        self._streams: dict[str, _Stream] = {}
        self._old: list[_Stream] = []   # no longer taking requests; answering those sent on them
        self._closed = False
        self._wake = threading.Event()
        threading.Thread(target=self._expire, name="step-stream-deadlines", daemon=True).start()

    def send(self, worker: str, stub, request: pb.StepRequest, data_address: str = "") -> StepFuture:
        """Writes ``request`` on ``worker``'s stream (opened now if it has none, or a new one when its current
        stream is old: on its data plane at ``data_address`` when there is one and a ``dial``, else on ``stub``);
        returns the step's future."""
        with self._lock:
            stream = self._streams.get(worker)
            if stream is not None and time.monotonic() - stream.opened > self.stream_seconds:
                stream.close()
                self._old.append(stream)
                stream = None
            if stream is None:
                # Its deadline: its last request, sent just before it gets old, still has its step's time.
                heard = None if self._heard is None else (lambda t, w=worker: self._heard(w, t))
                forget = (lambda s, w=worker: self._forget(w, s))
                if data_address and self._dial is not None:
                    stream = _SocketStream(lambda a=data_address: self._dial(a), forget, heard, self.send_seconds)
                else:
                    stream = _GrpcStream(stub, self.stream_seconds + self.step_seconds, forget, heard)
                self._streams[worker] = stream
        return stream.send(request, self.step_seconds)

    def cancelled(self, request: pb.StepRequest) -> StepFuture:
        """A future for ``request`` that is cancelled already (its worker was declared dead: it is not sent)."""
        now = time.monotonic()
        fut = StepFuture((request.fence.epoch, request.step), now, now, lambda f: None)
        fut.cancel()
        return fut

    def drop(self, worker: str) -> None:
        """``worker`` was declared dead: its stream ends now (a later request opens a new one)."""
        with self._lock:
            stream = self._streams.pop(worker, None)
        if stream is not None:
            stream.close(cancel=True)

    def close(self) -> None:
        """Every stream ends (the run is over); steps still in flight fail."""
        with self._lock:
            self._closed = True
            streams = list(self._streams.values()) + self._old
            self._streams, self._old = {}, []
        self._wake.set()
        for s in streams:
            s.close(cancel=True)

    def _forget(self, worker: str, stream: _Stream) -> None:
        with self._lock:
            if self._streams.get(worker) is stream:
                del self._streams[worker]
            if stream in self._old:
                self._old.remove(stream)

    def _expire(self) -> None:
        while not self._wake.wait(0.5):
            now = time.monotonic()
            with self._lock:
                streams = list(self._streams.values()) + self._old
            for s in streams:
                s.expire(now)
            with self._lock:
                for s in [s for s in self._old if s.idle()]:
                    self._old.remove(s)
                    s.close(cancel=True)
