"""The data plane: gradients and states between workers over plain TCP (or mutual TLS), beside gRPC.

gRPC carries the control plane: small messages with deadlines and status
codes. Bulk tensors through gRPC's Python API are copied about four times per
chunk (``bytes`` from numpy, protobuf, gRPC's own buffers, back into numpy),
which caps a stream near 0.3-0.5 GB/s on loopback here and costs a
millisecond or more per call. The data plane sends the same checked messages
(a protobuf header per chunk: fence, step, offsets, xxh3_64 checksum) over long-lived
sockets: the payload is written from the sender's numpy buffer (a
``memoryview``, no copy) and read with ``recv_into`` straight into its
destination buffer.

Wire format (little-endian):

- Connection: the server sends ``HELLO`` (``b"JXDP"``, u16 version, a 32-byte
  nonce); the client answers ``b"JXDP"``, the version and
  HMAC-SHA256(run secret, nonce); the server answers one byte ``1`` or counts
  the refusal (``DataPlane/connect``) and closes. With TLS files the socket is
  wrapped in mutual TLS first (the files gRPC uses).
- Frames: ``<BIQ`` (kind, header bytes, payload bytes), the header (a
  serialized protobuf, ``data`` empty), the payload.
- A push: ``PIECE`` frames (``TensorChunk`` headers), then ``END``; the server
  answers one ``REPLY`` (header: a status code name such as ``OK`` or
  ``INVALID_ARGUMENT``; payload: the message).
- A state read: ``STATE_REQUEST`` (``GetStateRequest``); the server answers
  ``STATE`` frames (``StateChunk`` headers) then a ``REPLY``, or a ``REPLY``
  with the error.

After an error, or a frame it cannot parse (unknown kind, a header over 64
KiB, a payload over :data:`MAX_PAYLOAD`), the server replies if it can and
closes the connection: a stream cannot be resynchronized. Exceptions raised
by the handlers travel as their status names (as on gRPC, via
:func:`runtime.rpc.status_name`); the client raises :class:`RemoteError`.
While ``dropped()`` is true (a chaos partition) the server closes every
connection at its next frame without answering.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np

from runtime import auth
from runtime._proto import elastic_pb2 as pb
from runtime.parts import Part
from runtime.errors import ProtocolError

__all__ = ["DataServer", "DataClient", "Incoming", "RemoteError", "MAX_PAYLOAD", "VERSION"]

log = logging.getLogger("jax_elastic.dataplane")

MAGIC, VERSION = b"JXDP", 1
_HELLO = struct.Struct("<4sH32s")     # magic, version, then the nonce (server) or the MAC (client)
_FRAME = struct.Struct("<BIQ")        # kind, header bytes, payload bytes
PIECE, END, STATE_REQUEST, STATE, REPLY = 1, 2, 3, 4, 5
MAX_HEADER = 64 << 10
MAX_PAYLOAD = 64 << 20                # as rpc.MAX_MESSAGE: a chunk is at most collective.MAX_CHUNK_BYTES
HANDSHAKE_SECONDS = 10.0
MAX_CONNECTIONS = 256                 # peers keep a few each; beyond this a caller is refused
_INLINE = 64 << 10                    # payloads up to this size go out in one write with their header
_OK = "OK"


class RemoteError(Exception):
    """The peer refused a request: ``code`` is the status name (``INVALID_ARGUMENT``, ...)."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message


def _mac(secret: str, nonce: bytes) -> bytes:
    return hmac.new(secret.encode(), b"jax-elastic data plane " + nonce, hashlib.sha256).digest()


def _read_exact(sock, view: memoryview | np.ndarray, what: str = "frame") -> None:
    """Fills ``view`` from ``sock``; ``ConnectionError`` when the peer closes first."""
    view = memoryview(view).cast("B") if not isinstance(view, memoryview) else view
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError(f"connection closed in the middle of a {what}")
        got += k


def _recv(sock, n: int) -> bytes:
    buf = bytearray(n)
    _read_exact(sock, memoryview(buf))
    return bytes(buf)


def _send_frame(sock, kind: int, header: bytes = b"", payload=b"") -> None:
    nbytes = len(payload)
    head = _FRAME.pack(kind, len(header), nbytes) + header
    if nbytes <= _INLINE:
        sock.sendall(head + bytes(payload))
    else:
        sock.sendall(head)
        sock.sendall(payload)


