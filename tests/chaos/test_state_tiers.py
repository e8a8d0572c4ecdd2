"""The state tiers under chaos: every active replica lost, and the state still comes back.

A spare that shadows the state (``elastic_shadow_spares``) replaces every
active slice at once with no step lost and no transfer. Without one, the run
restores its newest in-memory snapshot (``elastic_snapshot_interval``: kept in
host memory, outside the worker processes, with a copy on another host), else
its newest complete checkpoint. Real runs (CLI, real workers, real
orbax checkpoints written by one replica in the background every 4 steps):

- ``kill:all`` on local disk: every active worker dies, the spare loads the
  checkpoint;
- ``kill:everything`` on ``gs://`` (a real GCS protocol server on loopback):
  the spare dies too, the relaunched workers are waited for and load it;
- ``kill_save``: the writer of a save still ahead dies half way through it,
  on local disk and on ``gs://``; the cut save is never counted and is
  removed at the end (or, the last one, written again by a survivor);
- the client itself killed mid-run, then its newest checkpoint corrupted:
  ``elastic run`` again with the same run name resumes from the newest valid
  checkpoint (MaxText's auto-resume) and says which one it passed over.

Faults fire ``@checkpoint=N`` (once a checkpoint of step N or later is
complete), so what exists when they strike does not depend on timing.

Each ends bit-identical to the fault-free reference, and its chaos verdict
passes: each recovery kept the promise of what its fault left
(``chaos.promise``: the newest snapshot or checkpoint restored, at most its
interval or period plus the steps in flight recomputed).
"""

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time
import uuid

import pytest

from tests.conftest import ROOT, run_cli
from tests.gcs_emulator import GcsEmulator
from tests.support.events import run_events

SMALL = ["tiny", "dcn_data_parallelism=2", "ici_fsdp_parallelism=1", "elastic_microbatches=2",
         "enable_checkpointing=true", "checkpoint_period=4"]


def test_a_shadowing_spare_replaces_every_active_slice_with_no_step_lost(tmp_path):
    proc, report = run_cli(["chaos", "tiny", "steps=30", "dcn_data_parallelism=2", "ici_fsdp_parallelism=1",
                            "elastic_microbatches=2", "elastic_spares=1", "elastic_shadow_spares=true",
                            "run_name=sh", "--faults", "kill:all@step=12"], tmp_path)
    (failure,) = report["failures"]
    assert failure["restore_tier"] == "shadow" and failure["bytes_moved"] == 0, failure
    assert sorted(failure["workers"]) == ["w0", "w1"] and failure["path"] == "shrink"
    assert report["steps_lost"] == 0 and report["checkpoint_restores"] == 0
    assert report["verdict"] == "pass" and report["trajectory"] == "identical"
    assert report["final_state_digest"] == report["reference"]["final_state_digest"]
    events = run_events(pathlib.Path(tmp_path) / "sh")
    assert not any(e["kind"] in ("transfer_started", "shadow_behind") for e in events)


