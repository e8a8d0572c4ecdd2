"""Per-run secret authentication for the controller <-> worker gRPC links.

Contract:

* Every run has one secret (``new_secret()``), handed to workers out of band.
* A caller attaches it to every call, in both directions, by wrapping its channel
  with ``secure_channel(channel, secret)``: each call's metadata gains
  ``(METADATA_KEY, secret)``. ``.future()`` and streaming calls work as usual.
* A server installs ``SecretServerInterceptor(secret)``. A call whose metadata
  lacks the key, or carries any other value, fails with ``UNAUTHENTICATED``
  ("missing or wrong run secret for <method>") before the real handler runs,
  whatever the method's arity, and is told to ``on_refused(method, peer,
  reason)``. The refusal names the credential the method takes: the run
  secret, or what the server calls its own (``credential``: a pool's "pool
  secret"), or a method's own (``per_method``: a :class:`Credential`, a pool's
  "client token"). Methods named in ``exempt`` (full names such as
  ``"/grpc.health.v1.Health/Check"``) need no secret. Unknown methods still get
  ``UNIMPLEMENTED``.
* :class:`Refusals` counts refused calls per (method, peer host, reason) for
  whoever reports them (security events), and logs them rate-limited.
* The secret guards against stray or stale clients, not eavesdroppers: for that,
  also use TLS (``server_credentials`` / ``channel_credentials``).
"""

from __future__ import annotations

import collections
import dataclasses
import hmac
import logging
import os
import secrets
import ssl
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Callable

import grpc

__all__ = [
    "METADATA_KEY", "new_secret", "Credential", "SecretServerInterceptor", "Refusals", "peer_host",
    "secure_channel", "server_credentials", "channel_credentials", "handler_like", "TlsFiles",
]

METADATA_KEY = "x-elastic-run-secret"

_log = logging.getLogger(__name__)


def new_secret() -> str:
    """A fresh 128-bit run secret, as 32 hex characters."""
    return secrets.token_hex(16)


def peer_host(peer: str) -> str:
    """The caller's host from a gRPC peer string (``ipv4:10.0.0.1:5123`` -> ``ipv4:10.0.0.1``).

    Refusals are counted per host: a caller opens a new port per connection.
    """
    if peer.startswith(("ipv4:", "ipv6:")):
        host, sep, port = peer.rpartition(":")
        if sep and port.isdigit():
            return host
    return peer


class Refusals:
    """Counts of refused calls per ``(method, peer host, reason)``. Thread-safe.

    Filled by the server's ``on_refused`` hook (:meth:`record`), drained by
    whoever reports them (:meth:`drain`: the worker's ``Refusals`` RPC, the
    controller's registry). At most ``max_keys`` distinct keys are kept
    between two drains; calls beyond go to one ``(*, *, "overflow")`` key, so
    a caller hammering from many hosts cannot grow it without bound. Logs
    the first refusal of a key at once, then at most one line per key every
    ``log_seconds`` with the count since the last line.
    """

    OVERFLOW = ("*", "*", "overflow")

    def __init__(self, log: logging.Logger | None = None, max_keys: int = 256, log_seconds: float = 60.0):
        self._log = log or _log
        self._max_keys = max_keys
        self._log_seconds = log_seconds
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, str, str], int] = {}
        self._lines: dict[tuple[str, str, str], list] = {}   # key -> [time of its last log line, calls since]

    def record(self, method: str, peer: str, reason: str) -> None:
        """One refused call (the ``on_refused`` hook of :class:`SecretServerInterceptor`)."""
        key = (method, peer_host(peer), reason)
        now = time.monotonic()
        with self._lock:
            if key not in self._counts and len(self._counts) >= self._max_keys:
                key = self.OVERFLOW
            self._counts[key] = self._counts.get(key, 0) + 1
            line = self._lines.get(key)
            if line is None:
                if len(self._lines) >= self._max_keys:
                    self._lines.clear()
                line = self._lines[key] = [-float("inf"), 0]
            line[1] += 1
            if now - line[0] < self._log_seconds:
                return
            first, since, line[0], line[1] = line[0] < 0, line[1], now, 0
        if first:
            self._log.warning("refused %s from %s: %s (more from there are counted and logged at most every "
                              "%.0f s)", key[0], key[1], key[2], self._log_seconds)
        else:
            self._log.warning("refused %s from %s: %s (%d such calls since the last line)", *key, since)

    def drain(self) -> list[tuple[str, str, str, int]]:
        """``[(method, peer host, reason, count)]`` since the last drain, most frequent first; resets."""
        with self._lock:
            counts, self._counts = self._counts, {}
        return sorted(((m, p, r, n) for (m, p, r), n in counts.items()), key=lambda x: (-x[3], x[:3]))


