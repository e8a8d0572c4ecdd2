"""Policy weights by version, held for samplers to pull, and the pull itself (an RL run: runtime.control.sampling).

Weights version ``v`` is the policy's parameters after ``v`` optimizer steps.
A trainer keeps the versions it was asked to publish (:class:`WeightOutbox`:
the newest few, each whole and hashed, copied out of the state after the
apply, so a later step changes none of them); a sampler keeps the one version
it installed in the same kind of box, so a sampler that lost its version can
take it from a peer sampler as well as from a trainer. Both serve a version
over the data plane as a state copy is served (``GetState`` with ``weights``:
checksummed chunks naming the version and the digest), and
:func:`pull_weights` takes it from the first source that has it whole: a source
lost mid-transfer is passed over for the next, and nothing partly received is
ever installed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import numpy as np

from runtime._proto import elastic_pb2 as pb
from runtime.core.errors import ProtocolError, StaleEpochError
from runtime.core.programs import TRAINER_WEIGHTS_KEPT
from runtime.state.state_copy import assemble_state, state_chunks, state_digest
from runtime.wire.dataplane_client import DataClient, RemoteError
from runtime.wire.parts import Part
from runtime.wire.peers import PeerChannels
from runtime.worker.fault_injection import mid_stream

__all__ = ["WeightOutbox", "cast_weights", "pull_weights"]


def cast_weights(leaves: list, indices, dtype: str) -> list[np.ndarray]:
    """The state ``leaves`` at ``indices`` (the policy's parameters), as contiguous host arrays of ``dtype`` ("":
    as they are): only those leaves are brought to the host (``leaves`` may be a slice of one host's device
    arrays). ``ProtocolError`` for an index out of range or an unknown dtype."""
    try:
        target = np.dtype(dtype) if dtype else None
    except TypeError:
        raise ProtocolError(f"unknown weights dtype {dtype!r}") from None
    out = []
    for i in indices:
        if not 0 <= i < len(leaves):
            raise ProtocolError(f"weights leaf {i} is not one of the state's {len(leaves)} leaves")
        x = np.asarray(leaves[i])
        out.append(np.ascontiguousarray(x if target is None else x.astype(target)))
    return out


class WeightOutbox:
    """The weights versions a worker holds for others: ``{version: (leaves, digest)}``, the newest ``keep``. A
    version's digest is taken when it is first asked for (a trainer keeps a version after every step, and most
    are never sent)."""

    def __init__(self, keep: int = TRAINER_WEIGHTS_KEPT):
        self.keep = keep
        self._lock = threading.Lock()
        self._versions: dict[int, tuple[list[np.ndarray], str]] = {}   # digest "" until first asked for

    def put(self, version: int, leaves: list[np.ndarray], digest: str = "") -> None:
        """Keeps ``leaves`` (and their ``digest``, when known) as ``version``, replacing that version and dropping
        the oldest past ``keep``."""
        with self._lock:
            self._versions[version] = (leaves, digest)
            for old in sorted(self._versions)[:-self.keep]:
                del self._versions[old]

    def get(self, version: int) -> tuple[list[np.ndarray], str]:
        """``(leaves, digest)`` of ``version``; ``StaleEpochError`` naming the versions held when it is not."""
        with self._lock:
            if version not in self._versions:
                raise StaleEpochError(f"weights version {version} is not held here (held: "
                                      f"{sorted(self._versions) or 'none'})")
            leaves, digest = self._versions[version]
            if not digest:
                digest = state_digest(leaves)
                self._versions[version] = (leaves, digest)
            return leaves, digest

    def versions(self) -> list[int]:
        with self._lock:
            return sorted(self._versions)

    def parts(self, version: int, chunk_bytes: int) -> Iterator[Part]:
        """``version``'s leaves as a state copy's parts (the version where a state names its applied steps)."""
        leaves, digest = self.get(version)
        return state_chunks(leaves, version, chunk_bytes, digest)


def pull_weights(request: pb.SyncWeightsRequest, layout, *, data: DataClient, peers: PeerChannels,
                 timeout: float, midway=lambda: None) -> tuple[list[np.ndarray], str, pb.SyncWeightsReply]:
    """Weights version ``request.version`` from the first of ``request.sources`` that sends it whole, checked
    against ``layout`` (``[(shape, dtype)]``), its version and its digest (and ``expected_digest`` when set):
    ``(leaves, digest, reply)``. A source that fails (gone, lost mid-transfer, without that version) is passed
    over and named in ``reply.failed``; ``StaleEpochError`` when none has it. ``midway``: the chaos point after
    the first chunk arrived."""
    if not request.sources:
        raise ProtocolError("SyncWeights without a source")
    t0 = time.perf_counter()
    failed = []
    ask = pb.GetStateRequest(fence=request.fence, weights=True, weights_version=request.version)
    for source in request.sources:
        deadline = time.monotonic() + timeout
        try:
            if source.data_address:
                stream = data.get_state(source.data_address, ask, deadline)
            else:
                stream = peers.stub(source.address).GetState(ask, timeout=timeout)
            leaves, version, digest = assemble_state(mid_stream(stream, midway), expect=layout)
        except (grpc.RpcError, RemoteError, OSError, ProtocolError, StaleEpochError) as e:
            why = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.RpcError) else f"{type(e).__name__}: {e}"
            failed.append(f"{source.address}: {why}"[:300])
            continue
        if version != request.version:
            failed.append(f"{source.address}: sent version {version}, asked for {request.version}")
            continue
        if request.expected_digest and digest != request.expected_digest:
            failed.append(f"{source.address}: weights hash to {digest[:21]}..., expected "
                          f"{request.expected_digest[:21]}...")
            continue
        return leaves, digest, pb.SyncWeightsReply(version=version, digest=digest,
                                                   bytes=sum(x.nbytes for x in leaves),
                                                   seconds=time.perf_counter() - t0, source=source.address,
                                                   failed=failed)
    raise StaleEpochError(f"no source sent weights version {request.version}: " + "; ".join(failed))

