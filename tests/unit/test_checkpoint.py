"""runtime/state/checkpoint.py: persistent checkpoints with real orbax, on a local disk and on a real GCS protocol
server.

GCS runs against fake-gcs-server on loopback (tests/gcs_emulator.py), through
the same clients as production: tensorstore, gcsfs, google-cloud-storage.
Interrupted saves are real: a child process is SIGKILLed in the middle of
writing, a background write fails on a real EFBIG (RLIMIT_FSIZE), a paused
server holds a save.
"""

import os
import pathlib
import pickle
import resource
import select
import signal
import subprocess
import sys
import time
import uuid

import ml_dtypes
import numpy as np
import pytest

from runtime.state.checkpoint import (
    CheckpointPruneError,
    CheckpointSaveError,
    CheckpointStore,
    CheckpointTimeoutError,
)
from runtime.state.checkpoint_record import CheckpointCorruptError, CheckpointNotFoundError, Skipped
from runtime.state.state_copy import state_digest
from tests.gcs_emulator import GcsEmulator

ROOT = pathlib.Path(__file__).resolve().parents[2]
BUCKET = "jax-elastic-test"
_GCS_ENV = ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL", "GOOGLE_AUTH_TOKEN_FOR_TESTING",
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT")


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    """One fake-gcs-server for the module; the process environment the store sets for it is put back after."""
    saved = {k: os.environ.get(k) for k in _GCS_ENV}
    emulator = GcsEmulator(tmp_path_factory.mktemp("gcs") / "fake-gcs-server.log")
    try:
        emulator.start()
    except RuntimeError as e:
        pytest.fail(str(e))
    emulator.create_bucket(BUCKET)
    yield emulator
    emulator.stop()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(params=["local", "gcs"])
def place(request, tmp_path):
    """``(directory, emulator)``: a fresh local path and None, or a fresh prefix in the emulator's bucket."""
    if request.param == "local":
        return str(tmp_path / "checkpoints"), None
    return f"gs://{BUCKET}/{uuid.uuid4().hex}", request.getfixturevalue("gcs")


def store_at(directory: str, gcs=None, **kw) -> CheckpointStore:
    endpoint = gcs.endpoint if directory.startswith("gs://") else None
    return CheckpointStore(directory, gcs_endpoint=endpoint, **kw)


def state(seed: int = 0) -> list[np.ndarray]:
    """Every kind of leaf a state holds: float32 of any bit pattern (NaN payloads, -0.0), bfloat16,
    int32, 0-d scalars, bool, a transposed float64, an empty array."""
    rng = np.random.default_rng(seed)
    return [
        rng.integers(0, 2**32, 3000, dtype=np.uint32).view(np.float32),
        rng.integers(0, 2**16, (7, 5), dtype=np.uint16).view(ml_dtypes.bfloat16),
        rng.integers(-2**31, 2**31, (4, 3), dtype=np.int32),
        np.array(seed, np.int32),
        np.array(-0.0, np.float32),
        np.array([True, False, True]),
        np.arange(6, dtype=np.float64).reshape(2, 3).T,
        np.zeros((0, 4), np.float32),
    ]


def save(store: CheckpointStore, step: int, leaves, **meta) -> None:
    store.save(step, leaves, digest=state_digest(leaves), metadata={"fingerprint": "prog-1", **meta})


