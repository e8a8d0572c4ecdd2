"""runtime/state/snapshot.py: in-memory snapshot files (complete or absent, verified on read), their copies to another
host, and the controller's bookkeeping of them (runtime/control/snapshotting.py,
runtime.control.snapshotting.snapshot_order)."""

import os

import ml_dtypes
import numpy as np
import pytest

from runtime.state.checkpoint_record import CheckpointCorruptError, CheckpointNotFoundError
from runtime.state.state_copy import state_digest
from runtime.core.events import EventLog, read_events
from runtime.control.placement import Placement
from runtime.control.snapshotting import snapshot_order
from runtime.state.snapshot import KEEP, SnapshotStore, host_directory
from runtime.control.run_state import RunLedger
from runtime.control.snapshotting import Snapshotting
from runtime.control.calls import WorkerStatus
from tests.support.fake_group import FakeGroup

LEAVES = [np.arange(6, dtype=np.float32).reshape(2, 3), np.zeros((0, 4), np.int32),
          np.array([1.5, -2.0, 3.25], dtype=ml_dtypes.bfloat16), np.int32(7)]


def save(store, step, leaves=LEAVES, **meta):
    store.save(step, leaves, digest=state_digest([np.asarray(x) for x in leaves]), metadata=meta)


def test_a_snapshot_reads_back_bit_for_bit_with_its_metadata_and_only_the_newest_stay(tmp_path):
    store = SnapshotStore(str(tmp_path / "h0"))
    for step in (4, 8, 12):
        save(store, step, fingerprint="fp", loss_sums=[1.0] * step)
    assert store.steps() == [8, 12] and KEEP == 2
    got = store.restore()
    assert got.step == 12 and got.metadata["fingerprint"] == "fp" and got.metadata["loss_sums"] == [1.0] * 12
    assert [(x.shape, x.dtype) for x in got.leaves] == [(np.shape(x), np.asarray(x).dtype) for x in LEAVES]
    assert got.digest == state_digest([np.asarray(x) for x in LEAVES])
    assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(got.leaves, LEAVES))
    assert store.restore(8).step == 8
    with pytest.raises(CheckpointNotFoundError, match="snapshots here: \\[8, 12\\]"):
        store.restore(4)


@pytest.mark.parametrize("spoil,why", [(lambda b: b[:-3], "bytes of leaves"), (lambda b: b + b"x", "bytes of leaves"),
                                       (lambda b: b"nonsense" + b, "not a jax-elastic snapshot"),
                                       (lambda b: b[:-1] + bytes([b[-1] ^ 1]), "hash to")])
def test_a_spoiled_newest_snapshot_is_passed_over_for_the_older_one_with_the_reason(spoil, why, tmp_path):
    store = SnapshotStore(str(tmp_path / "h0"))
    save(store, 4)
    save(store, 8)
    path = store.path(8)
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(spoil(data))
    with pytest.raises(CheckpointCorruptError, match=why):
        store.restore(8)
    got, skipped = store.restore_newest_valid()
    assert got.step == 4 and [s.step for s in skipped] == [8] and why in skipped[0].reason
    assert store.restore_newest_valid(at_most=5)[0].step == 4
    with pytest.raises(CheckpointNotFoundError, match="at or before step 3"):
        store.restore_newest_valid(at_most=3)


def test_a_copy_is_listed_only_once_every_byte_arrived(tmp_path):
    source, dest = SnapshotStore(str(tmp_path / "h0")), SnapshotStore(str(tmp_path / "h1"))
    save(source, 8)
    assert dest.receive(source.pieces(8, piece_bytes=7)) == 8
    assert dest.steps() == [8] and dest.restore().digest == source.restore().digest
    pieces = list(source.pieces(8, piece_bytes=7))
    cases = [(pieces[:-1], "ended after"), (pieces + [pieces[-1]], "longer than"),
             ([(9, n, d) for _, n, d in pieces[:1]] + pieces[1:], "changed its step"),
             ([(12, n, d) for _, n, d in pieces], "does not describe step 12"), ([], "ended after 0")]
    for bad, why in cases:
        with pytest.raises((ValueError, CheckpointCorruptError), match=why):
            dest.receive(iter(bad))
    assert dest.steps() == [8] and dest.leftovers() == [] and sorted(os.listdir(dest.directory)) == ["8.snap"]


def test_leftovers_of_cut_writes_are_never_listed_and_are_removed(tmp_path):
    store = SnapshotStore(str(tmp_path / "h0"))
    save(store, 4)
    cut = os.path.join(store.directory, ".8.snap.0123abcd.part")
    with open(cut, "wb") as f:
        f.write(b"half")
    assert store.steps() == [4] and store.leftovers() == [cut]
    assert store.cleanup() == [cut] and store.leftovers() == [] and store.steps() == [4]
    store.remove_all()
    assert not os.path.exists(store.directory) and store.steps() == []


@pytest.mark.parametrize("host", ["", "a/b", "..", "."])
def test_a_host_name_must_be_one_directory_name(host):
    with pytest.raises(ValueError, match="host name"):
        host_directory("/run", host)


