"""The worker's background checkpoint writer (runtime.worker.saver), over a store that records what it is given."""

import threading

import numpy as np

from runtime.state.state_copy import state_digest
from runtime.worker.saver import CheckpointWriter, Drained


class Store:
    def __init__(self, directory, gate=None, fail=False):
        self.directory, self.saved, self.gate, self.fail = directory, [], gate, fail
        self.entered = threading.Event()

    def save(self, step, leaves, *, digest, metadata):
        self.entered.set()
        if self.gate is not None:
            self.gate.wait(5)
        if self.fail:
            raise OSError("disk full")
        self.saved.append((step, [x.copy() for x in leaves], digest, metadata))

    def wait(self):
        pass


def test_a_checkpoint_is_written_in_the_background_with_its_digest():
    stores = {}
    writer = CheckpointWriter(store_for=lambda d: stores.setdefault(d, Store(d)))
    leaves = [np.arange(6, dtype=np.float32).reshape(2, 3), np.int32(7)]
    writer.submit("/ck", 4, leaves, {"fingerprint": "fp"})
    assert writer.wait(5)
    (step, got, digest, meta), = stores["/ck"].saved
    assert step == 4 and digest == state_digest(got) == state_digest([np.asarray(x) for x in leaves])
    assert meta == {"fingerprint": "fp"}
    assert writer.drain() == Drained([4]) and writer.drain() == Drained()


def test_a_newer_request_replaces_a_waiting_one_and_errors_are_reported_once():
    gate = threading.Event()
    store = Store("/ck", gate=gate)
    writer = CheckpointWriter(store_for=lambda d: store)
    given_up = []   # what a slice's other hosts are told: this host will not write these steps
    for step in (1, 2, 3):   # 1 is written (blocked on the gate), 2 waits and is replaced by the newest
        writer.submit("/ck", step, [np.full(2, float(step))], {"fingerprint": "fp"}, failed=given_up.append)
        assert store.entered.wait(5)
    assert given_up == [2]
    gate.set()
    assert writer.wait(5)
    assert [s for s, *_ in store.saved] == [1, 3] and given_up == [2]
    store.fail = True
    writer.submit("/ck", 4, [np.zeros(2)], {"fingerprint": "fp"}, failed=given_up.append)
    assert writer.wait(5)
    done = writer.drain()
    assert 4 not in done.saved and "checkpoint of step 4 in /ck: OSError: disk full" in done.error
    assert given_up == [2, 4] and writer.drain() == Drained()


def test_wait_times_out_while_a_write_is_stuck():
    gate = threading.Event()
    writer = CheckpointWriter(store_for=lambda d: Store(d, gate=gate))
    writer.submit("/ck", 1, [np.zeros(2)], {"fingerprint": "fp"})
    assert writer.wait(0.05) is False
    gate.set()
    assert writer.wait(5) is True


def test_a_snapshot_never_displaces_a_waiting_checkpoint_and_its_copy_is_reported_per_kind():
    gate = threading.Event()
    ck, snap = Store("/ck", gate=gate), Store("/snap")
    writer = CheckpointWriter(store_for=lambda d: ck)
    copied = []

    def copy(store, step):
        if step == 3:
            raise OSError("peer gone")
        copied.append((store, step))

    writer.submit("/ck", 1, [np.zeros(2)], {})                            # being written (blocked on the gate)
    assert ck.entered.wait(5)
    writer.submit("/ck", 2, [np.ones(2)], {})                             # a checkpoint waits...
    writer.submit("/snap", 2, [np.ones(2)], {}, store=snap, then=copy)    # ...and a snapshot beside it
    gate.set()
    assert writer.wait(5)
    assert [s for s, *_ in ck.saved] == [1, 2] and [s for s, *_ in snap.saved] == [2]
    assert copied == [(snap, 2)]
    assert writer.drain() == Drained([1, 2]) and writer.drain("snapshot") == Drained([2], [2])
    writer.submit("/snap", 3, [np.ones(2)], {}, store=snap, then=copy)
    assert writer.wait(5)
    done = writer.drain("snapshot")
    assert done.saved == [3] and done.followed == [] and "copy of snapshot 3: OSError: peer gone" in done.error
    assert writer.drain() == Drained()


