"""Slices of several hosts on real processes: `elastic chaos` with 2 slices of 2 worker processes each (2 CPU
devices a host, one JAX distributed system a slice, gloo between its hosts) and a spare slice.

One host of a slice is killed (the spare slice takes the slice's place; its other host is retired with it), then
the client is killed (the harness starts it again and it re-attaches both slices, every host of each), then one
host of another slice is stopped (SIGSTOP: its peer, waiting in the slice's collective, leaves its stacks; no
spare is left warm: the run shrinks). The run ends bit-identical to the
fault-free reference, itself run as one slice of 2 processes (the same host count: collectives across processes
sum in their own order), with no step lost; the report names each slice's hosts, the host each fault hit and the
hosts retired with it, and no process of the run is left. Its checkpoints are each host's blocks, and a run of
one-host slices resumes from the last of them.
"""

import json
import pathlib
import time

import jsonschema

from tests.conftest import ROOT, processes, run_cli
from tests.support.events import kinds, run_events

SCHEMA = json.loads((ROOT / "docs" / "report.schema.json").read_text())
STEPS = 12


def test_a_host_lost_loses_its_slice_which_a_spare_slice_replaces_then_the_run_shrinks(tmp_path):
    run_cli(["chaos", "tiny", "dcn_data_parallelism=2", "elastic_hosts_per_slice=2", "ici_fsdp_parallelism=4",
             "elastic_spares=1", f"steps={STEPS}", "run_name=faulted", "elastic_client_grace_seconds=20",
             "enable_checkpointing=true", "checkpoint_period=4", "eval_interval=3", "eval_steps=1",
             "--faults", "kill:slice=1,host=1@step=3,kill:client@step=6,hang:slice=0,host=0@step=9"], tmp_path)
    run_dir = pathlib.Path(tmp_path) / "faulted"
    report = json.loads((run_dir / "report.json").read_text())
    events = run_events(run_dir)
    jsonschema.validate(report, SCHEMA)
    assert report["verdict"] == "pass", report["verdict_reasons"]
    assert report["steps_completed"] == STEPS and report["steps_lost"] == 0
    assert report["trajectory"] == "identical" and report["exactly_once"] is True
    assert report["final_state_digest"] == report["reference"]["final_state_digest"]
    assert [f["path"] for f in report["failures"]] == ["replace", "retry", "shrink"]
    assert report["client_restarts"] == 1 and report["run_state_replayed"] is True
    # Each host of a slice runs the eval program on the slice's global arrays: an eval after every third step,
    # recorded once (across the client's restart too), never changing the digest checked above.
    assert [e["step"] for e in report["evals"]] == list(range(0, STEPS, 3))
    done = [e["step"] for e in kinds(events, "eval_completed")]
    assert len(done) == len(set(done)) and all(e["loss"] > 0 for e in report["evals"] if "skipped" not in e)
    [attached] = kinds(events, "client_attached")
    assert {"w0", "w2"} <= set(attached["workers"])   # the active slices (the relaunched one may still be forming)
    assert all(len(w["hosts"]) == 2 for w in attached["workers"].values())

    killed, client, cut = report["faults"]
    assert client["workers"] == [] and client["path"] == "retry"
    assert killed["workers"] == ["w1"] and killed["hosts"] == {"w1": 1} and killed["retired"] == {"w1": [0]}
    assert cut["workers"] == ["w0"] and cut["hosts"] == {"w0": 0} and cut["retired"] == {"w0": [1]}
    # Its peer, waiting for it in the slice's collective, said where the slice hung before both were stopped.
    [cut_dead] = [e for e in kinds(events, "worker_dead") if e["worker"] == "w0"]
    peer = (run_dir / cut_dead["stacks"]).read_text()
    assert "== w0/1" in peer and "Thread MainThread" in peer and "(no stacks: declared hung: " in peer
    hosts = report["slice_hosts"]
    assert {"w0", "w1", "w2"} <= set(hosts) and all(len(h) == 2 for h in hosts.values())
    [placed, *_] = kinds(events, "placement")
    assert placed["active"] == ["w0", "w1"] and placed["spares"] == ["w2"]
    [relaunched, *_] = kinds(events, "worker_relaunched")   # the lost slice comes back as a fresh slice of 2
    assert relaunched["replaces"] == "w1"
    pids = {h["pid"] for e in kinds(events, "worker_registered") for h in e["hosts"]}
    assert len(pids) >= 8   # three slices of two hosts, and the one relaunched
    deadline = time.monotonic() + 10
    while pids & set(processes()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pids & set(processes()), "a host of the run outlived it"

    # Each host wrote its blocks, and a checkpoint counted once both had (step 8's may be lost with its writer
    # slice, cut off at step 9): a run of one-host slices resumes from the last.
    saved = sorted({e["step"] for e in kinds(events, "checkpoint_saved")})
    assert {4, STEPS} <= set(saved) <= {4, 8, STEPS}
    for step in saved:
        for k in (0, 1):
            assert (run_dir / "checkpoints" / f"host{k}-of-2" / str(step) / "commit_success.txt").exists()
    run_cli(["run", "tiny", "ici_fsdp_parallelism=4", f"steps={STEPS + 1}", "run_name=one-host",
             f"load_full_state_path={run_dir / 'checkpoints'}"], tmp_path)
    resumed = kinds(run_events(pathlib.Path(tmp_path) / "one-host"), "run_resumed")
    assert [(e["step"], e["tier"]) for e in resumed] == [(STEPS, "checkpoint")]