@pytest.mark.parametrize("spares", [0, 1])
def test_losing_every_replica_restores_the_newest_in_memory_snapshot_bit_identically(spares, tmp_path):
    """Snapshots every 4 steps, in host memory (a directory per simulated host) with a copy on another host.
    No spare: both workers die; the relaunched ones come up on the same hosts and one loads the snapshot its
    host kept. One spare: it holds the writer's copy on its own host, takes over at once and loads that."""
    shm = pathlib.Path(tmp_path) / "shm"
    proc, report = run_cli(["chaos", "tiny", "steps=24", "dcn_data_parallelism=2", "ici_fsdp_parallelism=1",
                            "elastic_microbatches=2", "elastic_snapshot_interval=4", f"elastic_spares={spares}",
                            f"elastic_snapshot_directory={shm}", "run_name=sn", "--faults", "kill:all@snapshot=8"],
                           tmp_path, check=False)
    run_dir = pathlib.Path(tmp_path) / "sn"
    report = json.loads((run_dir / "report.json").read_text())
    events = run_events(run_dir)
    assert report["finished"] and report["steps_completed"] == 24, report["verdict_reasons"]
    assert report["final_state_digest"] == report["reference"]["final_state_digest"]
    assert report["trajectory"] == "identical" and report["losses"] == report["reference"]["losses"]
    (restored,) = [e for e in events if e["kind"] == "snapshot_restored"]
    assert report["snapshot_restores"] == 1 and report["checkpoint_restores"] == 0
    failure = report["failures"][-1]
    assert failure["restore_tier"] == "snapshot" and failure["path"] == "restore", failure
    assert 8 <= restored["step"] and restored["step"] % 4 == 0
    assert restored["steps_lost"] == report["steps_lost"] <= 4   # at most the interval
    written = {(e["host"], e["step"]) for e in events if e["kind"] == "snapshot_saved"}
    copied = {(e["host"], e["step"]) for e in events if e["kind"] == "snapshot_copied"}
    assert (restored["host"], restored["step"]) in written | copied
    if spares:   # the spare took over from its own host's copy: no relaunch was waited for
        spare = next(e["spares"] for e in events if e["kind"] == "placement")[0]
        assert restored["worker"] == spare and (restored["host"], restored["step"]) in copied
        assert not any(e["kind"] == "capacity_wait" for e in events)
    else:        # the relaunched workers were waited for, on the dead workers' hosts
        assert any(e["kind"] == "capacity_wait" for e in events)
        relaunched = {e["worker"]: e["host"] for e in events if e["kind"] == "worker_relaunched"}
        assert restored["worker"] in relaunched and restored["host"] == relaunched[restored["worker"]]
    assert not any(shm.iterdir()), list(shm.iterdir())   # the run gave the memory back
    # The fault left only snapshots: restoring the newest, recomputing at most the interval (plus in flight),
    # keeps that promise, and the verdict passes (README: kill:all@snapshot=8).
    (promise,) = report["promises"]
    assert promise["kind"] == "snapshot" and promise["left"]["replicas"] == [] and promise["kept"], promise
    assert promise["newest"] <= restored["step"] and promise["recomputed"] == report["steps_lost"]
    assert promise["recomputed"] <= promise["allowed_recompute"] == 4 + promise["in_flight"]
    assert proc.returncode == 0 and report["verdict"] == "pass", report["verdict_reasons"]


@pytest.mark.parametrize("target,storage", [("all", "local"), ("everything", "gcs")])
def test_losing_every_copy_in_memory_restores_the_newest_checkpoint_bit_identically(target, storage, tmp_path,
                                                                                    monkeypatch):
    extra = []
    if storage == "gcs":
        gcs = GcsEmulator(tmp_path / "fake-gcs-server.log").start()
        gcs.create_bucket("elastic-ck")
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs.endpoint)   # the client and its workers reach it
        extra = [f"elastic_checkpoint_directory=gs://elastic-ck/{uuid.uuid4().hex}"]
    try:
        proc, _ = run_cli(["chaos", *SMALL, "steps=40", "elastic_spares=1", "run_name=ck", *extra,
                           "--faults", f"kill:{target}@checkpoint=8"], tmp_path, check=False)
    finally:
        if storage == "gcs":
            gcs.stop()
    run_dir = pathlib.Path(tmp_path) / "ck"
    report = json.loads((run_dir / "report.json").read_text())
    events = run_events(run_dir)
    assert report["finished"] and report["steps_completed"] == 40, report["verdict_reasons"]
    assert report["final_state_digest"] == report["reference"]["final_state_digest"]
    assert report["losses"] == report["reference"]["losses"]
    restored = [e for e in events if e["kind"] == "checkpoint_restored"]
    assert len(restored) == 1 and report["checkpoint_restores"] == 1
    step, killed_at = restored[0]["step"], report["failures"][-1]["step"]   # committed when it was detected
    assert step >= 8 and step % 4 == 0 and restored[0]["steps_lost"] == report["steps_lost"] == killed_at - step
    assert restored[0]["directory"].startswith("gs://" if storage == "gcs" else "/")
    failure = report["failures"][-1]
    assert failure["restore_tier"] == "checkpoint" and failure["path"] == "restore"
    injected = next(e for e in events if e["kind"] == "fault_injected")
    assert sorted(failure["workers"]) == sorted(injected["workers"])
    if target == "everything":   # nobody was left: the relaunched workers were waited for
        assert any(e["kind"] == "capacity_wait" for e in events)
        assert len(failure["workers"]) == 3
    # Only a checkpoint was left: the newest complete one restored keeps the promise; the verdict passes.
    # (The restore may find a complete checkpoint newer than the newest reported saved before the failure.)
    (promise,) = report["promises"]
    assert promise["kind"] == "checkpoint" and promise["kept"] and promise["newest"] <= step, promise
    assert promise["recomputed"] == report["steps_lost"] <= promise["allowed_recompute"]
    assert proc.returncode == 0 and report["verdict"] == "pass", report["verdict_reasons"]
    assert report["trajectory"] == "identical"
    saved = sorted(e["step"] for e in events if e["kind"] == "checkpoint_saved")
    assert saved[-1] == 40, saved   # the last step is saved too, before the run finishes


