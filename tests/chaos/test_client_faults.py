"""`elastic chaos` with client faults, on real processes: the client killed or stopped, and started again.

Each test runs the CLI end to end (reference, the faulted run's clients as child processes of the harness,
which restarts them, verdict) and asserts the verdict fields: the run finishes bit-identical to the fault-free
reference with no step lost and no checkpoint or snapshot read (a live replica is always left), the run state
replayed from the log equals the last client's, and nothing is left running. The workers' client grace is 20 s,
so a failing test leaves no worker behind for long.
"""

import json
import pathlib
import re
import time

import jsonschema
import pytest

from tests.conftest import ROOT, processes, run_cli
from tests.support.events import kinds, run_events
from tests.support.metrics_files import metrics_file_lines, tensorboard_scalars

RUN = ["tiny", "dcn_data_parallelism=2", "ici_fsdp_parallelism=1", "elastic_microbatches=2", "steps=40",
       "elastic_client_grace_seconds=20"]
SCHEMA = json.loads((ROOT / "docs" / "report.schema.json").read_text())


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """One output directory for the module's runs (each its own run_name): they share one reference."""
    return tmp_path_factory.mktemp("client-faults")


@pytest.fixture
def where(base, request):
    """Where a test's run goes: ``base``, under a run name of its own."""
    return base, request.node.name.removeprefix("test_")[:40]


def chaos(where, faults, *overrides):
    base, name = where
    proc, _ = run_cli(["chaos", *RUN, f"run_name={name}", *overrides, "--faults", faults], base)
    run_dir = pathlib.Path(base) / name
    report = json.loads((run_dir / "report.json").read_text())
    events = run_events(run_dir)
    jsonschema.validate(report, SCHEMA)
    return proc, report, events


def passed(report, events, restarts=1):
    assert report["verdict"] == "pass", report["verdict_reasons"]
    assert report["steps_completed"] == 40 and report["steps_lost"] == 0
    assert report["checkpoint_restores"] == report["snapshot_restores"] == 0
    assert report["trajectory"] == "identical" and report["exactly_once"] is True
    assert report["run_state_replayed"] is True   # the last client's state, sent back to the harness
    assert report["final_state_digest"] == report["reference"]["final_state_digest"]
    assert report["client_restarts"] == restarts and report["client_downtime_seconds"] > 0
    assert all(p["kind"] == "replica" and p["kept"] for p in report["promises"]), report["promises"]
    assert [e["kind"] for e in events].count("run_finished") == 1
    _nothing_left(events)