def _read_frame_head(sock) -> tuple[int, bytes, int]:
    """``(kind, header bytes, payload bytes)``; :class:`ProtocolError` for a frame no peer of ours sends."""
    kind, hlen, plen = _FRAME.unpack(_recv(sock, _FRAME.size))
    if kind not in (PIECE, END, STATE_REQUEST, STATE, REPLY) or hlen > MAX_HEADER or plen > MAX_PAYLOAD:
        raise ProtocolError(f"malformed data-plane frame (kind {kind}, header {hlen} bytes, payload {plen} bytes)")
    return kind, _recv(sock, hlen), plen


class Incoming:
    """A received chunk: its header's fields as attributes, and its payload still on the socket.

    ``fill(dest)`` reads the payload straight into the uint8 array ``dest``
    (of ``nbytes``); a chunk its consumer does not fill is skipped.
    """

    def __init__(self, header, nbytes: int, sock):
        self._header, self.nbytes, self._sock, self.filled = header, nbytes, sock, False

    def __getattr__(self, name):
        return getattr(self._header, name)

    def fill(self, dest: np.ndarray) -> None:
        if self.filled or dest.nbytes != self.nbytes:
            raise ProtocolError(f"a chunk of {self.nbytes} bytes read twice or into {dest.nbytes} bytes")
        _read_exact(self._sock, dest, "payload")
        self.filled = True

    def skip(self) -> None:
        if not self.filled:
            _read_exact(self._sock, np.empty(self.nbytes, dtype=np.uint8), "payload")
            self.filled = True


class _Stream:
    """The chunks of one stream of ``kind`` frames; ``end`` is its end frame ``(kind, header, payload)``
    (``END``, or a ``REPLY`` with its payload) once read. A chunk left unfilled is skipped."""

    def __init__(self, sock, kind: int, message_type, first: tuple[int, bytes, int] | None = None):
        self._sock, self._kind, self._type, self._head = sock, kind, message_type, first
        self._last: Incoming | None = None
        self.end: tuple[int, bytes, bytes] | None = None

    def __iter__(self):
        return self

    def __next__(self) -> Incoming:
        if self._last is not None:
            self._last.skip()
            self._last = None
        if self.end is not None:
            raise StopIteration
        head, self._head = self._head or _read_frame_head(self._sock), None
        kind, header, plen = head
        if kind != self._kind:
            if kind != REPLY and plen:
                raise ProtocolError(f"a frame of kind {kind} with a payload in a stream of kind {self._kind}")
            self.end = (kind, header, _recv(self._sock, plen))
            raise StopIteration
        try:
            parsed = self._type.FromString(header)
        except Exception as e:  # noqa: BLE001 - any parse failure is the peer's malformed message
            raise ProtocolError(f"a data-plane chunk header does not parse ({type(e).__name__})") from None
        self._last = Incoming(parsed, plen, self._sock)
        return self._last