@pytest.mark.parametrize("storage,steps,period,at", [("local", 10, 2, 4), ("gcs", 30, 5, 10)])
def test_a_save_cut_off_by_its_writers_death_is_never_counted_and_is_removed(storage, steps, period, at, tmp_path,
                                                                          monkeypatch):
    """kill_save@checkpoint=N strikes while a later checkpoint is still to be written, however late checkpoint N
    is reported (here often only as the run ends, while the last saves are being written): the writer of a save
    still ahead dies half way through it, on local disk and on gs:// alike."""
    extra, gcs = [], None
    if storage == "gcs":
        gcs = GcsEmulator(tmp_path / "fake-gcs-server.log").start()
        gcs.create_bucket("elastic-ks")
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs.endpoint)
        prefix = uuid.uuid4().hex
        extra = [f"elastic_checkpoint_directory=gs://elastic-ks/{prefix}"]
    try:
        proc, report = run_cli(["chaos", *SMALL, f"steps={steps}", f"checkpoint_period={period}", "run_name=ks",
                                *extra, "--faults", f"kill_save@checkpoint={at}"], tmp_path)
        left = sorted({name.split("/")[1] for name in gcs.objects("elastic-ks", prefix)}) if gcs else \
            sorted(p.name for p in (pathlib.Path(tmp_path) / "ks" / "checkpoints").iterdir())
    finally:
        if gcs is not None:
            gcs.stop()
    events = run_events(pathlib.Path(tmp_path) / "ks")
    (fault,) = report["faults"]
    assert fault["kind"] == "kill_save" and fault["skipped"] is None and fault["path"] in ("replace", "shrink"), fault
    (victim,) = fault["workers"]
    injected = next(e for e in events if e["kind"] == "fault_injected")
    assert injected["errors"] == {} and any(e["kind"] == "worker_dead" and e["worker"] == victim for e in events)
    died = next(i for i, e in enumerate(events) if e["kind"] == "worker_dead" and e["worker"] == victim)
    cut = [int(p.rstrip("/").rsplit("/", 1)[-1].split(".")[0])
           for e in events if e["kind"] == "checkpoint_leftovers_removed" for p in e["paths"]]
    assert all(step > at for step in cut), cut   # saves after checkpoint N, never listed
    assert not any(e["kind"] == "checkpoint_saved" and (e["step"], e["worker"]) == (step, victim)
                   for e in events for step in cut)
    # The cut save was removed at the end, or it was the last one, written again by a survivor.
    resaved = [e for e in events[died:] if e["kind"] == "checkpoint_saved" and e["step"] == steps]
    assert cut or (resaved and resaved[0]["worker"] != victim), (cut, resaved)
    assert all(name.isdigit() for name in left) and str(steps) in left, left   # only complete checkpoints remain
    assert report["verdict"] == "pass" and report["trajectory"] == "identical" and report["steps_lost"] == 0
    (promise,) = report["promises"]
    assert promise["kind"] == "replica" and promise["kept"]