def assert_same(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert (a.shape, a.dtype) == (b.shape, b.dtype)
        assert a.tobytes() == np.ascontiguousarray(b).tobytes()


# -- round trip ------------------------------------------------------------------


def test_round_trip_is_bit_identical(place):
    where, gcs = place
    store, reader = store_at(where, gcs), store_at(where, gcs)
    assert reader.steps() == []     # listed before the save: the reader must not keep that listing
    leaves = state(3)
    before = time.time()
    save(store, 7, leaves, note={"lr": 0.5})
    store.wait()
    assert store.steps() == reader.steps() == [7]
    for restored in (store.restore(), reader.restore(7)):
        step, got, digest, meta = restored
        assert step == 7
        assert_same(got, leaves)
        assert digest == state_digest(leaves)
        assert meta["fingerprint"] == "prog-1" and meta["note"] == {"lr": 0.5} and meta["step"] == 7
        assert before <= meta["created"] <= time.time()


def test_save_returns_before_the_write_and_wait_reports_the_commit(gcs):
    """The caller's save() does no I/O: it returns while the server is stopped, and the save commits after."""
    store = store_at(f"gs://{BUCKET}/{uuid.uuid4().hex}", gcs)
    save(store, 1, state(1))
    store.wait()
    gcs.pause()
    try:
        save(store, 2, state(2))
        assert store.saving == 2
        with pytest.raises(CheckpointTimeoutError) as e:   # it cannot finish while the server is stopped
            store.wait(timeout=0.5)
        assert isinstance(e.value, TimeoutError) and e.value.step == 2
    finally:
        gcs.resume()
    store.wait(timeout=60)
    assert store.saving is None
    assert store.steps() == [1, 2]
    assert_same(store.restore(2).leaves, state(2))


def test_sync_save_commits_before_returning(tmp_path):
    store = CheckpointStore(str(tmp_path), async_save=False)
    save(store, 3, state())
    assert store.saving is None and store.steps() == [3]


# -- only complete checkpoints ------------------------------------------------------

_CHILD = r"""
import os, signal, sys, time
import numpy as np
from runtime.state.checkpoint import CheckpointStore
from runtime.state.state_copy import state_digest

directory, mib = sys.argv[1], int(sys.argv[2])
store = CheckpointStore(directory)          # a gs:// directory finds the emulator in $STORAGE_EMULATOR_HOST
small = [np.arange(16, dtype=np.float32)]
store.save(1, small, digest=state_digest(small), metadata={"fingerprint": "child"})
store.wait(120)
rng = np.random.default_rng(0)
big = [rng.random((mib << 20) // 32, dtype=np.float32) for _ in range(8)]
store.save(2, big, digest=state_digest(big), metadata={"fingerprint": "child"})
deadline = time.monotonic() + 120
while not store.leftovers():                # step 2 is being written (it cannot commit for a long while)
    if time.monotonic() > deadline:
        sys.exit("the save of step 2 left nothing to see")
    time.sleep(0.001)
print("writing", store.saving, flush=True)
os.kill(os.getpid(), signal.SIGSTOP)        # the parent SIGKILLs this process mid-write
"""


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def kill_mid_save(directory: str, log: pathlib.Path, env: dict, mib: int) -> None:
    """Runs the child above and SIGKILLs it while it writes step 2 (after step 1 committed)."""
    env = dict(os.environ, **env, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    with open(log, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-c", _CHILD, directory, str(mib)], cwd=ROOT, env=env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err)
    try:
        deadline = time.monotonic() + 120
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        line = proc.stdout.readline().decode() if ready else ""
        assert line.startswith("writing 2"), f"child: {line!r}\n{log.read_text()[-3000:]}"
        while not _stopped(proc.pid):
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.005)
        proc.kill()
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def test_a_save_killed_mid_write_is_never_listed_and_cleanup_removes_it(place, tmp_path):
    where, gcs = place
    store = store_at(where, gcs)
    save(store, 0, state(0))
    store.wait()
    assert store.steps() == [0]     # listed before another process writes here: that listing must not stick
    env = {"STORAGE_EMULATOR_HOST": gcs.endpoint} if gcs else {}
    kill_mid_save(where, tmp_path / "child.log", env, mib=16 if gcs else 64)

    leftovers = store.leftovers()
    assert leftovers and all("/2" in p for p in leftovers)     # the interrupted save of step 2 is there...
    assert store.steps() == [0, 1]                              # ...and not listed
    assert store.restore().step == 1
    restored, skipped = store.restore_newest_valid()
    assert (restored.step, skipped) == (1, [])
    assert_same(restored.leaves, [np.arange(16, dtype=np.float32)])
    with pytest.raises(CheckpointNotFoundError, match="step 2"):
        store.restore(2)

    assert store.cleanup() == leftovers
    assert store.leftovers() == [] and store.steps() == [0, 1]
    if gcs:
        prefix = where.removeprefix(f"gs://{BUCKET}/") + "/"
        assert {o[len(prefix):].split("/")[0] for o in gcs.objects(BUCKET, prefix)} == {"0", "1"}
    else:
        assert sorted(os.listdir(where)) == ["0", "1"]
    save(store, 2, state(2))
    store.wait()
    assert store.steps() == [0, 1, 2]


@pytest.fixture
def small_file_limit():
    """Files of this process cannot grow past 1 MiB (a real EFBIG on write); put back after."""
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    def on():
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, old_limit[1]))

    yield on
    resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
    signal.signal(signal.SIGXFSZ, old_handler)


