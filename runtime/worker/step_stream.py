"""The worker's end of the step stream (``Steps``): the controller's step requests arrive on one long-lived stream,
each answer goes back on it naming its step and epoch.

A unary ``Step`` call per worker per step costs both ends a call's set-up
(gRPC Python: about 0.5-0.8 ms of the client's CPU each, and the server's
handler dispatch); on a stream a step is one message each way. What a step
does and what it answers is the unary ``Step``'s, unchanged
(:meth:`runtime.worker.step_runner.StepRunner.run`): each request runs on a
thread of the stream's pool as its call did on the server's pool, waits for
its turn there, and a failure is answered as the call would have ended
(:func:`runtime.wire.rpc.error_status`: code, details, kind) in the reply's
``error_*`` fields instead of ending the stream. Fencing is per request, as
before.

Each request renews the worker's lease (as a unary call reaching its
handler does); while a chaos partition is armed a request is dropped
unanswered, as a unary call is. A request that does not parse ends the
stream with INVALID_ARGUMENT once the steps before it answered. When the
controller closes its side the steps in flight still answer, then the
stream ends; when the controller goes
away (the stream is cancelled) their answers are dropped and waiting steps
give up at their next look at the caller, as a cancelled call's do.

The same stream also runs on a data-plane connection
(:func:`serve_step_connection`, the default where the worker serves a data
plane): ``STEP`` frames each way, each payload one ``StepRequest`` or
``StepReply``, the replies written by the thread that ran the step. Its
rules are the gRPC stream's: the controller's ``END`` frame is its side
closing (the steps in flight answer, then the worker sends ``END`` and
closes); the connection breaking is the controller going away; a request
that does not parse is answered with a ``REPLY`` frame of INVALID_ARGUMENT
once the steps before it answered, and the connection closes. It costs
each step one socket read on a thread of the worker's and one write, where
gRPC's sync server wakes three threads per message.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent import futures

import grpc

from runtime._proto import elastic_pb2 as pb
from runtime.core.errors import ProtocolError
from runtime.wire import rpc
from runtime.wire.dataplane_wire import END, REPLY, STEP, parse_message, read_frame_head, recv_bytes, send_frame
from runtime.wire.parts import MAX_STEPS_AHEAD

__all__ = ["serve_step_connection", "serve_steps"]

log = logging.getLogger("jax_elastic.worker")

_END = object()


class _Caller:
    """What a step reads of its caller (``is_active``): the stream is open and the controller still reads it
    (``context``: the gRPC call's; None on a data-plane connection, where ``closed`` says both)."""

    def __init__(self, context, closed: threading.Event):
        self._context, self._closed = context, closed

    def is_active(self) -> bool:
        return not self._closed.is_set() and (self._context is None or self._context.is_active())


def _answer(step: Callable[[pb.StepRequest, object], pb.StepReply], req: pb.StepRequest, caller) -> pb.StepReply:
    """Runs one step; its failure is answered as the unary call would have ended (code, details, kind)."""
    try:
        reply = step(req, caller)
    except Exception as e:  # noqa: BLE001 - answered as the unary call would have ended
        rpc.log_failure(log, f"step {req.step}", e)
        code, details, kind = rpc.error_status(e)
        reply = pb.StepReply(error_code=code.name, error_details=details, error_kind=kind)
    reply.step, reply.epoch = req.step, req.fence.epoch
    return reply


def _pool() -> futures.ThreadPoolExecutor:
    """Steps wait for their turn on their thread: as many as may be ahead, and one running."""
    return futures.ThreadPoolExecutor(max_workers=MAX_STEPS_AHEAD + 2, thread_name_prefix="step-stream")


def serve_steps(requests: Iterator[pb.StepRequest], context, *, step: Callable[[pb.StepRequest, object], pb.StepReply],
                heard: Callable[[], None], dropped: Callable[[], bool]) -> Iterator[pb.StepReply]:
    """The ``Steps`` handler: runs ``step(request, caller)`` for each request on a thread of its own and yields
    each reply (or failure) as it ends; ``heard()`` per request renews the lease, ``dropped()`` true drops it."""
    replies: queue.SimpleQueue = queue.SimpleQueue()
    closed = threading.Event()
    caller = _Caller(context, closed)
    pool = _pool()

    def run(req: pb.StepRequest) -> None:
        replies.put(_answer(step, req, caller))

    def read() -> None:
        sent, malformed = 0, None
        try:
            for req in requests:
                heard()
                if dropped():
                    continue   # a chaos partition: no answer, as a unary call gets none
                sent += 1
                pool.submit(run, req)
        except ProtocolError as e:   # a request that does not parse: the stream ends INVALID_ARGUMENT
            malformed = e
        except Exception as e:  # noqa: BLE001 - the stream broke (the controller went away): nothing to answer
            log.debug("step stream ends: %s", e)
        finally:
            replies.put((_END, sent, malformed))

    threading.Thread(target=read, name="step-stream-read", daemon=True).start()
    answered, expected, malformed = 0, None, None
    try:
        while expected is None or answered < expected:
            try:
                item = replies.get(timeout=1.0)
            except queue.Empty:
                if not context.is_active():
                    return
                continue
            if isinstance(item, tuple) and item[0] is _END:
                _, expected, malformed = item
                continue
            answered += 1
            yield item
        if malformed is not None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(malformed))
    finally:
        closed.set()
        pool.shutdown(wait=False)


def serve_step_connection(sock, first: tuple[int, bytes, int], *,
                          step: Callable[[pb.StepRequest, object], pb.StepReply],
                          heard: Callable[[], None], dropped: Callable[[], bool]) -> None:
    """Serves a data-plane connection whose first frame (``first``, read) was a ``STEP``, until it ends (see the
    module docstring); the caller closes the socket after. ``step``, ``heard`` and ``dropped`` as for
    :func:`serve_steps`."""
    closed = threading.Event()
    caller = _Caller(None, closed)
    send = threading.Lock()
    pool = _pool()

    def run(req: pb.StepRequest) -> None:
        reply = _answer(step, req, caller)
        if closed.is_set():
            return   # the controller went away: nobody reads the answer
        try:
            with send:
                send_frame(sock, STEP, b"", reply.SerializeToString())
        except OSError:
            closed.set()

    head, malformed = first, None
    try:
        while head[0] != END:
            kind, header, plen = head
            if kind != STEP or header:
                raise ProtocolError(f"a step stream carries STEP frames (a message, no header), not kind {kind}")
            req = parse_message(pb.StepRequest, recv_bytes(sock, plen), "a step request")
            heard()
            if not dropped():   # a chaos partition: no answer, as a unary call gets none
                pool.submit(run, req)
            head = read_frame_head(sock)
    except ProtocolError as e:
        malformed = e
    except OSError as e:   # the controller went away (ConnectionError is one): its steps' answers are dropped
        log.debug("step connection ends: %s", e)
        closed.set()
        pool.shutdown(wait=False)
        return
    pool.shutdown(wait=True)   # the controller closed its side (or sent garbage): the steps in flight answer first
    with send:
        try:
            if malformed is not None:
                send_frame(sock, REPLY, b"INVALID_ARGUMENT", str(malformed).encode()[:4096])
            else:
                send_frame(sock, END)
        except OSError:
            pass
    closed.set()
