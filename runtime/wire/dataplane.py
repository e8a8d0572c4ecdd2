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
import secrets
import socket
import struct
import threading
from collections.abc import Callable, Iterator

from runtime.wire import auth
from runtime._proto import elastic_pb2 as pb
from runtime.wire.dataplane_wire import (END, HANDSHAKE_SECONDS, HELLO, MAGIC, OK, PIECE, REPLY, STATE, STATE_REQUEST,
                                    VERSION, ChunkStream, Incoming, handshake_mac, read_frame_head, recv_bytes,
                                    send_frame, shut)
from runtime.core.errors import ProtocolError
from runtime.wire.parts import Part

__all__ = ["DataServer"]

log = logging.getLogger("jax_elastic.dataplane")

MAX_CONNECTIONS = 256                 # peers keep a few each; beyond this a caller is refused


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
            shut(conn)

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
                    shut(conn)   # a caller opening connections without end gets no more threads
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
                head = read_frame_head(sock)
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
                send_frame(sock, STATE, part.header.SerializeToString(), part.payload)
                part = next(parts, None)
        except (OSError, ConnectionError):
            raise
        except Exception as e:  # noqa: BLE001 - refused or failed midway (e.g. a chaos fault): tell the reader
            self._reply(sock, e)
            return False
        self._reply(sock, None)
        return True