@pytest.mark.parametrize("reported_by", ["wait", "next save", "sync save"])
def test_a_failed_background_save_is_raised_once_and_never_listed(tmp_path, small_file_limit, reported_by):
    store = CheckpointStore(str(tmp_path), async_save=reported_by != "sync save")
    save(store, 1, state(1))
    store.wait()
    big = [np.random.default_rng(0).random(1 << 20, dtype=np.float32)]   # 4 MiB: cannot be written
    small_file_limit()
    if reported_by == "sync save":
        with pytest.raises(CheckpointSaveError) as e:
            save(store, 2, big)
    else:
        save(store, 2, big)
        with pytest.raises(CheckpointSaveError) as e:
            store.wait() if reported_by == "wait" else save(store, 3, state(3))
    assert e.value.step == 2 and e.value.path == str(tmp_path / "2") and e.value.__cause__ is not None
    store.wait()                                    # raised once
    assert store.steps() == [1]
    assert store.leftovers() == [str(tmp_path / "2.orbax-checkpoint-tmp")]
    assert store.cleanup() == [str(tmp_path / "2.orbax-checkpoint-tmp")]


# -- corruption --------------------------------------------------------------------


def _largest_file(directory: pathlib.Path) -> pathlib.Path:
    return max((p for p in directory.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def _saved(tmp_path, steps=(1, 2, 3)) -> CheckpointStore:
    store = CheckpointStore(str(tmp_path))
    for s in steps:
        save(store, s, state(s))
        store.wait()
    return store


# Tensorstore's failed read leaves a callback for orbax's closed event loop (orbax 0.12.8): not ours, harmless.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_truncated_checkpoint_is_refused_naming_its_path_and_the_newest_valid_one_is_restored(tmp_path):
    store = _saved(tmp_path)
    data = _largest_file(tmp_path / "3" / "state")
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    with pytest.raises(CheckpointCorruptError) as e:
        store.restore()
    assert e.value.path == str(tmp_path / "3") and str(tmp_path / "3") in str(e.value)
    restored, skipped = store.restore_newest_valid()
    assert restored.step == 2
    assert_same(restored.leaves, state(2))
    assert [(s.step, s.path) for s in skipped] == [(3, str(tmp_path / "3"))] and skipped[0].reason
    assert store.restore_newest_valid(at_most=1)[0].step == 1


def test_a_flipped_bit_is_caught_by_the_digest(tmp_path):
    """Orbax and tensorstore read a flipped byte in an array without complaint; the recorded digest catches it."""
    store = _saved(tmp_path, steps=(1, 2))
    data = _largest_file(tmp_path / "2" / "state")
    content = bytearray(data.read_bytes())
    content[len(content) // 2] ^= 0x01
    data.write_bytes(bytes(content))
    with pytest.raises(CheckpointCorruptError, match="hash to") as e:
        store.restore(2)
    assert e.value.path == str(tmp_path / "2")
    restored, [skip] = store.restore_newest_valid()
    assert restored.step == 1 and skip == Skipped(2, str(tmp_path / "2"), e.value.reason)


def test_an_unreadable_record_is_refused_and_no_valid_checkpoint_says_why(tmp_path):
    store = _saved(tmp_path, steps=(4,))
    [record] = [p for p in (tmp_path / "4" / "meta").rglob("*") if p.is_file() and b"\"digest\"" in p.read_bytes()]
    record.write_bytes(b"{not json")
    with pytest.raises(CheckpointCorruptError, match="record cannot be read"):
        store.restore(4)
    with pytest.raises(CheckpointNotFoundError, match="step 4: its record cannot be read"):
        store.restore_newest_valid()


def test_saving_a_step_again_replaces_it(tmp_path):
    store = _saved(tmp_path, steps=(1, 2))
    data = _largest_file(tmp_path / "2" / "state")
    data.write_bytes(b"")
    save(store, 2, state(2))
    store.wait()
    assert store.steps() == [1, 2] and store.leftovers() == []
    assert_same(store.restore(2).leaves, state(2))


# -- retention -----------------------------------------------------------------------


def test_max_to_keep_keeps_the_newest_and_leaves_nothing_behind(place):
    where, gcs = place
    store = store_at(where, gcs, max_to_keep=2)
    for s in (1, 2, 5, 3):     # an older step saved after a fallback is kept as it is the one just saved
        save(store, s, [np.full(8, s, np.float32)])
        store.wait()
    assert store.steps() == [3, 5]
    assert store.leftovers() == []
    if gcs:
        prefix = where.removeprefix(f"gs://{BUCKET}/") + "/"
        assert {o[len(prefix):].split("/")[0] for o in gcs.objects(BUCKET, prefix)} == {"3", "5"}
    else:
        assert sorted(os.listdir(where)) == ["3", "5"]


def test_a_failed_removal_of_an_old_checkpoint_is_reported_after_the_commit(tmp_path):
    """An immutable old checkpoint (chattr +i: even root cannot rename it) cannot be pruned."""
    store = CheckpointStore(str(tmp_path), max_to_keep=1)
    save(store, 1, state(1))
    store.wait()
    if subprocess.run(["chattr", "+i", str(tmp_path / "1")], capture_output=True).returncode:
        pytest.skip("this file system has no immutable flag (chattr +i)")
    try:
        save(store, 2, state(2))
        with pytest.raises(CheckpointPruneError) as e:
            store.wait()
        assert e.value.step == 2 and isinstance(e.value.__cause__, PermissionError)
    finally:
        subprocess.run(["chattr", "-i", str(tmp_path / "1")], check=True)
    assert store.steps() == [1, 2]          # the new one is committed; the old one is still whole
    assert_same(store.restore(1).leaves, state(1))


# -- contract ------------------------------------------------------------------------


def test_bad_arguments_are_refused_before_anything_is_written(tmp_path):
    store = CheckpointStore(str(tmp_path))
    leaves = state()
    digest = state_digest(leaves)
    with pytest.raises(ValueError, match="state digest"):
        store.save(1, leaves, digest="abc")
    with pytest.raises(ValueError, match="store's own"):
        store.save(1, leaves, digest=digest, metadata={"step": 3})
    with pytest.raises(ValueError, match="JSON"):
        store.save(1, leaves, digest=digest, metadata={"x": object()})
    with pytest.raises(ValueError, match="step"):
        store.save(-1, leaves, digest=digest)
    with pytest.raises(ValueError, match="max_to_keep"):
        CheckpointStore(str(tmp_path), max_to_keep=0)
    with pytest.raises(ValueError, match="bucket"):
        CheckpointStore("gs://ab/run")
    with pytest.raises(ValueError, match="gs://"):
        CheckpointStore(str(tmp_path), gcs_endpoint="http://127.0.0.1:1")
    assert os.listdir(tmp_path) == []


def test_an_empty_or_missing_directory_has_no_checkpoint(tmp_path):
    store = CheckpointStore(str(tmp_path / "never-written"))
    assert store.steps() == [] and store.leftovers() == [] and store.cleanup() == []
    with pytest.raises(CheckpointNotFoundError) as e:
        store.restore()
    assert isinstance(e.value, FileNotFoundError)
    with pytest.raises(CheckpointNotFoundError, match="none was ever committed"):
        store.restore_newest_valid()
    assert not (tmp_path / "never-written").exists()


def test_errors_survive_pickling():
    for e in (CheckpointCorruptError("/c/3", "its leaves hash to x"), CheckpointNotFoundError("/c", 3, "none"),
              CheckpointSaveError("/c/3", 3, "EFBIG"), CheckpointPruneError("/c", 3, "EPERM"),
              CheckpointTimeoutError("/c/3", 3, 1.5)):
        again = pickle.loads(pickle.dumps(e))
        assert type(again) is type(e) and str(again) == str(e)


def test_two_saves_in_one_process_at_once_both_commit(tmp_path):
    """orbax keeps process-wide state for a save in flight; two stores saving at once (a worker's warm-up beside
    its first real save) must not fail each other (they once did: 'Directory not empty: ocdbt.process_0')."""
    leaves = [np.arange(5000, dtype=np.float32), np.ones((3, 7), np.int32)]
    stores = [CheckpointStore(str(tmp_path / f"d{i}")) for i in range(3)]
    for i, store in enumerate(stores):
        store.save(i + 1, leaves, digest=state_digest(leaves), metadata={"i": i})
    for i, store in enumerate(stores):
        store.wait()
        assert store.steps() == [i + 1] and store.restore().metadata["i"] == i