@dataclasses.dataclass(frozen=True)
class Credential:
    """What a method takes instead of the server's secret: its ``name`` (in refusals: "wrong client token") and
    ``secrets()``, the values accepted, asked at each call (a pool's client tokens may change)."""

    name: str
    secrets: Callable[[], Iterable[str]]


class SecretServerInterceptor(grpc.ServerInterceptor):
    """Refuses, with UNAUTHENTICATED, every call that does not carry the run secret.

    ``on_refused(method, peer, reason)`` is called for each refused call
    (``reason``: "missing run secret" or "wrong run secret", the credential
    named as ``credential`` or the method's :class:`Credential` names it;
    ``peer``: gRPC's peer string); an exception it raises is logged and does
    not change the status.
    """

    def __init__(
        self,
        secret: str,
        on_refused: Callable[[str, str, str], None] | None = None,
        exempt: frozenset[str] = frozenset(),
        per_method: Mapping[str, Credential] | None = None,
        credential: str = "run secret",
    ):
        if not secret:
            raise ValueError("run secret must be a non-empty string")
        self._secret = secret.encode()
        self._on_refused = on_refused
        self._exempt = frozenset(exempt)
        self._per_method = dict(per_method or {})   # method -> what it takes instead
        self._credential = credential

    def _name(self, method: str) -> str:
        own = self._per_method.get(method)
        return own.name if own is not None else self._credential

    def _authentic(self, metadata, method: str = "") -> str | None:
        """None when the metadata carries the secret (one of ``method``'s own, if it has any), else the reason
        it does not, naming the credential ("missing pool secret", "wrong client token")."""
        values = [v for k, v in (metadata or ()) if k == METADATA_KEY]
        if not values:
            return f"missing {self._name(method)}"
        own = self._per_method.get(method)
        accepted = [s.encode() for s in own.secrets()] if own is not None else [self._secret]
        for v in values:
            v = v if isinstance(v, bytes) else v.encode("utf-8", "replace")
            if not any(hmac.compare_digest(v, a) for a in accepted):
                return f"wrong {self._name(method)}"
        return None

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method in self._exempt:
            return continuation(handler_call_details)
        reason = self._authentic(handler_call_details.invocation_metadata, method)
        if reason is None:
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is None:  # unknown method: let gRPC answer UNIMPLEMENTED
            return None
        return self._refusing_handler(handler, method, reason)

    def _refusing_handler(self, handler, method: str, reason: str):
        def refuse(_request_or_iterator, context):
            if self._on_refused is not None:
                try:
                    self._on_refused(method, context.peer(), reason)
                except Exception:  # a logging hook must not change the status
                    _log.exception("on_refused hook failed for %s", method)
            context.abort(grpc.StatusCode.UNAUTHENTICATED, f"missing or wrong {self._name(method)} for {method}")

        return handler_like(handler, refuse)


