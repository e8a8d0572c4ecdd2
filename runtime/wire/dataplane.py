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

On Linux, when it has a run secret and a way to serve states in place, the
server also listens on an abstract Unix socket named after its TCP address
(:func:`runtime.wire.cross_memory.local_name`): a reader on the same host
connects there, and a state read asked for with ``shared_memory`` is
answered with where the leaves lie, for the reader to copy them out of this
process's memory in one copy (:mod:`runtime.wire.cross_memory`). Only a
process of the same user may connect there, and only after the same
handshake.

This module is the server side (:class:`DataServer`, one per worker). The
wire format (handshake, frames, streams) is :mod:`runtime.wire.dataplane_wire`'s;
the client side, a worker's connections to its peers' servers, is
:mod:`runtime.wire.dataplane_client`.

After an error, or a frame it cannot parse (unknown kind, a header over 64
KiB, a payload over :data:`runtime.wire.dataplane_wire.MAX_PAYLOAD`), the server
replies if it can and closes the connection: a stream cannot be
resynchronized. Exceptions raised by the handlers travel as their status
names (as on gRPC, via :func:`runtime.wire.rpc.status_name`); the client raises
:class:`runtime.wire.dataplane_client.RemoteError`. While ``dropped()`` is true (a
chaos partition) the server closes every connection at its next frame
without answering.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import secrets
import socket
import struct
import threading
from collections.abc import Callable, Iterator

from runtime.wire import auth, cross_memory
from runtime._proto import elastic_pb2 as pb
from runtime.wire.dataplane_wire import (END, HANDSHAKE_SECONDS, HELLO, MAGIC, OK, PIECE, REPLY, SHARED, STATE,
                                         STATE_REQUEST, STEP, VERSION, ChunkStream, Incoming, handshake_mac,
                                         parse_message, read_frame_head, recv_bytes, send_frame, shut)
from runtime.core.errors import ProtocolError
from runtime.wire.parts import Part

__all__ = ["DataServer"]

log = logging.getLogger("jax_elastic.dataplane")

MAX_CONNECTIONS = 256                 # peers keep a few each; beyond this a caller is refused
SHARED_READ_SECONDS = 300.0           # longest a same-host reader may take to copy a state (it goes at memory speed)


