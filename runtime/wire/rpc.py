"""gRPC plumbing shared by the controller and the workers.

Errors cross the wire as status codes, and are mapped back to typed errors by
code (never by message text):

=====================  ==========================
status                 error on the caller's side
=====================  ==========================
INTERNAL               WorkerError (user code raised; details carry the traceback)
FAILED_PRECONDITION    StaleEpochError (fenced: wrong run or older epoch)
INVALID_ARGUMENT       ProtocolError (malformed message, bad checksum)
RESOURCE_EXHAUSTED     ProtocolError (a message over the size limit)
ABORTED                StepAbortedError (a peer vanished mid-step)
UNAUTHENTICATED        AuthenticationError (missing or wrong run secret)
anything else          WorkerLostError (unreachable, deadline, cancelled)
=====================  ==========================

Every server built by :func:`make_server` refuses a request that does not
parse with INVALID_ARGUMENT (gRPC itself would answer INTERNAL, which reads
as a user-code error), and a message over its size limit with
RESOURCE_EXHAUSTED (gRPC's own check, before any of our code runs).
"""

from __future__ import annotations

import logging
import socket
import traceback
from collections.abc import Callable
from concurrent import futures

import grpc

from runtime.wire import auth
from runtime.core.errors import (AuthenticationError, ClientSupersededError, ProtocolError, StaleEpochError,
                                 StepAbortedError, UserInputError, WorkerError, WorkerFencedError, WorkerLostError)

log = logging.getLogger("jax_elastic.rpc")

__all__ = ["CHANNEL_OPTIONS", "StatusError", "make_server", "channel", "abort_with", "error_status", "log_failure",
           "status_of", "status_name", "to_error", "free_port"]

MAX_MESSAGE = 64 * 1024 * 1024   # a Load (programs, data source) or a state chunk and its header
MAX_METADATA = 16 * 1024         # the run secret and gRPC's own headers
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE),
    ("grpc.max_receive_message_length", MAX_MESSAGE),
    ("grpc.max_metadata_size", MAX_METADATA),
    ("grpc.enable_retries", 0),
]

#: A channel to a peer that may restart on the same address (a shared pool) tries again within 2 s, however long
#: it was away (gRPC's own backoff grows to 2 minutes).
RECONNECT_SOON = (("grpc.initial_reconnect_backoff_ms", 500), ("grpc.min_reconnect_backoff_ms", 500),
                  ("grpc.max_reconnect_backoff_ms", 2000))

_KIND_KEY = "elastic-error"   # trailing metadata naming an error's kind finer than its status code

_CODES = {
    StaleEpochError: grpc.StatusCode.FAILED_PRECONDITION,
    ProtocolError: grpc.StatusCode.INVALID_ARGUMENT,
    StepAbortedError: grpc.StatusCode.ABORTED,
    ClientSupersededError: grpc.StatusCode.PERMISSION_DENIED,
}


def make_server(host: str = "127.0.0.1", port: int = 0, max_workers: int = 32,
                secret: str = "", interceptors=(), tls: auth.TlsFiles | None = None, *,
                refusals: auth.Refusals | None = None, on_authenticated: Callable[[str], None] | None = None,
                max_message: int = MAX_MESSAGE, per_method=None, credential: str = "run secret"
                ) -> tuple[grpc.Server, int]:
    """A server on ``host:port`` (0: any free port); with ``secret``, every RPC must carry it;
    with ``tls``, only mutual-TLS connections are accepted.

    ``interceptors`` run before the secret check (the chaos partition drops
    calls before anything else sees them). A call refused for its secret is
    counted in ``refusals`` (which logs it, rate-limited), its reason naming the credential: ``credential``
    (what ``secret`` is: a pool's "pool secret"), or for the methods ``per_method`` names, the
    :class:`~runtime.wire.auth.Credential` they take instead (a pool's clients call with their tokens).
    ``on_authenticated(method)`` is called when a call that passed every check (transport, secret, the
    interceptors) reaches its handler: a call that was refused or dropped
    never calls it. Requests and replies over ``max_message`` bytes are
    refused with RESOURCE_EXHAUSTED. ``OSError`` when it cannot listen there.
    """
    interceptors = list(interceptors)
    if secret:
        refusals = refusals if refusals is not None else auth.Refusals(log)
        interceptors.append(auth.SecretServerInterceptor(secret, on_refused=refusals.record, per_method=per_method,
                                                         credential=credential))
    interceptors.append(_Handled(on_authenticated))   # innermost: sees only calls that got through
    options = [("grpc.max_send_message_length", max_message), ("grpc.max_receive_message_length", max_message),
               ("grpc.max_metadata_size", MAX_METADATA)]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=options,
                         interceptors=interceptors)
    try:
        if tls is not None:
            bound = server.add_secure_port(f"{host}:{port}", tls.server_credentials())
        else:
            bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:   # what grpcio raises for an address it cannot bind (older ones answered 0)
        bound = 0
    if bound == 0:
        raise OSError(f"could not bind a gRPC server on {host}:{port}")
    return server, bound