def handler_like(handler: grpc.RpcMethodHandler, behavior) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s arity and serializers that runs ``behavior(request, context)`` instead."""
    if handler.request_streaming and handler.response_streaming:
        make = grpc.stream_stream_rpc_method_handler
    elif handler.request_streaming:
        make = grpc.stream_unary_rpc_method_handler
    elif handler.response_streaming:
        make = grpc.unary_stream_rpc_method_handler
    else:
        make = grpc.unary_unary_rpc_method_handler
    return make(behavior, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


_Fields = ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")


class _CallDetails(collections.namedtuple("_CallDetails", _Fields), grpc.ClientCallDetails):
    pass


class _SecretClientInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Appends ``(METADATA_KEY, secret)`` to every outgoing call's metadata."""

    def __init__(self, secret: str):
        self._secret = secret

    def _details(self, d: grpc.ClientCallDetails) -> _CallDetails:
        metadata = [*(d.metadata or ()), (METADATA_KEY, self._secret)]
        return _CallDetails(d.method, d.timeout, metadata, d.credentials, d.wait_for_ready, d.compression)

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)


def secure_channel(channel: grpc.Channel, secret: str) -> grpc.Channel:
    """``channel`` with the run secret attached to every call made through it."""
    if not secret:
        raise ValueError("run secret must be a non-empty string")
    return grpc.intercept_channel(channel, _SecretClientInterceptor(secret))


@dataclasses.dataclass(frozen=True)
class TlsFiles:
    """PEM files for mutual TLS between the controller and the workers.

    Every process serves with ``cert_file``/``key_file`` and presents the same
    pair as a client; peers must present a certificate ``ca_file`` signed (a
    self-signed certificate may be its own CA). The certificate must name the
    hosts the processes dial (for local runs: IP 127.0.0.1).
    """

    cert_file: str
    key_file: str
    ca_file: str

    def server_credentials(self) -> grpc.ServerCredentials:
        return server_credentials(self.cert_file, self.key_file, self.ca_file)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return channel_credentials(self.ca_file, self.cert_file, self.key_file)

    def ssl_server_context(self) -> ssl.SSLContext:
        """The same mutual TLS for a plain socket (the data plane): clients must present a certificate."""
        for path, what in ((self.cert_file, "certificate"), (self.key_file, "key"), (self.ca_file, "CA")):
            _read(path, what)
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=self.ca_file)
        ctx.load_cert_chain(self.cert_file, self.key_file)
        ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def ssl_client_context(self) -> ssl.SSLContext:
        """Mutual TLS for a plain socket's client: checks the server's certificate and name, presents ours."""
        for path, what in ((self.cert_file, "certificate"), (self.key_file, "key"), (self.ca_file, "CA")):
            _read(path, what)
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.ca_file)
        ctx.load_cert_chain(self.cert_file, self.key_file)
        return ctx

    def environ(self) -> dict[str, str]:
        """For a launched worker (paths, not secrets)."""
        return {"ELASTIC_TLS_CERT": self.cert_file, "ELASTIC_TLS_KEY": self.key_file, "ELASTIC_TLS_CA": self.ca_file}


def _read(path, what: str) -> bytes:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"TLS {what} file not found: {path}")
    with open(path, "rb") as f:
        data = f.read()
    if not data.strip():
        raise ValueError(f"TLS {what} file is empty: {path}")
    return data


def server_credentials(cert_file, key_file, ca_file=None) -> grpc.ServerCredentials:
    """TLS for a server; with ``ca_file``, clients must present a certificate it signed."""
    pair = (_read(key_file, "key"), _read(cert_file, "certificate"))
    ca = _read(ca_file, "CA") if ca_file is not None else None
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)


def channel_credentials(ca_file=None, cert_file=None, key_file=None) -> grpc.ChannelCredentials:
    """TLS for a client: ``ca_file`` (default: system roots) and an optional client cert/key pair."""
    if (cert_file is None) != (key_file is None):
        missing = "key_file" if key_file is None else "cert_file"
        raise ValueError(f"client TLS needs both cert_file and key_file; {missing} is missing")
    return grpc.ssl_channel_credentials(
        root_certificates=_read(ca_file, "CA") if ca_file is not None else None,
        private_key=_read(key_file, "key") if key_file is not None else None,
        certificate_chain=_read(cert_file, "certificate") if cert_file is not None else None,
    )