class DataServer:
    """Accepts data-plane connections on ``host`` (any free port) and serves them, one thread each.

    ``on_push(chunks)`` consumes one push stream (an iterator of
    :class:`Incoming` ``TensorChunk`` s) and raises to refuse it;
    ``on_state(request)`` returns the :class:`Part` s of the state a
    ``GetStateRequest`` asks for, or raises. ``on_shared_state(request)``,
    when given, serves the same request made with ``shared_memory`` on the
    local socket: a generator that yields the ``SharedState`` (raising
    instead when it cannot), is advanced once more while the reader copies
    (the source's midway point), keeps those leaves where they are until it
    is closed (the reader done); ``local_address`` is that socket's
    name ("" when there is none: no secret, not Linux, or not asked for).
    ``status_name(exc)`` names the status of a raised exception.
    ``refusals`` counts connections refused for their secret.
    ``on_steps(sock, first)``, when given, serves a connection whose first
    frame (``first``) is a ``STEP``: the controller's step stream
    (:func:`runtime.worker.step_stream.serve_step_connection`), for the
    connection's life; a chaos partition drops its requests unanswered
    there rather than closing it.
    """

    def __init__(self, host: str, *, secret: str, tls: auth.TlsFiles | None,
                 on_push: Callable[[Iterator[Incoming]], None], on_state: Callable[[pb.GetStateRequest], Iterator[Part]],
                 status_name: Callable[[BaseException], str], refusals: auth.Refusals | None = None,
                 dropped: Callable[[], bool] = lambda: False, port: int = 0,
                 on_shared_state: Callable[[pb.GetStateRequest], Iterator[pb.SharedState]] | None = None,
                 on_steps: Callable[[socket.socket, tuple[int, bytes, int]], None] | None = None):
        self._secret, self._on_push, self._on_state = secret, on_push, on_state
        self._on_steps = on_steps
        self._on_shared_state = on_shared_state
        self._status_name, self._refusals, self._dropped = status_name, refusals, dropped
        self._tls = tls.ssl_server_context() if tls is not None else None
        self._listener = socket.create_server((host, port), backlog=128)
        self.port = self._listener.getsockname()[1]
        self.address = f"{host}:{self.port}"
        self._lock = threading.Lock()
        self._conns: set = set()
        self._closed = False
        self._local = None
        self.local_address = ""
        if on_shared_state is not None and secret and cross_memory.supported():
            self._local = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                self._local.bind(cross_memory.local_name(self.address))
                self._local.listen(16)
                self.local_address = cross_memory.local_name(self.address)
            except OSError as e:   # a stale name (cannot happen for a live TCP port) or no abstract namespace
                log.info("data plane: no local socket (%s); same-host reads use TCP", e)
                self._local.close()
                self._local = None
        threading.Thread(target=self._accept, args=(self._listener,), name="dataplane-accept", daemon=True).start()
        if self._local is not None:
            threading.Thread(target=self._accept, args=(self._local,), name="dataplane-accept-local",
                             daemon=True).start()

    def close(self) -> None:
        """Stops accepting and closes every connection (their requests fail for their callers)."""
        with self._lock:
            self._closed = True
            conns, self._conns = list(self._conns), set()
        for listener in (self._listener, self._local):
            if listener is not None:
                with contextlib.suppress(OSError):
                    listener.close()
        for conn in conns:
            shut(conn)

    def _accept(self, listener: socket.socket) -> None:
        local = listener.family == socket.AF_UNIX
        while True:
            try:
                conn, peer = listener.accept()
            except OSError:
                return   # closed
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                if len(self._conns) >= MAX_CONNECTIONS:
                    shut(conn)   # a caller opening connections without end gets no more threads
                    continue
                self._conns.add(conn)
            target, args = (self._serve_local, (conn,)) if local else (self._serve, (conn, f"ipv4:{peer[0]}:{peer[1]}"))
            threading.Thread(target=target, args=args, name="dataplane-conn", daemon=True).start()

    def _serve_local(self, conn: socket.socket) -> None:
        """A connection on the local socket: the same handshake and requests, from a process of this user only
        (no TLS: it never leaves the host), and state reads may be shared."""
        pid, uid = cross_memory.peer_credentials(conn)
        peer = f"local:pid {pid}"
        if uid != os.getuid():
            if self._refusals is not None:
                self._refusals.record("DataPlane/connect", peer, "a process of another user")
            with self._lock:
                self._conns.discard(conn)
            shut(conn)
            return
        self._serve(conn, peer, reader=pid)

    def _serve(self, conn: socket.socket, peer: str, reader: int = 0) -> None:
        """Serves one connection; ``reader``: the pid of a same-host peer (the local socket), else 0."""
        sock = conn
        try:
            if not reader:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(HANDSHAKE_SECONDS)
            if self._tls is not None and not reader:
                sock = self._tls.wrap_socket(conn, server_side=True)
            if not self._handshake(sock, peer):
                return
            sock.settimeout(None)   # a peer may stay idle between steps for as long as it likes
            served = True
            while served:
                head = read_frame_head(sock)
                if head[0] == STEP and self._on_steps is not None and not reader:
                    self._on_steps(sock, head)   # the connection's life: drops requests itself while partitioned
                    return
                if self._dropped():
                    return
                if head[0] == PIECE:
                    served = self._push(sock, head)
                elif head[0] == STATE_REQUEST:
                    served = self._state(sock, head, reader)
                else:
                    raise ProtocolError(f"a stream cannot start with a frame of kind {head[0]}")
        except (OSError, ProtocolError, ConnectionError, struct.error) as e:
            log.debug("data-plane connection from %s ends: %s", peer, e)
        finally:
            with self._lock:
                self._conns.discard(conn)
            shut(sock)

    def _handshake(self, sock, peer: str) -> bool:
        nonce = secrets.token_bytes(32)
        sock.sendall(HELLO.pack(MAGIC, VERSION, nonce))
        magic, version, mac = HELLO.unpack(recv_bytes(sock, HELLO.size))
        if magic != MAGIC or version != VERSION:
            reason = f"not a data-plane client of version {VERSION}"
        elif self._secret and not hmac.compare_digest(mac, handshake_mac(self._secret, nonce)):
            reason = "missing or wrong run secret"
        else:
            sock.sendall(b"\x01")
            return True
        if self._refusals is not None:
            self._refusals.record("DataPlane/connect", peer, reason)
        return False

    def _reply(self, sock, exc: BaseException | None) -> None:
        code = OK if exc is None else self._status_name(exc)
        send_frame(sock, REPLY, code.encode(), b"" if exc is None else str(exc).encode()[:4096])

    def _push(self, sock, first) -> bool:
        """Serves one push stream; False when the connection must close (the stream was refused)."""
        chunks = ChunkStream(sock, PIECE, pb.TensorChunk, first)
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

    def _shared_state(self, sock, request: pb.GetStateRequest, reader: int) -> bool:
        """Serves one shared state read (see the module's wire notes); False when the connection must close."""
        if not reader or self._on_shared_state is None:
            raise ProtocolError("a shared state read is only served on the local socket")
        shared = self._on_shared_state(request)
        try:
            state = next(shared)   # raises (refused) before anything is sent
            with cross_memory.readable_by(reader):
                send_frame(sock, SHARED, state.SerializeToString())
                next(shared, None)   # the source's own part midway (a chaos fault may strike here)
                sock.settimeout(SHARED_READ_SECONDS)   # a reader that stops answering does not pin the leaves
                kind, header, plen = read_frame_head(sock)   # the reader copies meanwhile, then says so
                sock.settimeout(None)
                if kind != END or header or plen:
                    raise ProtocolError(f"expected the end of a shared state read, got a frame of kind {kind}")
        finally:
            shared.close()   # the leaves may go now
        self._reply(sock, None)
        return True

    def _state(self, sock, head, reader: int) -> bool:
        """Serves one state read; False when the connection must close."""
        try:
            if head[2]:
                raise ProtocolError("a state request carries no payload")
            request = parse_message(pb.GetStateRequest, head[1], "a state request")
            if request.shared_memory:
                return self._shared_state(sock, request, reader)
            parts = iter(self._on_state(request))
            part = next(parts, None)
            while part is not None:
                send_frame(sock, STATE, part.header.SerializeToString(), part.payload)
                part = next(parts, None)
        except (OSError, ConnectionError):
            raise
        except Exception as e:  # noqa: BLE001 - refused or failed midway (e.g. a chaos fault): tell the reader
            self._reply(sock, e)
            return False
        self._reply(sock, None)
        return True
