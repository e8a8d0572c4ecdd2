"""The data plane over real loopback sockets: pushes and state reads arrive bit-exact and checked,
strangers and malformed frames are refused without harming the server, aborts unblock pushes."""

import socket
import struct
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.wire import auth, rpc
from runtime._proto import elastic_pb2 as pb
from runtime.wire.parts import REDUCE_SCATTER, pieces
from runtime.worker.mailbox import Mailbox
from runtime.state.state_copy import assemble_state, state_chunks, state_digest
from runtime.wire.dataplane import DataServer
from runtime.wire.dataplane_client import DataClient, RemoteError
from runtime.core.errors import ProtocolError, StaleEpochError
from runtime.core.microbatch import Node

FENCE = pb.Fence(run_id="r", epoch=1)
SECRET = "s3cret"


class Peer:
    """A data server whose pushes land in a mailbox and whose state is ``leaves``."""

    def __init__(self, secret=SECRET, tls=None, on_push=None):
        self.box = Mailbox()
        self.leaves = [np.arange(1000, dtype=np.float32).reshape(10, 100), np.array(7, dtype=np.int32)]
        self.refusals = auth.Refusals()
        self.partitioned = False
        self.server = DataServer("127.0.0.1", secret=secret, tls=tls, status_name=rpc.status_name,
                                 on_push=on_push or (lambda chunks: self.box.receive(chunks, lambda f: None)),
                                 on_state=self.state, refusals=self.refusals, dropped=lambda: self.partitioned)

    def state(self, request):
        if request.applied_steps != 3:
            raise StaleEpochError(f"state is at 3 applied steps, asked for {request.applied_steps}")
        return state_chunks(self.leaves, 3, chunk_bytes=1024, digest=state_digest(self.leaves))


@pytest.fixture
def peer():
    p = Peer()
    yield p
    p.server.close()


def deadline(seconds=10.0):
    return time.monotonic() + seconds


def test_a_push_arrives_bit_exact_over_a_reused_connection(peer):
    client = DataClient(SECRET, None)
    data = np.random.default_rng(0).standard_normal(100_000).astype(np.float32)
    for step in range(3):   # one connection, reused
        client.push(peer.server.address, pieces(FENCE, step, REDUCE_SCATTER, 1, Node(1, 0), data, 4096), deadline())
        got = peer.box.wait(1, step, REDUCE_SCATTER, {1}, deadline())
        np.testing.assert_array_equal(got[1][Node(1, 0)], data)
    assert len(peer.server._conns) == 1
    client.close()


def test_a_refused_push_raises_its_status_and_the_next_push_still_works(peer):
    client = DataClient(SECRET, None)
    bad = list(pieces(FENCE, 0, REDUCE_SCATTER, 1, Node(1, 0), np.ones(64, np.float32), 64))
    bad[1].header.xxh3 ^= 1
    with pytest.raises(RemoteError) as err:
        client.push(peer.server.address, iter(bad), deadline())
    assert err.value.code == "INVALID_ARGUMENT" and "checksum" in err.value.message
    client.push(peer.server.address, pieces(FENCE, 1, REDUCE_SCATTER, 1, Node(1, 0), np.ones(64, np.float32), 64),
                deadline())
    assert peer.box.wait(1, 1, REDUCE_SCATTER, {1}, deadline())[1][Node(1, 0)].sum() == 64
    assert peer.box._held == 0


def test_a_state_read_is_assembled_and_hash_checked(peer):
    client = DataClient(SECRET, None)
    leaves, applied, digest = assemble_state(client.get_state(peer.server.address,
                                                              pb.GetStateRequest(fence=FENCE, applied_steps=3),
                                                              deadline()))
    assert applied == 3 and digest == state_digest(peer.leaves)
    np.testing.assert_array_equal(leaves[0], peer.leaves[0])
    with pytest.raises(RemoteError) as err:
        list(client.get_state(peer.server.address, pb.GetStateRequest(fence=FENCE, applied_steps=5), deadline()))
    assert err.value.code == "FAILED_PRECONDITION"


def test_a_stranger_without_the_secret_is_refused_and_counted(peer):
    with pytest.raises(RemoteError) as err:
        DataClient("wrong", None).push(peer.server.address, iter(()), deadline())
    assert err.value.code == "UNAUTHENTICATED"
    assert [(m, r) for m, _, r, _ in peer.refusals.drain()] == [("DataPlane/connect", "missing or wrong run secret")]


