"""The state digest (runtime/state/state_copy.py) and the versioned records that hold it: checkpoints and snapshots
written before the digest named its algorithm (record format 1, a bare sha256) still restore, verified by their
sha256, and come back with today's digest, the one replicas compare."""

import hashlib
import json
import os
import time

import ml_dtypes
import numpy as np
import pytest
import xxhash

from runtime.state import checkpoint_orbax
from runtime.state.checkpoint import CheckpointStore
from runtime.state.checkpoint_record import (FORMAT, CheckpointCorruptError, check_record, make_record,
                                             recorded_digest)
from runtime.state.snapshot import MAGIC, SnapshotStore
from runtime.state.state_copy import (DIGEST, DIGEST_ALGORITHMS, assemble_state, digest_algorithm, state_chunks,
                                      state_digest)
from runtime.core.errors import ProtocolError
from runtime.wire.parts import inline

LEAVES = [np.arange(12, dtype=np.float32).reshape(3, 4), np.array([1.5, -2.0], dtype=ml_dtypes.bfloat16),
          np.int32(7), np.zeros((0, 4), np.float32), np.arange(6, dtype=np.float64).reshape(2, 3).T]


def old_sha256(leaves) -> str:
    """The state digest as the code before format 2 computed it (``state_sha256``): hex digits, no algorithm."""
    h = hashlib.sha256()
    for leaf in leaves:
        arr = np.asarray(leaf)
        h.update(str((tuple(arr.shape), arr.dtype.str)).encode())
        h.update(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))
    return h.hexdigest()


def old_record(step: int, leaves, metadata: dict) -> dict:
    """A record exactly as the code before format 2 wrote it (``make_record``, FORMAT = 1)."""
    leaves = [np.asarray(x) for x in leaves]
    return {"format": 1, "step": step, "sha256": old_sha256(leaves), "created": time.time(),
            "leaves": [[list(x.shape), x.dtype.name] for x in leaves], "metadata": metadata}


def write_old_snapshot(path, step: int, leaves, metadata: dict) -> None:
    """A format-1 snapshot file as ``SnapshotStore.save`` wrote it then: magic, header length, header, bytes."""
    header = json.dumps(old_record(step, leaves, metadata), allow_nan=False).encode()
    with open(path, "wb") as f:
        f.write(MAGIC + len(header).to_bytes(8, "little") + header)
        for x in leaves:
            f.write(np.ascontiguousarray(x).reshape(-1).view(np.uint8))


def same(got, want) -> bool:
    return len(got) == len(want) and all(
        (a.shape, a.dtype) == (np.shape(b), np.asarray(b).dtype) and a.tobytes() == np.ascontiguousarray(b).tobytes()
        for a, b in zip(got, want))


# -- the digest ----------------------------------------------------------------------------------


def test_the_digest_names_its_algorithm_and_the_sha256_one_is_the_old_digest_named():
    digest = state_digest(LEAVES)
    assert DIGEST == "xxh3_128" and digest.startswith("xxh3_128:") and len(digest) == len("xxh3_128:") + 32
    assert digest_algorithm(digest) == "xxh3_128"
    assert state_digest(LEAVES, "sha256") == "sha256:" + old_sha256(LEAVES)
    h = xxhash.xxh3_128()   # the bytes hashed: each leaf's layout, then its bytes (whatever its memory order)
    for x in LEAVES:
        x = np.asarray(x)
        h.update(str((tuple(x.shape), x.dtype.str)).encode())
        h.update(np.ascontiguousarray(x).tobytes())
    assert digest == "xxh3_128:" + h.hexdigest()


def test_one_changed_bit_or_layout_changes_the_digest():
    flipped = [x.copy() for x in map(np.asarray, LEAVES)]
    flipped[0].reshape(-1).view(np.uint32)[5] ^= 1
    reshaped = [np.asarray(LEAVES[0]).reshape(4, 3), *LEAVES[1:]]
    for algorithm in DIGEST_ALGORITHMS:
        digests = {state_digest(x, algorithm) for x in (LEAVES, flipped, reshaped)}
        assert len(digests) == 3


@pytest.mark.parametrize("bad", ["", "ab" * 32, "sha256:" + "ab" * 16, "xxh3_128:" + "AB" * 16, "md5:" + "ab" * 16,
                                 "xxh3_128:" + "ab" * 16 + "0", None, 5])
def test_a_value_that_is_not_a_digest_of_a_known_algorithm_is_refused(bad):
    with pytest.raises(ValueError):
        digest_algorithm(bad)
    with pytest.raises(ValueError):
        make_record(1, LEAVES, digest=bad)


def test_an_unknown_algorithm_is_refused_by_name():
    with pytest.raises(ValueError, match="md5"):
        state_digest(LEAVES, "md5")


def test_a_transfer_is_hashed_as_it_streams_and_a_stream_of_another_algorithm_is_refused():
    leaves = [np.asarray(x) for x in LEAVES]
    layout = [(x.shape, x.dtype) for x in leaves]   # as a worker's programs give it (bfloat16 by name)
    honest = list(inline(state_chunks(leaves, 3, 16, state_digest(leaves))))
    got, applied, digest = assemble_state(iter(honest), expect=layout)
    assert applied == 3 and digest == state_digest(leaves) and same(got, leaves)
    shuffled = honest[1:] + honest[:1]   # out of order: hashed once all arrived, the same digest
    assert assemble_state(iter(shuffled), expect=layout)[2] == digest
    unannounced = list(inline(state_chunks(leaves, 3, 16)))
    assert assemble_state(iter(unannounced), expect=layout)[2] == digest
    old = list(inline(state_chunks(leaves, 3, 16, state_digest(leaves, "sha256"))))
    with pytest.raises(ProtocolError, match="announces a sha256 digest; this worker checks xxh3_128"):
        assemble_state(iter(old), expect=layout)
    assert assemble_state(iter(old), expect=layout, algorithm="sha256")[2] == state_digest(leaves, "sha256")
    malformed = list(inline(state_chunks(leaves, 3, 16, "xxh3_128:zz")))
    with pytest.raises(ProtocolError, match="malformed digest"):
        assemble_state(iter(malformed), expect=layout)