class _Handled(grpc.ServerInterceptor):
    """The innermost interceptor: parses requests itself and tells ``on_call`` about each call it runs.

    Its handler runs only when no outer interceptor replaced it (a refused
    secret, a chaos partition), so ``on_call`` hears only calls that got
    through. A request that does not parse ends with INVALID_ARGUMENT.
    """

    def __init__(self, on_call: Callable[[str], None] | None):
        self._on_call = on_call

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method, on_call = handler_call_details.method, self._on_call
        parse = handler.request_deserializer or (lambda raw: raw)

        def decode(raw):
            try:
                return parse(raw)
            except Exception as e:  # noqa: BLE001 - any parse failure is the caller's malformed message
                raise ProtocolError(f"{method}: the request does not parse ({type(e).__name__})") from None

        if handler.request_streaming:
            inner = handler.stream_stream or handler.stream_unary

            def behavior(raw_iterator, context):
                if on_call is not None:
                    on_call(method)
                try:
                    return inner((decode(raw) for raw in raw_iterator), context)
                except ProtocolError as e:   # a handler that lets the error through (none of ours)
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        else:
            inner = handler.unary_stream or handler.unary_unary

            def behavior(raw, context):
                try:
                    request = decode(raw)
                except ProtocolError as e:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
                if on_call is not None:
                    on_call(method)
                return inner(request, context)

        make = {(False, False): grpc.unary_unary_rpc_method_handler,
                (False, True): grpc.unary_stream_rpc_method_handler,
                (True, False): grpc.stream_unary_rpc_method_handler,
                (True, True): grpc.stream_stream_rpc_method_handler}[handler.request_streaming, handler.response_streaming]
        return make(behavior, request_deserializer=None, response_serializer=handler.response_serializer)


def channel(address: str, secret: str = "", tls: auth.TlsFiles | None = None, options=()) -> grpc.Channel:
    """A channel to ``address`` that attaches the run secret to every call (over mutual TLS with ``tls``);
    ``options``: more of gRPC's channel options (``RECONNECT_SOON``)."""
    every = CHANNEL_OPTIONS + list(options)
    if tls is not None:
        ch = grpc.secure_channel(address, tls.channel_credentials(), options=every)
    else:
        ch = grpc.insecure_channel(address, options=every)
    return auth.secure_channel(ch, secret) if secret else ch


def status_of(exc: BaseException) -> grpc.StatusCode:
    """The status code that names ``exc``'s kind (INTERNAL for anything not ours: user code raised)."""
    for kind, code in _CODES.items():
        if isinstance(exc, kind):
            return code
    return grpc.StatusCode.INTERNAL


def status_name(exc: BaseException) -> str:
    """``status_of(exc)`` by name, as the data plane's replies carry it."""
    return status_of(exc).name


def error_status(exc: BaseException) -> tuple[grpc.StatusCode, str, str]:
    """Server side: ``(status code, details, kind)`` a failed call ends with for ``exc``: the code that names its
    kind, its message (for user code, INTERNAL: the type, message and traceback), and a kind finer than the
    code ("fenced", or "")."""
    code = status_of(exc)
    kind = "fenced" if isinstance(exc, WorkerFencedError) else ""
    if code != grpc.StatusCode.INTERNAL:
        return code, str(exc), kind
    if isinstance(exc, UserInputError):   # the user's to fix: one line (the traceback stays in the worker's log)
        return code, f"{type(exc).__name__}: {' '.join(str(exc).split())}", kind
    text = "".join(traceback.format_exception(exc))
    return code, f"{type(exc).__name__}: {exc}\n{text}", kind


def log_failure(logger: logging.Logger, what: str, exc: BaseException) -> None:
    """Server side: logs that ``what`` failed with ``exc``, the traceback too when the caller gets an INTERNAL
    status (user code, a data source: :func:`error_status`), so the worker's log holds what its answer may not."""
    internal = status_of(exc) == grpc.StatusCode.INTERNAL
    logger.warning("%s failed: %s: %s", what, type(exc).__name__, exc, exc_info=exc if internal else None)


def abort_with(context: grpc.ServicerContext, exc: BaseException) -> None:
    """Server side: ends the RPC with the status code that names ``exc``'s kind (:func:`error_status`)."""
    code, details, kind = error_status(exc)
    if kind:   # a kind within its code: said in the trailing metadata
        context.set_trailing_metadata(((_KIND_KEY, kind),))
    context.abort(code, details)


class StatusError(grpc.RpcError):
    """Client side: a failure that came as a message (a step's answer on a stream) rather than as the end of a
    call, read by :func:`to_error` exactly as a failed call is."""

    def __init__(self, code: grpc.StatusCode, details: str, kind: str = ""):
        super().__init__(f"{code.name}: {details}")
        self._code, self._details, self._kind = code, details, kind

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self):
        return ((_KIND_KEY, self._kind),) if self._kind else ()


def _trailing(err: grpc.RpcError):
    try:
        return err.trailing_metadata() or ()
    except (AttributeError, ValueError):   # an error that is not a call's
        return ()


def to_error(worker_id: str, err: grpc.RpcError) -> Exception:
    """Client side: the typed error for a failed RPC to ``worker_id``."""
    code, details = err.code(), err.details() or ""
    if code == grpc.StatusCode.INTERNAL:
        message, _, tb = details.partition("\n")
        return WorkerError(worker_id, message, tb)
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        kind = WorkerFencedError if (_KIND_KEY, "fenced") in tuple(_trailing(err)) else StaleEpochError
        return kind(f"worker {worker_id} refused: {details}")
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED):
        return ProtocolError(f"worker {worker_id} rejected a message: {code.name}: {details}")
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return ClientSupersededError(f"worker {worker_id} refused this client: {details}")
    if code == grpc.StatusCode.ABORTED:
        return StepAbortedError(-1, f"worker {worker_id}: {details}")
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return AuthenticationError(f"worker {worker_id} refused the run secret: {details}")
    return WorkerLostError(worker_id, f"{code.name}: {details}")


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now (the kernel's choice), for a server another process starts next (a slice's
    JAX coordinator: :mod:`runtime.core.hosts`)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
