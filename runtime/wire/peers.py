"""Channels from a worker to its peers (gRPC), opened on first use and closed on an abort."""

from __future__ import annotations

import contextlib
import threading

import grpc

from runtime.wire import rpc
from runtime._proto import elastic_pb2_grpc as pb_grpc

__all__ = ["PeerChannels"]


class PeerChannels:
    """Channels to peer workers, one per address, opened on first use. Thread-safe.

    Counts the pushes in flight per address, so that an abort closes exactly
    the channels a step may be blocked on: closing a channel cancels its calls
    at once (a blocking push to a hung peer would otherwise wait until the
    step deadline); the next call to that address opens a new channel.
    """

    def __init__(self, secret: str, tls):
        self._secret = secret
        self._tls = tls
        self._lock = threading.Lock()
        self._open: dict[str, tuple[grpc.Channel, pb_grpc.WorkerStub]] = {}
        self._pushing: dict[str, int] = {}   # address -> pushes in flight to it

    def stub(self, address: str) -> pb_grpc.WorkerStub:
        with self._lock:
            return self._stub(address)

    @contextlib.contextmanager
    def pushing(self, address: str):
        """The stub for ``address``, with a push to it counted in flight while the block runs."""
        with self._lock:
            stub = self._stub(address)
            self._pushing[address] = self._pushing.get(address, 0) + 1
        try:
            yield stub
        finally:
            with self._lock:
                self._pushing[address] -= 1

    def _stub(self, address: str) -> pb_grpc.WorkerStub:
        entry = self._open.get(address)
        if entry is None:
            ch = rpc.channel(address, self._secret, self._tls)
            entry = self._open[address] = (ch, pb_grpc.WorkerStub(ch))
        return entry[1]

    def close_pushing(self) -> None:
        """Closes the channels with pushes in flight; those pushes raise ``ValueError`` or CANCELLED."""
        with self._lock:
            for address in [a for a, n in self._pushing.items() if n]:
                entry = self._open.pop(address, None)
                if entry is not None:
                    entry[0].close()
