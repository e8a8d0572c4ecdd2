"""Same-host state reads (runtime.wire.cross_memory): the reader copies a source's leaves out of its memory,
over the data server's local socket, bit-exact and hash-checked; every way it cannot be done is a clear
outcome (NotLocal: take TCP; a refusal; a failed copy), and the source holds its leaves until the reader is done."""

import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from runtime.wire import auth, cross_memory, rpc
from runtime._proto import elastic_pb2 as pb
from runtime.state.state_copy import (assemble_state, copy_shared_state, landing, shared_state, state_chunks,
                                      state_digest)
from runtime.worker.worker_state import Landing
from runtime.wire.parts import inline
from runtime.wire.dataplane import DataServer
from runtime.wire.dataplane_client import DataClient, NotLocal, RemoteError
from runtime.core.errors import ProtocolError, StaleEpochError

pytestmark = pytest.mark.skipif(not cross_memory.supported(), reason="same-host reads need Linux")

FENCE = pb.Fence(run_id="r", epoch=1)
SECRET = "s3cret"
ASK = pb.GetStateRequest(fence=FENCE, applied_steps=3)


def leaves_of(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((300, 700)).astype(np.float32),          # several copy pieces' worth is below
            np.arange(5, dtype=np.int32), np.zeros((0, 4), np.float32),   # an empty leaf still counts in the digest
            rng.integers(0, 2**16, (3, 5), dtype=np.uint16)]


class Source:
    """A data server in this process whose state is ``leaves`` at 3 applied steps."""

    def __init__(self, leaves, *, shared=True, digest=None, secret=SECRET):
        self.leaves, self.held, self.closed = leaves, 0, 0
        self.digest = digest or state_digest(leaves)
        self.server = DataServer("127.0.0.1", secret=secret, tls=None, status_name=rpc.status_name,
                                 on_push=lambda chunks: None, on_state=self.state,
                                 on_shared_state=self.shared if shared else None, refusals=auth.Refusals())

    def state(self, request):
        return state_chunks(self.leaves, 3, 1 << 20, self.digest)

    def shared(self, request):
        if request.applied_steps != 3:
            raise StaleEpochError(f"state is at 3 applied steps, asked for {request.applied_steps}")
        self.held += 1
        try:
            yield shared_state(self.leaves, 3, self.digest)
        finally:
            self.closed += 1


@pytest.fixture
def source():
    s = Source(leaves_of())
    yield s
    s.server.close()


def read(address, copy=copy_shared_state, ask=ASK, client=None):
    return (client or DataClient(SECRET, None)).read_shared_state(address, ask, time.monotonic() + 20, copy)


def test_a_state_is_copied_bit_exact_and_hash_checked_and_held_until_the_reader_is_done(source):
    leaves, applied, digest = read(source.server.address)
    assert applied == 3 and digest == source.digest == state_digest(leaves)
    for got, want in zip(leaves, source.leaves):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)
        assert got.ctypes.data % 64 == 0 and got.ctypes.data != want.ctypes.data   # its own, aligned memory
    assert source.held == source.closed == 1


def test_the_copy_goes_in_pieces_and_the_midway_hook_runs_once(source, monkeypatch):
    import runtime.state.state_copy as state_copy
    monkeypatch.setattr(state_copy, "SHARED_PIECE_BYTES", 64 << 10)   # the big leaf in 13 calls
    calls = []
    leaves, _, digest = read(source.server.address, lambda s, pid: copy_shared_state(
        s, pid, midway=lambda: calls.append(1)))
    assert calls == [1] and digest == source.digest
    np.testing.assert_array_equal(leaves[0], source.leaves[0])


def test_a_server_without_a_local_socket_is_not_local_and_tcp_still_serves():
    plain = Source(leaves_of(), shared=False)
    try:
        assert plain.server.local_address == ""
        with pytest.raises(NotLocal):
            read(plain.server.address)
        with pytest.raises(NotLocal):   # nothing listens at all under that name
            read("127.0.0.1:1")
    finally:
        plain.server.close()


def test_no_secret_means_no_local_socket():
    open_server = Source(leaves_of(), secret="")
    try:
        assert open_server.server.local_address == ""
    finally:
        open_server.server.close()


def test_a_refusal_travels_and_nothing_is_held(source):
    with pytest.raises(RemoteError) as err:
        read(source.server.address, ask=pb.GetStateRequest(fence=FENCE, applied_steps=4))
    assert err.value.code == "FAILED_PRECONDITION" and "asked for 4" in err.value.message
    assert source.held == 0
    read(source.server.address)   # and the server goes on serving


def test_a_state_that_does_not_hash_to_its_claim_is_refused():
    other = state_digest(leaves_of(seed=1))
    liar = Source(leaves_of(), digest=other)
    try:
        with pytest.raises(ProtocolError, match="does not hash"):
            read(liar.server.address)
        deadline = time.monotonic() + 10
        while liar.closed != 1 and time.monotonic() < deadline:   # the reader hung up: the source lets go
            time.sleep(0.01)
        assert liar.closed == 1
    finally:
        liar.server.close()


