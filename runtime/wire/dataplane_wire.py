"""The data plane's wire (:mod:`runtime.wire.dataplane`): the handshake, the frames and the chunk streams.

Both sides speak it through what is here: the server
(:class:`runtime.wire.dataplane.DataServer`) and the client
(:class:`runtime.wire.dataplane_client.DataClient`). Nothing here opens a socket
or decides what a stream means; it reads and writes the bytes.

Wire format (little-endian):

- Connection: the server sends ``HELLO`` (``b"JXDP"``, u16 version, a 32-byte
  nonce); the client answers ``b"JXDP"``, the version and
  HMAC-SHA256(run secret, nonce) (:func:`handshake_mac`); the server answers
  one byte ``1`` or counts the refusal (``DataPlane/connect``) and closes.
  With TLS files the socket is wrapped in mutual TLS first (the files gRPC
  uses).
- Frames: ``<BIQ`` (kind, header bytes, payload bytes), the header (a
  serialized protobuf, ``data`` empty), the payload.
- A push: ``PIECE`` frames (``TensorChunk`` headers), then ``END``; the server
  answers one ``REPLY`` (header: a status code name such as ``OK`` or
  ``INVALID_ARGUMENT``; payload: the message).
- A state read: ``STATE_REQUEST`` (``GetStateRequest``); the server answers
  ``STATE`` frames (``StateChunk`` headers) then a ``REPLY``, or a ``REPLY``
  with the error.
- A shared state read (on the server's local socket only, same host;
  :mod:`runtime.wire.cross_memory`): ``STATE_REQUEST`` with
  ``shared_memory``; the server answers one ``SHARED`` frame (a
  ``SharedState``: where each leaf lies in its memory) or a ``REPLY`` with
  the error; the reader copies the leaves itself, sends ``END`` and the
  server answers a ``REPLY`` (until then it keeps the leaves in place).
- A step stream (the controller's, :mod:`runtime.worker.step_stream`):
  ``STEP`` frames each way for the connection's life, each payload one
  ``StepRequest`` (controller) or ``StepReply`` (worker), no header; the
  controller ends it with ``END``, the worker answers the steps in flight,
  then ``END`` (or a ``REPLY`` with the error, for a malformed request).

A frame no peer of ours sends (unknown kind, a header over 64 KiB, a payload
over :data:`MAX_PAYLOAD`) is a :class:`~runtime.core.errors.ProtocolError`.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import socket
import struct

import numpy as np

from runtime.core.errors import ProtocolError

__all__ = ["END", "FRAME", "HANDSHAKE_SECONDS", "HELLO", "MAGIC", "MAX_HEADER", "MAX_PAYLOAD", "OK", "PIECE", "REPLY",
           "SHARED", "STATE", "STATE_REQUEST", "STEP", "VERSION", "ChunkStream", "Incoming", "handshake_mac",
           "parse_message", "read_exact", "read_frame_head", "recv_bytes", "send_frame", "shut"]

MAGIC, VERSION = b"JXDP", 1
HELLO = struct.Struct("<4sH32s")      # magic, version, then the nonce (server) or the MAC (client)
FRAME = struct.Struct("<BIQ")         # kind, header bytes, payload bytes
PIECE, END, STATE_REQUEST, STATE, REPLY, SHARED, STEP = 1, 2, 3, 4, 5, 6, 7
MAX_HEADER = 64 << 10
MAX_PAYLOAD = 64 << 20                # as rpc.MAX_MESSAGE: a chunk is at most collective.MAX_CHUNK_BYTES
HANDSHAKE_SECONDS = 10.0
_INLINE = 64 << 10                    # payloads up to this size go out in one write with their header
OK = "OK"
_KINDS = (PIECE, END, STATE_REQUEST, STATE, REPLY, SHARED, STEP)


def handshake_mac(secret: str, nonce: bytes) -> bytes:
    return hmac.new(secret.encode(), b"jax-elastic data plane " + nonce, hashlib.sha256).digest()


def read_exact(sock, view: memoryview | np.ndarray, what: str = "frame") -> None:
    """Fills ``view`` from ``sock``; ``ConnectionError`` when the peer closes first."""
    view = memoryview(view).cast("B") if not isinstance(view, memoryview) else view
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError(f"connection closed in the middle of a {what}")
        got += k


def recv_bytes(sock, n: int) -> bytes:
    buf = bytearray(n)
    read_exact(sock, memoryview(buf))
    return bytes(buf)


def send_frame(sock, kind: int, header: bytes = b"", payload=b"") -> None:
    nbytes = len(payload)
    head = FRAME.pack(kind, len(header), nbytes) + header
    if nbytes <= _INLINE:
        sock.sendall(head + bytes(payload))
    else:
        sock.sendall(head)
        sock.sendall(payload)


def read_frame_head(sock) -> tuple[int, bytes, int]:
    """``(kind, header bytes, payload bytes)``; :class:`ProtocolError` for a frame no peer of ours sends."""
    kind, hlen, plen = FRAME.unpack(recv_bytes(sock, FRAME.size))
    if kind not in _KINDS or hlen > MAX_HEADER or plen > MAX_PAYLOAD:
        raise ProtocolError(f"malformed data-plane frame (kind {kind}, header {hlen} bytes, payload {plen} bytes)")
    return kind, recv_bytes(sock, hlen), plen


def parse_message(message_type, data: bytes, what: str):
    """``data`` parsed as a ``message_type`` protobuf; :class:`ProtocolError` naming ``what`` when it does not
    parse (any parse failure is the peer's malformed message)."""
    try:
        return message_type.FromString(data)
    except Exception as e:  # noqa: BLE001 - protobuf raises several types for bad bytes
        raise ProtocolError(f"{what} does not parse ({type(e).__name__})") from None


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
        read_exact(self._sock, dest, "payload")
        self.filled = True

    def skip(self) -> None:
        if not self.filled:
            read_exact(self._sock, np.empty(self.nbytes, dtype=np.uint8), "payload")
            self.filled = True


class ChunkStream:
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
        head, self._head = self._head or read_frame_head(self._sock), None
        kind, header, plen = head
        if kind != self._kind:
            if kind != REPLY and plen:
                raise ProtocolError(f"a frame of kind {kind} with a payload in a stream of kind {self._kind}")
            self.end = (kind, header, recv_bytes(self._sock, plen))
            raise StopIteration
        self._last = Incoming(parse_message(self._type, header, "a data-plane chunk header"), plen, self._sock)
        return self._last


def shut(sock) -> None:
    """Closes ``sock`` so that a thread blocked on it returns at once."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()