def test_a_warm_up_left_behind_by_a_killed_worker_is_removed_by_the_next_warm_up(tmp_path):
    """SIGKILL during the warm-up skips its clean-up; the next warm-up on the host removes what it left (and
    never a live process's), so no ``elastic-warm-*`` directory piles up in the temporary directory."""
    import os
    import signal
    import subprocess
    import sys
    import textwrap

    from tests.conftest import ROOT

    env = dict(os.environ, TMPDIR=str(tmp_path), PYTHONPATH=str(ROOT))
    stuck = textwrap.dedent("""
        import threading, time
        from runtime.worker.saver import CheckpointWriter
        def store_for(path):   # the warm-up is under way: its directory exists; never finishes
            print("warming", flush=True)
            threading.Event().wait()
        CheckpointWriter(store_for=store_for).warm()
        threading.Event().wait()
    """)
    proc = subprocess.Popen([sys.executable, "-c", stuck], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "warming"
        left = [p.name for p in tmp_path.iterdir()]
        assert len(left) == 1 and left[0].startswith(f"elastic-warm-{proc.pid}-"), left
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    assert [p.name for p in tmp_path.iterdir()] == left   # the dead worker's directory stayed behind
    live = tmp_path / f"elastic-warm-{os.getpid()}-live"   # a live process's warm-up: never touched
    live.mkdir()
    again = textwrap.dedent("""
        import threading
        from runtime.worker.saver import CheckpointWriter
        class Store:
            def __init__(self, path): pass
            def save(self, *a, **k): pass
            def wait(self): pass
        CheckpointWriter(store_for=Store).warm()
        for t in threading.enumerate():
            if t.name == "checkpoint-warm-up":
                t.join(60)
    """)
    subprocess.run([sys.executable, "-c", again], env=env, check=True, timeout=120)
    assert [p.name for p in tmp_path.iterdir()] == [live.name]   # its own removed at its end, the dead one too


class _Saving:
    """A checkpoint store whose save of ``step`` is in flight (``saving``) and has left ``leftovers``."""

    def __init__(self, step, leftovers):
        self.saving, self._leftovers = step, leftovers

    def leftovers(self):
        return list(self._leftovers)


class _Faults:
    def __init__(self, save_after=0):
        self.struck, self.save_after = [], save_after

    def armed_in(self, phase):
        return phase == "save" and not self.struck

    def in_phase(self, phase):
        self.struck.append(phase)


def test_an_armed_kill_save_cuts_off_the_save_being_written_on_local_disk_and_gcs():
    from runtime.worker.worker_state import strike_save_in_progress

    for leftover in ("/ck/8.orbax-checkpoint-tmp-1712", "gs://b/run/8"):   # local: renamed at the end; GCS: in place
        writer = CheckpointWriter(store_for=lambda d: None)
        writer._stores["/ck"] = _Saving(8, [leftover, "/ck/4.orbax-checkpoint-tmp-1"])
        assert writer.writing()[1] == 8
        faults = _Faults()
        strike_save_in_progress(faults, writer)
        assert faults.struck == ["save"], leftover
    idle, faults = CheckpointWriter(store_for=lambda d: None), _Faults()
    strike_save_in_progress(faults, idle)   # nothing being written: the kill waits for the next save
    assert idle.writing() is None and faults.struck == []
    done = CheckpointWriter(store_for=lambda d: None)
    done._stores["/ck"] = store = _Saving(8, ["/ck/4.orbax-checkpoint-tmp-1"])   # 8 not begun in the store yet
    threading.Timer(0.05, lambda: setattr(store, "saving", None)).start()       # ...and then it completes
    strike_save_in_progress(faults, done)
    assert faults.struck == []   # still armed: the next save is cut off (while_saving)
    older = CheckpointWriter(store_for=lambda d: None)
    older._stores["/ck"] = _Saving(8, ["/ck/8.orbax-checkpoint-tmp-1712"])
    faults = _Faults(save_after=8)   # kill_save@checkpoint=8: the save of step 8 is let finish
    strike_save_in_progress(faults, older)
    assert faults.struck == []