class DataServer:
    """Accepts data-plane connections on ``host`` (any free port) and serves them, one thread each.

    ``on_push(chunks)`` consumes one push stream (an iterator of
    :class:`Incoming` ``TensorChunk`` s) and raises to refuse it;
    ``on_state(request)`` returns the :class:`Part` s of the state a
    ``GetStateRequest`` asks for, or raises. ``status_name(exc)`` names the
    status of a raised exception. ``refusals`` counts connections refused for
    their secret.
    """

    def __init__(self, host: str, *, secret: str, tls: auth.TlsFiles | None,
                 on_push: Callable[[Iterator[Incoming]], None], on_state: Callable[[pb.GetStateRequest], Iterator[Part]],
                 status_name: Callable[[BaseException], str], refusals: auth.Refusals | None = None,
                 dropped: Callable[[], bool] = lambda: False, port: int = 0):
        self._secret, self._on_push, self._on_state = secret, on_push, on_state
        self._status_name, self._refusals, self._dropped = status_name, refusals, dropped
        self._tls = tls.ssl_server_context() if tls is not None else None
        self._listener = socket.create_server((host, port), backlog=128)
        self.port = self._listener.getsockname()[1]
        self.address = f"{host}:{self.port}"
        self._lock = threading.Lock()
        self._conns: set = set()
        self._closed = False
        threading.Thread(target=self._accept, name="dataplane-accept", daemon=True).start()

    def close(self) -> None:
        """Stops accepting and closes every connection (their requests fail for their callers)."""
        with self._lock:
            self._closed = True
            conns, self._conns = list(self._conns), set()
        with contextlib.suppress(OSError):
            self._listener.close()
        for conn in conns:
            _shut(conn)

    def _accept(self) -> None:
        while True:
            try:
                conn, peer = self._listener.accept()
            except OSError:
                return   # closed
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                if len(self._conns) >= MAX_CONNECTIONS:
                    _shut(conn)   # a caller opening connections without end gets no more threads
                    continue
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn, f"ipv4:{peer[0]}:{peer[1]}"),
                             name="dataplane-conn", daemon=True).start()

    def _serve(self, conn: socket.socket, peer: str) -> None:
        sock = conn
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(HANDSHAKE_SECONDS)
            if self._tls is not None:
                sock = self._tls.wrap_socket(conn, server_side=True)
            if not self._handshake(sock, peer):
                return
            sock.settimeout(None)   # a peer may stay idle between steps for as long as it likes
            served = True
            while served:
                head = _read_frame_head(sock)
                if self._dropped():
                    return
                if head[0] == PIECE:
                    served = self._push(sock, head)
                elif head[0] == STATE_REQUEST:
                    served = self._state(sock, head)
                else:
                    raise ProtocolError(f"a stream cannot start with a frame of kind {head[0]}")
        except (OSError, ProtocolError, ConnectionError, struct.error) as e:
            log.debug("data-plane connection from %s ends: %s", peer, e)
        finally:
            with self._lock:
                self._conns.discard(conn)
            _shut(sock)

    def _handshake(self, sock, peer: str) -> bool:
        nonce = secrets.token_bytes(32)
        sock.sendall(_HELLO.pack(MAGIC, VERSION, nonce))
        magic, version, mac = _HELLO.unpack(_recv(sock, _HELLO.size))
        if magic != MAGIC or version != VERSION:
            reason = f"not a data-plane client of version {VERSION}"
        elif self._secret and not hmac.compare_digest(mac, _mac(self._secret, nonce)):
            reason = "missing or wrong run secret"
        else:
            sock.sendall(b"\x01")
            return True
        if self._refusals is not None:
            self._refusals.record("DataPlane/connect", peer, reason)
        return False

    def _reply(self, sock, exc: BaseException | None) -> None:
        code = _OK if exc is None else self._status_name(exc)
        _send_frame(sock, REPLY, code.encode(), b"" if exc is None else str(exc).encode()[:4096])

    def _push(self, sock, first) -> bool:
        """Serves one push stream; False when the connection must close (the stream was refused)."""
        chunks = _Stream(sock, PIECE, pb.TensorChunk, first)
        try:
            self._on_push(chunks)
            if chunks.end is None or chunks.end[0] != END:
                raise ProtocolError("the push stream did not end with END")
        except (OSError, ConnectionError):
            raise
        except Exception as e:  # noqa: BLE001 - refused: tell the sender, then drop the connection
            self._reply(sock, e)
            return False
        self._reply(sock, None)
        return True

    def _state(self, sock, head) -> bool:
        """Serves one state read; False when the connection must close."""
        try:
            if head[2]:
                raise ProtocolError("a state request carries no payload")
            try:
                request = pb.GetStateRequest.FromString(head[1])
            except Exception as e:  # noqa: BLE001
                raise ProtocolError(f"a state request does not parse ({type(e).__name__})") from None
            parts = iter(self._on_state(request))
            part = next(parts, None)
            while part is not None:
                _send_frame(sock, STATE, part.header.SerializeToString(), part.payload)
                part = next(parts, None)
        except (OSError, ConnectionError):
            raise
        except Exception as e:  # noqa: BLE001 - refused or failed midway (e.g. a chaos fault): tell the reader
            self._reply(sock, e)
            return False
        self._reply(sock, None)
        return True


