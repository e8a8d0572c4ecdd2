"""The data plane's client side (:mod:`runtime.wire.dataplane`): a worker's connections to its peers' data servers.

:class:`DataClient` pushes a step's pieces to a peer and reads a peer's
state, over connections it keeps open and reuses per address, speaking
:mod:`runtime.wire.dataplane_wire`. A refusal the peer sent (a status name and
its message) is raised as :class:`RemoteError`.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

from runtime.wire import auth, cross_memory
from runtime._proto import elastic_pb2 as pb
from runtime.wire.dataplane_wire import (END, HANDSHAKE_SECONDS, HELLO, MAGIC, OK, PIECE, REPLY, SHARED, STATE,
                                         STATE_REQUEST, VERSION, ChunkStream, Incoming, handshake_mac, parse_message,
                                         read_frame_head, recv_bytes, send_frame, shut)
from runtime.core.errors import ProtocolError
from runtime.wire.parts import Part

__all__ = ["DataClient", "NotLocal", "RemoteError", "check_reply"]

T = TypeVar("T")


class RemoteError(Exception):
    """The peer refused a request: ``code`` is the status name (``INVALID_ARGUMENT``, ...)."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message


class NotLocal(Exception):
    """A shared state read cannot be made: the source is on another host (or in another network namespace),
    serves no local socket, or this host does not let one process read another. Nothing was changed on either
    side; read the state over TCP instead."""


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
            shut(s)

    def abort_pushes(self) -> None:
        with self._lock:
            socks = list(self._pushing)
        for s in socks:
            shut(s)

    def push(self, address: str, parts: Iterator[Part], deadline: float) -> None:
        """Streams ``parts`` (``TensorChunk`` headers) to ``address``; returns once the peer accepted them."""
        with self._connection(address, deadline, pushing=True) as sock:
            try:
                for part in parts:
                    send_frame(sock, PIECE, part.header.SerializeToString(), part.payload)
                    _timeout(sock, deadline)
                send_frame(sock, END)
            except OSError:
                _raise_reply(sock)   # the peer refused midway and closed: its reason, when it sent one
                raise
            kind, header, plen = read_frame_head(sock)
            if kind != REPLY:
                raise ProtocolError(f"expected a reply, got a frame of kind {kind}")
            check_reply(header, recv_bytes(sock, plen))

    def get_state(self, address: str, request: pb.GetStateRequest, deadline: float) -> Iterator[Incoming]:
        """The ``StateChunk`` s of a peer's state; raises :class:`RemoteError` (before or midway) on refusal."""
        with self._connection(address, deadline) as sock:
            send_frame(sock, STATE_REQUEST, request.SerializeToString())
            stream = ChunkStream(sock, STATE, pb.StateChunk)
            for chunk in stream:
                yield chunk
                _timeout(sock, deadline)
            kind, header, payload = stream.end
            if kind != REPLY:
                raise ProtocolError(f"a state stream ended with a frame of kind {kind}")
            check_reply(header, payload)

    def read_shared_state(self, address: str, request: pb.GetStateRequest, deadline: float,
                          copy: Callable[[pb.SharedState, int], T]) -> T:
        """Reads the state of the data server at ``address`` out of its memory, when it is on this host.

        Connects to its local socket, asks for ``request`` with
        ``shared_memory``, and calls ``copy(state, pid)`` with the
        ``SharedState`` and the source's pid (as the kernel saw it connect);
        the source keeps its leaves in place until ``copy`` returns. Returns
        what ``copy`` returned once the source confirmed it held them to the
        end. Raises :class:`NotLocal` when it cannot be done this way (no
        source socket on this host, a source process of another user, or
        ``copy`` raised :class:`runtime.wire.cross_memory.CrossMemoryUnavailable`),
        :class:`RemoteError` when the source refused, ``OSError`` /
        ``ConnectionError`` when the copy failed midway.
        """
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        except (OSError, AttributeError) as e:
            raise NotLocal(f"no Unix sockets here: {e}") from None
        try:
            _timeout(sock, deadline)
            try:
                sock.connect(cross_memory.local_name(address))
            except (FileNotFoundError, ConnectionRefusedError) as e:
                raise NotLocal(f"{address} has no local socket on this host ({e.strerror})") from None
            pid, uid = cross_memory.peer_credentials(sock)
            if uid != os.getuid() or pid <= 0:
                raise NotLocal(f"the local socket of {address} belongs to another user or pid namespace")
            self._greet(sock, address)
            _timeout(sock, deadline)
            send_frame(sock, STATE_REQUEST, pb.GetStateRequest(fence=request.fence, applied_steps=request.applied_steps,
                                                               shared_memory=True).SerializeToString())
            kind, header, plen = read_frame_head(sock)
            if kind == REPLY:
                check_reply(header, recv_bytes(sock, plen))
                raise ProtocolError("a shared state read was answered OK without a state")
            if kind != SHARED or plen:
                raise ProtocolError(f"expected a shared state, got a frame of kind {kind}")
            state = parse_message(pb.SharedState, header, "a shared state")
            try:
                result = copy(state, pid)
            except cross_memory.CrossMemoryUnavailable as e:
                raise NotLocal(f"this host does not let a worker read another's memory: {e}") from None
            _timeout(sock, deadline)
            send_frame(sock, END)
            kind, header, plen = read_frame_head(sock)
            if kind != REPLY:
                raise ProtocolError(f"a shared state read ended with a frame of kind {kind}")
            check_reply(header, recv_bytes(sock, plen))
            return result
        finally:
            shut(sock)

    @contextlib.contextmanager
    def _connection(self, address: str, deadline: float, pushing: bool = False):
        with self._lock:
            idle = self._idle.get(address)
            sock = idle.pop() if idle else None
        if sock is None:
            sock = self.connect(address, deadline)
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
                shut(sock)

    def connect(self, address: str, deadline: float) -> socket.socket:
        """A new connection to ``address``, greeted (TLS and the run secret's handshake), for the caller to own
        and close (:meth:`push` and the state reads keep theirs open for reuse); :class:`RemoteError`
        (UNAUTHENTICATED) when refused, ``OSError`` when it cannot be made."""
        host, _, port = address.rpartition(":")
        sock = socket.create_connection((host, int(port)), timeout=max(min(deadline - time.monotonic(),
                                                                           HANDSHAKE_SECONDS), 0.001))
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls is not None:
                sock = self._tls.wrap_socket(sock, server_hostname=host)
            self._greet(sock, address)
        except BaseException:
            shut(sock)
            raise
        return sock

    def _greet(self, sock, address: str) -> None:
        """The handshake on a new connection; :class:`RemoteError` (UNAUTHENTICATED) when the server refuses it."""
        try:
            magic, version, nonce = HELLO.unpack(recv_bytes(sock, HELLO.size))
            if magic != MAGIC or version != VERSION:
                raise ConnectionError(f"{address} is not a data plane of version {VERSION}")
            sock.sendall(HELLO.pack(MAGIC, VERSION, handshake_mac(self._secret, nonce) if self._secret else bytes(32)))
            if recv_bytes(sock, 1) != b"\x01":
                raise ConnectionError(f"{address} refused the data-plane handshake")
        except ConnectionError as e:
            raise RemoteError("UNAUTHENTICATED", f"{address} refused the connection (wrong run secret?): {e}") \
                from None


def _timeout(sock, deadline: float) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    sock.settimeout(left)


def check_reply(header: bytes, payload: bytes) -> None:
    """A ``REPLY`` frame read: returns when it says ``OK``, else raises :class:`RemoteError` with its status name."""
    code = header.decode(errors="replace")
    if code != OK:
        raise RemoteError(code, payload.decode(errors="replace"))


def _raise_reply(sock) -> None:
    """After a failed send: raises the peer's ``RemoteError`` if it sent one before closing, else returns."""
    try:
        sock.settimeout(0.5)
        kind, header, plen = read_frame_head(sock)
        payload = recv_bytes(sock, plen)
    except (OSError, ProtocolError, struct.error):
        return
    if kind == REPLY:
        check_reply(header, payload)