def test_the_writer_rotates_and_its_copy_goes_to_another_host_a_spare_first():
    hosts = {"a": "h0", "b": "h1", "c": "h2", "s": "h3"}
    assert snapshot_order(3, 20, 4, ("a", "b", "c"), ("s",), hosts) == ("b", "s")
    assert snapshot_order(7, 20, 4, ("a", "b", "c"), (), hosts) == ("c", "a")
    assert snapshot_order(11, 20, 4, ("a", "b", "c"), (), hosts) == ("a", "b")
    assert [snapshot_order(s, 20, 4, ("a",), (), hosts) for s in range(8)] == [None] * 3 + [("a", None)] + \
        [None] * 3 + [("a", None)]
    assert snapshot_order(19, 20, 4, ("a",), ("s",), hosts) is None   # none after the last step
    assert snapshot_order(3, 20, 0, ("a",), ("s",), hosts) is None    # snapshots off
    assert snapshot_order(3, 20, 4, ("a", "b"), ("s",), {"a": "h0", "b": "h0", "s": "h0"}) == ("b", None)
    assert snapshot_order(3, 20, 4, ("a", "b"), ("s",), {"a": "h1", "b": "h0", "s": "h0"}) == ("b", "a")


class _Opts:
    snapshot_interval, backup_kind, pipeline_stages = 2, "snapshot", 1


def _group(stages=None):
    """The fake worker group, worker ``wK`` on host ``hK``; ``stages``: the pipeline stage each worker loaded."""
    group = FakeGroup(_Opts(), EventLog(None), hosts={f"w{k}": f"h{k}" for k in range(5)})
    if stages:
        group.load(list(stages), stages=stages)
    return group


def test_the_controller_records_where_snapshots_are_and_notifies_once_each_is_in_place(tmp_path):
    events = EventLog(str(tmp_path / "events.jsonl"))
    ledger = RunLedger(events)
    notified = []
    snaps = Snapshotting(_group(), _Opts(), events, ledger, notify=notified.append)
    placement = Placement(epoch=1, active=("w0", "w1"), spares=("w2",))
    assert snaps.order_for(0, 10, placement, shadows=0) == {}
    assert snaps.order_for(1, 10, placement, shadows=0) == {"w1": "w2"}
    assert snaps.order_for(1, 10, placement, shadows=1) == {}   # a shadow spare is the backup then
    snaps.note({"w1": ((2,), (), "")})
    assert notified == [] and snaps.newest(10) == 2    # written, its copy not there yet
    snaps.note({"w1": ((), (2,), "")})
    assert notified == [2] and ledger.state.snapshots == ((2, "h1", None), (2, "h2", None))
    assert snaps.order_for(3, 10, placement, shadows=0) == {"w0": "w2"}
    snaps.note({"w0": ((4,), (), "copy of snapshot 4: peer gone")})
    assert notified == [2] and snaps.newest(3) == 2 and snaps.newest(4) == 4 and snaps.newest(1) is None
    kinds = [e["kind"] for e in read_events(tmp_path / "events.jsonl")]
    assert kinds == ["snapshot_saved", "snapshot_copied", "snapshot_saved", "snapshot_failed"]
    statuses = {"w0": WorkerStatus(4, {}, (2, 4)), "w1": WorkerStatus(4, {}, ()), "w2": WorkerStatus(-1, {}, (6,))}
    assert Snapshotting.holdings(statuses, 5) == {"w0": 4}
    assert Snapshotting.holdings(statuses, 6) == {"w0": 4, "w2": 6}


def test_each_pipeline_stage_snapshots_its_own_state_and_a_step_counts_when_every_stage_holds_it(tmp_path):
    """2 stages x 2 replicas (w0, w1: stage 0; w2, w3: stage 1): one writer per stage, its copy kept by a worker
    on another host (the spare first, in that stage's directory of its host); a step is a backup once every
    stage holds it."""
    class Opts(_Opts):
        pipeline_stages = 2

    group = _group({"w0": 0, "w1": 0, "w2": 1, "w3": 1, "w4": 0})
    events = EventLog(str(tmp_path / "events.jsonl"))
    ledger = RunLedger(events)
    events.emit("run_started", run_id="r", slices=2, stages=2, devices_per_slice=1, microbatches=2, steps=10)
    snaps = Snapshotting(group, Opts(), events, ledger)
    placement = Placement(epoch=1, active=("w0", "w1", "w2", "w3"), spares=("w4",), stages=2)
    assert snaps.order_for(1, 10, placement, shadows=0) == {"w1": "w4", "w3": "w4"}
    one = Placement(epoch=1, active=("w0", "w2"), stages=2)   # one replica per stage, no spare: the other stage's worker
    other_events = EventLog(str(tmp_path / "other.jsonl"))
    other = Snapshotting(group, Opts(), other_events, RunLedger(other_events))
    assert other.order_for(1, 10, one, shadows=0) == {"w0": "w2", "w2": "w0"}
    snaps.note({"w1": ((2,), (2,), "")})
    assert ledger.state.snapshots == ((2, "h1", 0), (2, "h4", 0))   # stage 0's: on w1's host, its copy on w4's
    snaps._ordered.clear()   # (orders count as held until reported: here only what was reported counts)
    assert snaps.newest(10) is None    # stage 1 holds no snapshot of step 2
    snaps.note({"w3": ((2,), (), "")})
    assert snaps.newest(10) == 2