def test_a_killed_client_resumes_from_the_newest_checkpoint_with_the_same_run_name(tmp_path):
    # elastic_client_grace_seconds=0: the workers exit with their client, as before the grace (no re-attach)
    # 80 steps: on a loaded host the first run must not finish before two of its checkpoints are reported
    args = ["run", *SMALL, "steps=80", "elastic_client_grace_seconds=0", "run_name=rs",
            f"base_output_directory={tmp_path}", "--quiet"]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)
    run_dir = tmp_path / "rs"
    first = subprocess.Popen([sys.executable, "-m", "elastic.cli", *args], env=env, cwd=tmp_path,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    deadline, saved = time.monotonic() + 240, []
    while time.monotonic() < deadline and first.poll() is None:   # kill the client once a checkpoint exists
        if (run_dir / "events.jsonl").exists():
            saved = [e["step"] for e in run_events(run_dir) if e["kind"] == "checkpoint_saved"]
            if len(saved) >= 2:
                break
        time.sleep(0.05)
    assert len(saved) >= 2 and first.poll() is None, "the first run ended before two checkpoints were saved"
    # The client and every worker it started, at once (the workers run in process groups of their own).
    for pid in [first.pid] + [e["pid"] for e in run_events(run_dir) if e["kind"] == "worker_registered"]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    first.wait()
    committed = sum(e["kind"] == "step_committed" for e in run_events(run_dir))
    assert committed < 80
    reached = max(e["step"] for e in run_events(run_dir) if e["kind"] == "step_committed") + 1

    complete = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    assert len(complete) >= 2, complete   # (the test waits for two, so one can be spoiled)
    newest = run_dir / "checkpoints" / str(complete[-1])
    for f in (newest / "items").rglob("*"):   # spoil the newest: its arrays no longer match its record
        if f.is_file() and f.stat().st_size > 1000:
            f.write_bytes(f.read_bytes()[:-1000])

    proc, report = run_cli(args[:-2], tmp_path)   # the same command again
    resumed = report["resumed_from"]
    assert resumed["tier"] == "checkpoint" and resumed["losses_recorded"], resumed
    assert resumed["step"] == complete[-2], (resumed, complete)   # the newest valid one
    assert report["checkpoints_skipped"] and f"step {complete[-1]} " in report["checkpoints_skipped"][0]
    assert report["finished"] and report["steps_completed"] == 80 and len(report["losses"]) == 80
    # One log for both attempts; the steps the killed client had committed after that checkpoint were recomputed.
    first_attempt, second_attempt = report["attempts"]
    assert first_attempt["end"] == "died" and "client died" in first_attempt["failure_reason"]
    assert second_attempt["after"] == "died" and second_attempt["started_from"]["step"] == complete[-2]
    assert report["steps_lost"] == second_attempt["steps_recomputed"] == reached - complete[-2] > 0

    _, ref = run_cli(["run", *SMALL, "steps=80", "run_name=ref", "--reference"], tmp_path)
    assert report["final_state_digest"] == ref["final_state_digest"]
    assert report["losses"] == ref["losses"]   # the first steps' losses came back from the checkpoint


def test_a_checkpoint_resumes_on_another_mesh_within_tolerance(tmp_path):
    """2 slices x 2 devices write the checkpoints; the run resumes as 1 slice x 4 devices (the same data: the
    microbatch keeps its 4 rows, per_device_batch_size 2 -> 1). The whole arrays are placed on the new slice's
    devices; the losses before the resume are the recorded ones, those after follow the first run (the same math
    on the old mesh) within tolerance, and the report says which comparison applies."""
    import numpy as np

    common = ["tiny", "steps=12", "enable_checkpointing=true", "checkpoint_period=4", "run_name=mesh",
              "elastic_microbatches=2"]
    new_mesh = ["dcn_data_parallelism=1", "ici_fsdp_parallelism=4", "per_device_batch_size=1"]
    _, first = run_cli(["run", *common, "dcn_data_parallelism=2", "ici_fsdp_parallelism=2"], tmp_path)
    checkpoints = pathlib.Path(tmp_path) / "mesh" / "checkpoints"
    for step in ("12", "8"):   # as if the first run had stopped after step 4's checkpoint
        shutil.rmtree(checkpoints / step)
    _, report = run_cli(["run", *common, *new_mesh], tmp_path)
    resumed = report["resumed_from"]
    assert resumed["step"] == 4 and resumed["comparison"] == "within tolerance"
    assert resumed["resharded_from"] == {"devices_per_slice": 2, "microbatches": 2}
    assert report["finished"] and report["losses"][:4] == first["losses"][:4]
    # The same math on another mesh: the resumed steps follow the first run's within float rounding.
    np.testing.assert_allclose(report["losses"], first["losses"], rtol=1e-5)

    # MaxText's load_full_state_path: another run starts from one step of those checkpoints, bit for bit.
    _, other = run_cli(["run", "tiny", "steps=12", "elastic_microbatches=2", *new_mesh, "run_name=other",
                        f"load_full_state_path={checkpoints}/8"], tmp_path)
    assert other["resumed_from"]["step"] == 8 and other["resumed_from"]["directory"] == str(checkpoints)
    assert other["resumed_from"]["comparison"] == "bit-identical"
    assert other["final_state_digest"] == report["final_state_digest"] and other["losses"] == report["losses"]
    # (A path that does not exist, holds no checkpoint or cannot be read: tests/unit/test_cli.py.)
    proc, _ = run_cli(["run", "tiny", "steps=8", "run_name=past", f"load_full_state_path={checkpoints}"], tmp_path,
                      check=False)   # its newest checkpoint is of step 12: nothing to train
    assert proc.returncode == 2 and "holds the state after 12 steps" in proc.stderr, proc.stderr
    assert "nothing to train" in proc.stderr and not (pathlib.Path(tmp_path) / "past" / "events.jsonl").exists()

    # Another model's checkpoint (other leaf shapes) is refused, naming it.
    proc, _ = run_cli(["run", *common, *new_mesh, "base_emb_dim=48"], tmp_path, check=False)
    assert proc.returncode != 0 and "written by other programs" in proc.stderr and "mesh/checkpoints" in proc.stderr