def test_a_layout_other_than_the_programs_is_refused_before_anything_is_copied(source):
    copied = []

    def spy(state, pid):
        expect = [((300, 700), np.float32), ((5,), np.int32), ((0, 4), np.float32), ((3, 5), np.int16)]
        return copy_shared_state(state, pid, expect=expect, midway=lambda: copied.append(1))
    with pytest.raises(ProtocolError, match="state leaf 3"):
        read(source.server.address, spy)
    assert not copied


def test_a_wrong_secret_is_refused_on_the_local_socket_too(source):
    with pytest.raises(RemoteError) as err:
        read(source.server.address, client=DataClient("wrong", None))
    assert err.value.code == "UNAUTHENTICATED"
    assert source.held == 0


def test_a_shared_read_asked_over_tcp_is_refused(source):
    ask = pb.GetStateRequest(fence=FENCE, applied_steps=3, shared_memory=True)
    with pytest.raises(RemoteError) as err:
        list(DataClient(SECRET, None).get_state(source.server.address, ask, time.monotonic() + 10))
    assert err.value.code == "INVALID_ARGUMENT" and "local socket" in err.value.message


def test_memory_that_is_not_there_is_a_failed_copy_not_unavailable():
    dest = np.empty(16, np.uint8)
    with pytest.raises(OSError) as err:
        cross_memory.read_into(os.getpid(), [(dest, 8)])   # address 8 is never mapped
    assert not isinstance(err.value, cross_memory.CrossMemoryUnavailable)


_SERVE = textwrap.dedent("""
    import sys, time, numpy as np
    from runtime.wire import rpc
    from runtime.state.state_copy import shared_state, state_digest
    from runtime.wire.dataplane import DataServer
    leaves = [np.random.default_rng(7).standard_normal(3_000_000).astype(np.float32), np.arange(9, dtype=np.int64)]
    digest = state_digest(leaves)
    def shared(request):
        yield shared_state(leaves, 3, digest)
        if {die!r}:
            import os, signal
            os.kill(os.getpid(), signal.SIGKILL)   # midway, as a chaos kill of the source
    server = DataServer("127.0.0.1", secret="s3cret", tls=None, status_name=rpc.status_name,
                        on_push=lambda c: None, on_state=lambda r: iter(()), on_shared_state=shared)
    print(server.address, digest, flush=True)
    time.sleep(60)
""")


def serve_in_child(die=False):
    child = subprocess.Popen([sys.executable, "-c", _SERVE.format(die=die)], stdout=subprocess.PIPE, text=True,
                             cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    address, digest = child.stdout.readline().split()
    return child, address, digest


def test_another_process_state_is_copied_out_of_its_memory():
    child, address, digest = serve_in_child()
    try:
        leaves, applied, got = read(address)
        assert (applied, got) == (3, digest)
        np.testing.assert_array_equal(leaves[1], np.arange(9, dtype=np.int64))
        assert leaves[0].nbytes == 12_000_000
    finally:
        child.kill()
        child.wait()


def test_a_source_that_dies_midway_is_a_failed_copy():
    child, address, _ = serve_in_child(die=True)
    try:
        with pytest.raises((OSError, ConnectionError)) as err:
            read(address, lambda s, pid: (child.wait(10), copy_shared_state(s, pid))[1])
        assert not isinstance(err.value, cross_memory.CrossMemoryUnavailable)
    finally:
        child.kill()
        child.wait()


LAYOUT = [(x.shape, x.dtype) for x in leaves_of()]


def test_a_spare_landing_is_where_the_copy_lands_and_one_of_another_size_is_not_used(source):
    memory = landing(LAYOUT)
    leaves, _, digest = read(source.server.address,
                             lambda s, pid: copy_shared_state(s, pid, expect=LAYOUT, landing_memory=memory))
    assert digest == source.digest and all(np.shares_memory(x, memory) for x in leaves if x.size)
    small = landing(LAYOUT[1:])
    leaves, _, _ = read(source.server.address, lambda s, pid: copy_shared_state(s, pid, landing_memory=small))
    assert not any(np.shares_memory(x, small) for x in leaves)


def test_a_streamed_state_lands_in_the_landing_too(source):
    memory = landing(LAYOUT)
    chunks = inline(state_chunks(source.leaves, 3, 4096, source.digest))
    leaves, applied, digest = assemble_state(chunks, expect=LAYOUT, landing_memory=memory)
    assert (applied, digest) == (3, source.digest) and np.shares_memory(leaves[0], memory)
    np.testing.assert_array_equal(leaves[3], source.leaves[3])


def test_the_landing_is_handed_out_once_given_back_after_a_failure_and_freed_when_dropped():
    spare = Landing(LAYOUT)
    deadline = time.monotonic() + 10
    memory = None
    while memory is None and time.monotonic() < deadline:   # made on a thread of its own
        memory = spare.take()
        time.sleep(0.01)
    assert memory is not None and memory.nbytes >= sum(x.nbytes for x in leaves_of()) and spare.take() is None
    spare.give_back(memory)
    assert spare.take() is memory
    spare.give_back(memory)
    spare.drop()
    assert spare.take() is None
    spare.give_back(memory)   # after the worker got a state: not kept
    assert spare.take() is None