# -- records: written today, and format 1 --------------------------------------------------------


def test_a_record_names_format_2_and_its_digest():
    _, _, record = make_record(4, LEAVES, digest=state_digest(LEAVES), metadata={"k": 1})
    assert FORMAT == 2 and record["format"] == 2 and "sha256" not in record
    assert record["digest"] == recorded_digest(record) == state_digest(LEAVES)
    check_record(record, 4, "here")
    old = old_record(4, LEAVES, {})
    assert recorded_digest(old) == "sha256:" + old["sha256"]
    check_record(old, 4, "here")


@pytest.mark.parametrize("spoil,why", [
    (lambda r: r.update(format=3), "not of format 1 or 2"),
    (lambda r: r.update(format=True), "not of format 1 or 2"),
    (lambda r: r.update(sha256="ab"), "malformed"),
    (lambda r: r.pop("sha256"), "malformed"),
    (lambda r: r.update(format=2), "malformed"),   # format 2 records "digest", not "sha256"
])
def test_a_record_of_an_unknown_format_or_a_malformed_digest_is_refused(spoil, why):
    record = old_record(4, LEAVES, {})
    spoil(record)
    with pytest.raises(CheckpointCorruptError, match=why):
        check_record(record, 4, "here")


def test_an_old_sha256_snapshot_still_restores_verified_with_todays_digest(tmp_path):
    store = SnapshotStore(str(tmp_path / "h0"))
    store.save(8, LEAVES, digest=state_digest(LEAVES), metadata={"fingerprint": "new"})
    write_old_snapshot(store.path(4), 4, LEAVES, {"fingerprint": "old", "loss_sums": [1.0] * 4})
    assert store.steps() == [4, 8]
    got = store.restore(4)
    assert got.step == 4 and same(got.leaves, LEAVES)
    assert got.digest == state_digest(LEAVES)   # as replicas compare it, not the sha256 it was verified with
    assert got.metadata["fingerprint"] == "old" and got.metadata["loss_sums"] == [1.0] * 4
    assert store.restore(8).digest == got.digest   # the same state, written by either format, reads the same

    copy = SnapshotStore(str(tmp_path / "h1"))   # a copy streamed to another host is kept as it is
    assert copy.receive(store.pieces(4, piece_bytes=7)) == 4 and copy.restore(4).digest == got.digest


def test_an_old_sha256_snapshot_that_does_not_match_its_sha256_is_passed_over(tmp_path):
    store = SnapshotStore(str(tmp_path / "h0"))
    os.makedirs(store.directory)
    write_old_snapshot(store.path(4), 4, LEAVES, {})
    write_old_snapshot(store.path(8), 8, LEAVES, {})
    with open(store.path(8), "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))
    with pytest.raises(CheckpointCorruptError, match="hash to sha256:"):
        store.restore(8)
    got, [skipped] = store.restore_newest_valid()
    assert got.step == 4 and skipped.step == 8 and "it recorded sha256:" in skipped.reason


def write_old_checkpoint(directory, step: int, leaves, metadata: dict) -> None:
    """A format-1 checkpoint as ``CheckpointStore.save`` wrote it then: orbax's two items, the record and the
    non-empty leaves, committed at ``<directory>/<step>``."""
    from etils import epath

    leaves = [np.asarray(x) for x in leaves]
    checkpoint_orbax.write(epath.Path(directory) / str(step), leaves, old_record(step, leaves, metadata))


def test_an_old_sha256_checkpoint_still_restores_verified_with_todays_digest(tmp_path):
    directory = str(tmp_path / "checkpoints")
    write_old_checkpoint(directory, 4, LEAVES, {"fingerprint": "old"})
    store = CheckpointStore(directory, async_save=False)
    store.save(8, LEAVES, digest=state_digest(LEAVES), metadata={"fingerprint": "new"})
    assert store.steps() == [4, 8]
    step, leaves, digest, meta = store.restore(4)
    assert step == 4 and same(leaves, LEAVES) and digest == state_digest(LEAVES) and meta["fingerprint"] == "old"
    assert store.restore(8).digest == digest


def test_an_old_sha256_checkpoint_that_does_not_match_its_sha256_is_passed_over(tmp_path):
    directory = str(tmp_path / "checkpoints")
    write_old_checkpoint(directory, 4, LEAVES, {})
    changed = [x.copy() for x in map(np.asarray, LEAVES)]
    changed[0][0, 0] += 1
    record = old_record(8, LEAVES, {})   # a record of LEAVES beside other leaves of the same layout
    from etils import epath

    checkpoint_orbax.write(epath.Path(directory) / "8", changed, record)
    store = CheckpointStore(directory)
    with pytest.raises(CheckpointCorruptError, match="hash to sha256:"):
        store.restore(8)
    got, [skipped] = store.restore_newest_valid()
    assert got.step == 4 and skipped.step == 8 and same(got.leaves, LEAVES)