@pytest.mark.parametrize("garbage", [
    b"GET / HTTP/1.1\r\n\r\n" + b"x" * 64,                       # not our protocol at all
    struct.pack("<BIQ", 9, 0, 0),                                # an unknown frame kind
    struct.pack("<BIQ", 1, 1 << 30, 0),                          # a header of 1 GiB
    struct.pack("<BIQ", 1, 3, 1 << 40) + b"abc",                 # a payload of 1 TiB
    struct.pack("<BIQ", 1, 4, 4) + b"\xff\xff\xff\xff" + b"dddd",   # a header that does not parse
])
def test_malformed_frames_close_the_connection_and_the_server_keeps_serving(peer, garbage):
    with socket.create_connection(("127.0.0.1", peer.server.port), timeout=5) as s:
        hello = s.recv(64)
        if not garbage.startswith(b"GET"):
            from runtime.wire.dataplane_wire import HELLO, handshake_mac
            s.sendall(HELLO.pack(b"JXDP", 1, handshake_mac(SECRET, hello[6:38])))
            assert s.recv(1) == b"\x01"
        s.sendall(garbage)
        s.settimeout(5)
        rest = b""
        while chunk := s.recv(4096):   # the server ends the connection (after a reply, if it can send one)
            rest += chunk
    test_a_push_arrives_bit_exact_over_a_reused_connection(peer)


def test_an_abort_unblocks_a_push_to_a_peer_that_stopped_reading():
    stuck = threading.Event()
    peer = Peer(on_push=lambda chunks: stuck.wait(30))
    client = DataClient(SECRET, None)
    big = np.zeros(16 << 20, np.float32)   # 64 MB: more than the socket buffers hold
    errors = []

    def push():
        try:
            client.push(peer.server.address, pieces(FENCE, 0, REDUCE_SCATTER, 1, Node(1, 0), big, 1 << 20),
                        deadline(30))
        except Exception as e:  # noqa: BLE001
            errors.append(e)
    t = threading.Thread(target=push)
    t.start()
    time.sleep(0.5)
    client.abort_pushes()
    t.join(5)
    assert not t.is_alive() and errors and isinstance(errors[0], OSError)
    stuck.set()
    peer.server.close()


def test_a_partitioned_server_drops_requests_unanswered(peer):
    client = DataClient(SECRET, None)
    peer.partitioned = True
    with pytest.raises((OSError, ProtocolError)):
        client.push(peer.server.address, pieces(FENCE, 0, REDUCE_SCATTER, 1, Node(1, 0), np.ones(8, np.float32), 64),
                    deadline(5))
    peer.partitioned = False
    client.push(peer.server.address, pieces(FENCE, 0, REDUCE_SCATTER, 1, Node(1, 0), np.ones(8, np.float32), 64),
                deadline(5))


def test_mutual_tls_carries_a_push_and_refuses_a_plain_client(pem):
    tls = pem
    peer = Peer(tls=tls)
    try:
        DataClient(SECRET, tls).push(peer.server.address,
                                     pieces(FENCE, 0, REDUCE_SCATTER, 1, Node(1, 0), np.ones(8, np.float32), 64),
                                     deadline())
        assert peer.box.wait(1, 0, REDUCE_SCATTER, {1}, deadline())[1][Node(1, 0)].sum() == 8
        with pytest.raises((OSError, RemoteError)):
            DataClient(SECRET, None).push(peer.server.address, iter(()), deadline(1))
    finally:
        peer.server.close()


@settings(max_examples=40, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(garbage=st.binary(max_size=300), frames=st.lists(st.tuples(st.integers(0, 7), st.binary(max_size=40),
                                                                  st.integers(0, 64)), max_size=4))
def test_random_bytes_and_frames_after_the_handshake_never_harm_the_server(peer, garbage, frames):
    from runtime.wire.dataplane_wire import FRAME, HELLO, handshake_mac
    with socket.create_connection(("127.0.0.1", peer.server.port), timeout=5) as s:
        hello = s.recv(HELLO.size)
        s.sendall(HELLO.pack(b"JXDP", 1, handshake_mac(SECRET, hello[6:38])))
        assert s.recv(1) == b"\x01"
        try:
            for kind, header, plen in frames:
                s.sendall(FRAME.pack(kind, len(header), plen) + header + b"\x00" * plen)
            s.sendall(garbage)
            s.shutdown(socket.SHUT_WR)
            while s.recv(4096):
                pass
        except OSError:
            pass   # the server closed first
    client = DataClient(SECRET, None)
    client.push(peer.server.address, pieces(FENCE, 9, REDUCE_SCATTER, 1, Node(1, 0), np.ones(8, np.float32), 64),
                deadline())
    assert peer.box.wait(1, 9, REDUCE_SCATTER, {1}, deadline())[1][Node(1, 0)].sum() == 8
    client.close()