def _shut(sock) -> None:
    """Closes ``sock`` so that a thread blocked on it returns at once."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()


class DataClient:
    """Connections to peers' data servers, kept open and reused per address. Thread-safe.

    Every call blocks at most until its ``time.monotonic()`` deadline and
    raises :class:`RemoteError` when the peer refused it, ``OSError`` /
    ``ConnectionError`` when the connection failed (the connection is then
    dropped; the next call opens a new one). :meth:`abort_pushes` makes every
    push in flight fail at once (a step was aborted).
    """

    def __init__(self, secret: str, tls: auth.TlsFiles | None):
        self._secret = secret
        self._tls = tls.ssl_client_context() if tls is not None else None
        self._lock = threading.Lock()
        self._idle: dict[str, list] = {}
        self._pushing: set = set()

    def close(self) -> None:
        with self._lock:
            socks = [s for ss in self._idle.values() for s in ss] + list(self._pushing)
            self._idle.clear()
        for s in socks:
            _shut(s)

    def abort_pushes(self) -> None:
        with self._lock:
            socks = list(self._pushing)
        for s in socks:
            _shut(s)

    def push(self, address: str, parts: Iterator[Part], deadline: float) -> None:
        """Streams ``parts`` (``TensorChunk`` headers) to ``address``; returns once the peer accepted them."""
        with self._connection(address, deadline, pushing=True) as sock:
            try:
                for part in parts:
                    _send_frame(sock, PIECE, part.header.SerializeToString(), part.payload)
                    _timeout(sock, deadline)
                _send_frame(sock, END)
            except OSError:
                _raise_reply(sock)   # the peer refused midway and closed: its reason, when it sent one
                raise
            kind, header, plen = _read_frame_head(sock)
            if kind != REPLY:
                raise ProtocolError(f"expected a reply, got a frame of kind {kind}")
            _check_reply(header, _recv(sock, plen))

    def get_state(self, address: str, request: pb.GetStateRequest, deadline: float) -> Iterator[Incoming]:
        """The ``StateChunk`` s of a peer's state; raises :class:`RemoteError` (before or midway) on refusal."""
        with self._connection(address, deadline) as sock:
            _send_frame(sock, STATE_REQUEST, request.SerializeToString())
            stream = _Stream(sock, STATE, pb.StateChunk)
            for chunk in stream:
                yield chunk
                _timeout(sock, deadline)
            kind, header, payload = stream.end
            if kind != REPLY:
                raise ProtocolError(f"a state stream ended with a frame of kind {kind}")
            _check_reply(header, payload)

    @contextlib.contextmanager
    def _connection(self, address: str, deadline: float, pushing: bool = False):
        with self._lock:
            idle = self._idle.get(address)
            sock = idle.pop() if idle else None
        if sock is None:
            sock = self._connect(address, deadline)
        _timeout(sock, deadline)
        if pushing:
            with self._lock:
                self._pushing.add(sock)
        ok = False
        try:
            yield sock
            ok = True
        finally:
            with self._lock:
                self._pushing.discard(sock)
                if ok:
                    self._idle.setdefault(address, []).append(sock)
            if not ok:
                _shut(sock)

    def _connect(self, address: str, deadline: float):
        host, _, port = address.rpartition(":")
        sock = socket.create_connection((host, int(port)), timeout=max(min(deadline - time.monotonic(),
                                                                           HANDSHAKE_SECONDS), 0.001))
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls is not None:
                sock = self._tls.wrap_socket(sock, server_hostname=host)
            magic, version, nonce = _HELLO.unpack(_recv(sock, _HELLO.size))
            if magic != MAGIC or version != VERSION:
                raise ConnectionError(f"{address} is not a data plane of version {VERSION}")
            sock.sendall(_HELLO.pack(MAGIC, VERSION, _mac(self._secret, nonce) if self._secret else bytes(32)))
            if _recv(sock, 1) != b"\x01":
                raise ConnectionError(f"{address} refused the data-plane handshake")
        except ConnectionError as e:
            _shut(sock)
            raise RemoteError("UNAUTHENTICATED", f"{address} refused the connection (wrong run secret?): {e}") \
                from None
        except BaseException:
            _shut(sock)
            raise
        return sock


def _timeout(sock, deadline: float) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    sock.settimeout(left)


def _check_reply(header: bytes, payload: bytes) -> None:
    code = header.decode(errors="replace")
    if code != _OK:
        raise RemoteError(code, payload.decode(errors="replace"))


def _raise_reply(sock) -> None:
    """After a failed send: raises the peer's ``RemoteError`` if it sent one before closing, else returns."""
    try:
        sock.settimeout(0.5)
        kind, header, plen = _read_frame_head(sock)
        payload = _recv(sock, plen)
    except (OSError, ProtocolError, struct.error):
        return
    if kind == REPLY:
        _check_reply(header, payload)
