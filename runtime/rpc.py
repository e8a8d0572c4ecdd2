"""gRPC plumbing shared by the controller and the workers.

Errors cross the wire as status codes, and are mapped back to typed errors by
code (never by message text):

=====================  ==========================
status                 error on the caller's side
=====================  ==========================
INTERNAL               WorkerError (user code raised; details carry the traceback)
FAILED_PRECONDITION    StaleEpochError (fenced: wrong run or older epoch)
INVALID_ARGUMENT       ProtocolError (malformed message, bad checksum)
ABORTED                StepAbortedError (a peer vanished mid-step)
UNAUTHENTICATED        AuthenticationError (missing or wrong run secret)
anything else          WorkerLostError (unreachable, deadline, cancelled)
=====================  ==========================
"""

from __future__ import annotations

import logging
import traceback
from concurrent import futures

import grpc

from runtime import auth
from runtime.errors import (AuthenticationError, ProtocolError, StaleEpochError, StepAbortedError, WorkerError,
                            WorkerLostError)

log = logging.getLogger("jax_elastic.rpc")

__all__ = ["CHANNEL_OPTIONS", "make_server", "channel", "abort_with", "to_error"]

MAX_MESSAGE = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE),
    ("grpc.max_receive_message_length", MAX_MESSAGE),
    ("grpc.enable_retries", 0),
]

_CODES = {
    StaleEpochError: grpc.StatusCode.FAILED_PRECONDITION,
    ProtocolError: grpc.StatusCode.INVALID_ARGUMENT,
    StepAbortedError: grpc.StatusCode.ABORTED,
}


def make_server(host: str = "127.0.0.1", port: int = 0, max_workers: int = 32,
                secret: str = "", interceptors=(), tls: auth.TlsFiles | None = None) -> tuple[grpc.Server, int]:
    """A server on ``host:port`` (0: any free port); with ``secret``, every RPC must carry it;
    with ``tls``, only mutual-TLS connections are accepted.

    ``interceptors`` run before the secret check (the chaos partition drops
    calls before anything else sees them).
    """
    interceptors = list(interceptors)
    if secret:
        interceptors.append(auth.SecretServerInterceptor(
            secret, on_refused=lambda method, why: log.warning("refused %s: %s", method, why)))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=CHANNEL_OPTIONS,
                         interceptors=interceptors)
    if tls is not None:
        bound = server.add_secure_port(f"{host}:{port}", tls.server_credentials())
    else:
        bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"could not bind a gRPC server on {host}:{port}")
    return server, bound


def channel(address: str, secret: str = "", tls: auth.TlsFiles | None = None) -> grpc.Channel:
    """A channel to ``address`` that attaches the run secret to every call (over mutual TLS with ``tls``)."""
    if tls is not None:
        ch = grpc.secure_channel(address, tls.channel_credentials(), options=CHANNEL_OPTIONS)
    else:
        ch = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    return auth.secure_channel(ch, secret) if secret else ch


def abort_with(context: grpc.ServicerContext, exc: BaseException) -> None:
    """Server side: ends the RPC with the status code that names ``exc``'s kind."""
    for kind, code in _CODES.items():
        if isinstance(exc, kind):
            context.abort(code, str(exc))
    text = "".join(traceback.format_exception(exc))
    context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}\n{text}")


def to_error(worker_id: str, err: grpc.RpcError) -> Exception:
    """Client side: the typed error for a failed RPC to ``worker_id``."""
    code, details = err.code(), err.details() or ""
    if code == grpc.StatusCode.INTERNAL:
        message, _, tb = details.partition("\n")
        return WorkerError(worker_id, message, tb)
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return StaleEpochError(f"worker {worker_id} refused: {details}")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return ProtocolError(f"worker {worker_id} rejected a message: {details}")
    if code == grpc.StatusCode.ABORTED:
        return StepAbortedError(-1, f"worker {worker_id}: {details}")
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return AuthenticationError(f"worker {worker_id} refused the run secret: {details}")
    return WorkerLostError(worker_id, f"{code.name}: {details}")