def _nothing_left(events):
    """Every worker of the run and every client it had are gone once the command returned."""
    pids = {e["pid"] for e in events if e["kind"] == "worker_registered"}
    pids |= {w["pid"] for e in events if e["kind"] == "client_attached" for w in e["workers"].values()}
    deadline = time.monotonic() + 10
    while pids & set(processes()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pids & set(processes()), "a worker outlived the run"


def test_a_killed_client_is_restarted_and_re_attaches_its_live_workers(where):
    proc, report, events = chaos(where, "kill:client@step=20")
    passed(report, events)
    [fault] = kinds(events, "fault_injected")
    assert fault["fault"] == "kill:client@step=20" and fault["workers"] == [] and fault["step"] == 20
    [attached] = kinds(events, "client_attached")
    assert sorted(attached["workers"]) == ["w0", "w1"] and attached["lost"] == [] and attached["generation"] == 1
    assert report["attempts"][-1]["reattached"]["workers"] == ["w0", "w1"]
    [failure] = report["failures"]
    assert failure["error"] == "ClientLostError" and failure["path"] == "retry"
    after = events[events.index(attached):]
    assert not kinds(after, "state_transferred") and not kinds(after, "run_started")   # the same attempt goes on
    assert re.search(r"chaos: fault 'kill:client@step=20' killed client 0 \(pid \d+\): starting the same job "
                     "again", proc.stderr), proc.stderr
    assert "re-attached 2 live workers" in proc.stderr


def test_a_client_killed_while_a_checkpoint_is_written_and_one_that_hung_within_the_lease(where):
    # The kill strikes at the commit that makes 20 steps, as the writer starts saving the checkpoint of step 20
    # (off the step's path): the worker finishes it and the restarted client hears of it. The hang before it
    # (2 s, within the 5 s lease) is the client's own: it wakes and goes on, no restart.
    proc, report, events = chaos(where, "hang(resume=2s):client@step=6,kill:client@step=20",
                                 "enable_checkpointing=true", "checkpoint_period=4")
    passed(report, events)
    hang, kill = kinds(events, "fault_injected")
    assert hang["step"] == 6 and kill["step"] == 20
    assert min(e["t"] for e in events if e["t"] > hang["t"] and e["kind"] == "step_committed") - hang["t"] >= 2.0
    cut, attached = events.index(kill), events.index(kinds(events, "client_attached")[0])
    saved_before = {e["step"] for e in kinds(events[:cut], "checkpoint_saved")}
    saved_after = {e["step"] for e in kinds(events[attached:], "checkpoint_saved")}
    assert 20 not in saved_before and 20 in saved_after, (saved_before, saved_after)   # in flight at the kill
    assert 40 in saved_after and not kinds(events, "checkpoint_failed")
    assert proc.stderr.count("starting the same job again") == 1


def test_a_client_still_stopped_when_the_run_ends_is_woken_then_and_changes_nothing(where):
    # resume=60s outlasts the run: the new client finishes the last steps long before it. Woken as the run
    # ends, the stale client finds its run another's (its workers gone home) and exits as superseded.
    proc, report, events = chaos(where, "hang(resume=60s):client@step=36")
    passed(report, events)
    assert re.search(r"client 0 \(pid \d+\) was still stopped by fault 'hang\(resume=60s\):client@step=36' when "
                     "the run ended: woken now", proc.stderr), proc.stderr
    assert "woke, was refused by every worker and exited with status 3 (superseded)" in proc.stderr
    assert [e["kind"] for e in events][-2:] == ["run_finished", "verdict"]   # nothing written after the run


def test_a_client_killed_as_the_state_transfer_of_a_recovery_begins(where):
    base, name = where
    metrics = pathlib.Path(base) / f"{name}.metrics.jsonl"
    proc, report, events = chaos(where, "kill:slice=1@step=5,kill:client@transfer", "elastic_spares=1",
                                 "enable_tensorboard=true", f"metrics_file={metrics}")
    passed(report, events)
    # MaxText's metrics of the committed steps, each once: TensorBoard's lost its unflushed tail with the killed
    # client (log_period 100), and the restarted one wrote it again from the event log before going on.
    assert tensorboard_scalars(pathlib.Path(base) / name) == list(enumerate(report["losses"]))
    assert [v for _, v in tensorboard_scalars(pathlib.Path(base) / name, "elastic/recoveries")][-1] == 1
    lines = metrics_file_lines(metrics)
    assert [line["step"] for line in lines] == list(range(40)) and {line["run_name"] for line in lines} == {name}
    assert [line["learning/loss"] for line in lines] == report["losses"]
    assert {"learning/current_learning_rate", "perf/step_time_seconds", "perf/per_device_tokens_per_sec"} \
        <= lines[-1].keys()
    worker, client = kinds(events, "fault_injected")
    assert worker["workers"] == ["w1"] and client["fault"] == "kill:client@transfer"
    # It struck inside the recovery of the worker's death (after its decision, before its transfer), which the
    # restarted client finished: one recovery, both failures, a replica left.
    decision = kinds(events, "recovery_decision")[0]
    assert events.index(decision) < events.index(client) < events.index(kinds(events, "job_started")[1])
    assert not kinds(events[:events.index(client)], "state_transferred")
    [promise] = report["promises"]
    assert promise["failures"] == [0, 1] and promise["left"]["replicas"] == ["w0"]
    # The spare the transfer was for had its programs and no state yet: it outlived its client for the grace
    # too (every worker of the run does, whatever it holds), and the restarted client re-attached it.
    [attached] = kinds(events, "client_attached")
    assert attached["lost"] == [] and sorted(attached["workers"]) == ["w0", "w2"]


def test_a_client_stopped_past_the_lease_is_taken_over_and_refused_when_it_wakes(where):
    proc, report, events = chaos(where, "hang(resume=6s):client@step=5")
    passed(report, events)
    err = proc.stderr
    stopped = re.search(r"stopped client 0 \(pid (\d+)\) for longer than the workers' lease \(5 s\): starting a "
                        "new client, which takes the run over", err)
    assert stopped, err
    pid = stopped.group(1)
    assert f"(pid {pid}) is stopped: this one takes the run over" in err
    assert re.search(rf"client 0 \(pid {pid}\) woke after another client took the run over, and exits: worker "
                     r"w\d refused this client: client generation 0 of run \w+ was taken over by generation 1", err)
    assert f"client 0 (pid {pid}), stopped by fault 'hang(resume=6s):client@step=5', woke, was refused by every " \
           "worker and exited with status 3 (superseded)" in err
    assert int(pid) not in processes()
    assert report["client_downtime_seconds"] >= 5
    # The stale client wrote nothing more to the run's log (its log was copied aside when the new one took over).
    assert [e["kind"] for e in events][-2:] == ["run_finished", "verdict"]
    assert len(kinds(events, "fault_injected")) == 1 and not kinds(events, "fault_skipped")
