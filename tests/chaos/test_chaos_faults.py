"""`elastic chaos` on real worker processes: one short scenario per fault kind.

Each test runs the CLI end to end (reference, faulted run, verdict) and
asserts the verdict fields, not just the exit code: the faulted run reaches
the last step bit-identical to the fault-free reference, with no lost step,
no checkpoint restore and every microbatch consumed exactly once.
"""

import json
import pathlib

import jsonschema

from tests.conftest import ROOT, run_cli
from tests.support.events import kinds, run_events

STEPS = 12
SCHEMA = json.loads((ROOT / "docs" / "report.schema.json").read_text())


def chaos(tmp_path, faults, *overrides, check=True, steps=STEPS):
    proc, _ = run_cli(["chaos", "tiny", f"steps={steps}", "run_name=faulted", *overrides, "--faults", faults],
                      tmp_path, check=check)
    run_dir = pathlib.Path(tmp_path) / "faulted"
    report = json.loads((run_dir / "report.json").read_text())
    events = run_events(run_dir)
    jsonschema.validate(report, SCHEMA)
    return proc, report, events


def passed(report, steps=STEPS):
    assert report["verdict"] == "pass", report["verdict_reasons"]
    assert report["verdict_reasons"] == []
    assert report["steps_completed"] == steps and report["steps_lost"] == 0
    assert report["checkpoint_restores"] == 0
    assert report["trajectory"] == "identical" and report["exactly_once"] is True
    assert report["final_state_digest"] == report["reference"]["final_state_digest"]
    assert report["losses"] == report["reference"]["losses"]


def test_sigkill_inside_each_phase_is_replaced_by_a_spare(tmp_path):
    # One run with a held-out eval after every second step, and a kill inside each phase of a step: slice 0's
    # worker in an eval (of step 0 or 2), slice 1's in grad at step 3, slice 2's in reduce at step 6, slice 3's in
    # apply at step 9; a spare for each. The reference computes no eval: the same digest says eval changed no bit.
    faults = ",".join(f"kill(phase={phase}):slice={i}@step={3 * i}"
                      for i, phase in enumerate(["eval", "grad", "reduce", "apply"]))
    _, report, events = chaos(tmp_path, faults, "elastic_spares=4", "eval_interval=2", "eval_steps=2")
    passed(report)
    assert [fault["workers"] for fault in report["faults"]] == [["w0"], ["w1"], ["w2"], ["w3"]]
    # An eval after every second step, once each, on the state that step applied: a recovery that committed the
    # step from the survivors' reports lost its evals, and the next step computed them first (before_step).
    evals = report["evals"]
    assert [e["step"] for e in evals] == list(range(0, STEPS, 2))   # MaxText's schedule: after step 0, 2, ...
    assert all(e["loss"] > 0 and e["batches"] == 8 and e["total_weights"] == 8 for e in evals), evals
    owed = [e for e in evals if "before_step" in e]   # at least the eval its worker was killed in
    assert owed and all(e["before_step"] == e["step"] + 1 for e in owed), evals
    assert sorted(e["step"] for e in events if e["kind"] == "eval_completed") == [e["step"] for e in evals]
    for fault in report["faults"]:
        assert fault["path"] == "replace", fault
        assert fault["detected_after_s"] is not None and fault["recovered_after_s"] >= fault["detected_after_s"]
        assert fault["bytes_moved"] == report["state_bytes"]
    assert [failure["kind"] for failure in report["failures"]] == ["crash"] * 4
    assert report["slices_at_end"] == 4
    # `elastic report` re-renders a chaos run from its log, verdict included
    run_dir = pathlib.Path(tmp_path) / "faulted"
    (run_dir / "report.json").unlink()
    proc, _ = run_cli(["report", str(run_dir)], tmp_path)
    again = json.loads((run_dir / "report.json").read_text())
    assert again == report and again["verdict"] == "pass"
    assert "PASS" in proc.stdout


def test_the_spare_killed_while_receiving_state_is_replaced_by_the_next(tmp_path):
    _, report, events = chaos(tmp_path, "kill:slice=1@step=3,kill:role=dest@transfer", "elastic_spares=2",
                              "elastic_relaunch=false")
    passed(report)
    dest_fault = report["faults"][1]
    assert dest_fault["spec"] == "kill:role=dest@transfer" and dest_fault["workers"] == ["w4"]
    [moved] = kinds(events, "state_transferred")
    assert moved["dest"] == "w5" and moved["transport"] == "shared_memory"   # workers on one host: memory to memory
    assert report["slices_at_end"] == 4


def test_the_source_killed_while_sending_state_leaves_another_replica(tmp_path):
    _, report, events = chaos(tmp_path, "kill:slice=2@step=3,kill:role=source@transfer", "elastic_spares=1",
                              "elastic_relaunch=false")
    passed(report)
    source = report["faults"][1]["workers"][0]
    [moved] = kinds(events, "state_transferred")
    assert moved["source"] != source and moved["dest"] == "w4" and moved["transport"] == "shared_memory"
    assert report["slices_at_end"] == 3   # the spare took one slice; the other slice shrank away


# Long enough that the run is still going when the cut-off worker comes back, 4 s after the fault: a step takes
# 25 ms or more here, so the run goes on for 7 s or more (150 steps were once over before it came back).
LONG = 300


def test_a_hung_worker_resumed_later_and_a_partitioned_one_back_have_fenced_themselves_and_are_refused(tmp_path):
    # One run, two spares: w2 hangs at step 3 and resumes 4 s later; w1 is cut off at step 20 for 4 s. Each is
    # replaced by a spare, fences itself when its own lease (2 s) lapses, and is refused when it asks back.
    _, report, events = chaos(tmp_path, "hang(resume=4s):slice=2@step=3,partition(for=4s):slice=1@step=20",
                              "elastic_spares=2", "elastic_worker_lease_seconds=2", steps=LONG)
    passed(report, steps=LONG)
    hung, cut = report["faults"]
    assert hung["path"] == cut["path"] == "replace" and cut["kind"] == "partition"
    assert [f["kind"] for f in report["failures"]] == ["hang", "partition"]
    refused = {e["worker"]: e for e in kinds(events, "register_refused") if e["rejoin"]}
    assert "fenced" in refused["w2"]["reason"], refused
    assert "w1" in refused, "the partitioned worker never asked to come back"
    log = (pathlib.Path(tmp_path) / "faulted" / "logs" / "worker-w1.log").read_text()
    assert "fencing myself" in log


def test_a_corrupted_tensor_message_is_caught_by_checksum_and_the_step_redone(tmp_path):
    _, report, events = chaos(tmp_path, "corrupt:slice=1@step=3")
    passed(report)
    [failure] = report["failures"]
    assert failure["path"] == "retry" and failure["workers"] == [] and failure["kind"] == "corrupt"
    assert "checksum" in json.dumps(events)
    assert report["slices_at_end"] == 4


def test_a_straggler_is_reported_and_moved_onto_the_spare(tmp_path):
    _, report, events = chaos(tmp_path, "straggle(factor=30,for=60s):slice=1@step=1", "elastic_spares=1",
                              "elastic_replace_stragglers=true", steps=16)
    passed(report, steps=16)
    [straggler] = report["stragglers"]
    assert straggler["worker"] == "w1" and straggler["action"] == "replaced"
    assert (tmp_path / "faulted" / straggler["stacks"]).read_text().startswith("== w1 on ")   # kept when flagged
    [swap] = kinds(events, "straggler_replaced")
    assert swap["slow"] == "w1" and "w1" not in swap["active"] and len(swap["active"]) == 4


def test_killing_the_spare_costs_the_run_nothing_then_two_slices_lost_at_once_shrink(tmp_path):
    _, report, events = chaos(tmp_path, "kill:role=spare@step=2,kill:slice=0@step=8,kill:slice=3@step=8",
                              "elastic_spares=1", "elastic_relaunch=false")
    passed(report)
    assert report["faults"][0]["workers"] == ["w4"]
    # The spare's death is no failure (dropped at the next boundary); the two slices lost at step 8 shrink.
    assert sorted(w for f in report["failures"] for w in f["workers"]) == ["w0", "w3"]
    assert {f["path"] for f in report["failures"]} == {"shrink"} and report["slices_at_end"] == 2


def test_below_the_minimum_the_run_waits_for_a_relaunched_worker(tmp_path):
    _, report, events = chaos(tmp_path, "kill:slice=1@step=3", "elastic_min_slice_count=4",
                              "elastic_timeout_seconds=120")
    passed(report)
    [wait] = kinds(events, "capacity_wait_ended")
    assert wait["found"] == ["w4"]
    assert [f["path"] for f in report["failures"]] == ["replace"] and report["slices_at_end"] == 4


def test_a_failed_verdict_exits_non_zero_and_says_why(tmp_path):
    proc, _ = run_cli(["chaos", "--scenario", str(ROOT / "chaos/scenarios/no-recovery.yml"), "run_name=faulted"],
                      tmp_path, check=False)
    assert proc.returncode == 1, proc.stderr
    assert "expects the verdict 'fail': got 'fail'" in proc.stdout
    report = json.loads((pathlib.Path(tmp_path) / "faulted" / "report.json").read_text())
    jsonschema.validate(report, SCHEMA)
    assert report["verdict"] == "fail" and not report["finished"]
    assert any("elastic_timeout_seconds" in r for r in report["verdict_reasons"]), report["verdict_reasons"]
    # Another chaos run under the same name starts from nothing: the failed run's log is not continued.
    proc, _ = run_cli(["chaos", "tiny", "steps=8", "elastic_min_slice_count=4", "elastic_timeout_seconds=1",
                       "elastic_relaunch=false", "run_name=faulted", "--faults", "kill@step=2"], tmp_path, check=False)
    assert proc.returncode == 1
    again = json.loads((pathlib.Path(tmp_path) / "faulted" / "report.json").read_text())
    assert again["verdict"] == "fail" and again["failure_reason"].startswith("CapacityExhaustedError: ")
    assert "what to do:" in again["failure_reason"], "the reason says what to do next"
    assert len(again["attempts"]) == 1 and again["steps_requested"] == 8, again["attempts"]
    assert not any("outside any recovery" in r for r in again["verdict_reasons"]), again["verdict_reasons"]


def test_a_fault_that_cannot_fire_in_this_run_is_bad_input(tmp_path):
    proc, _ = run_cli(["chaos", "tiny", "--faults", "kill_save@step=3"], tmp_path, check=False)
    assert proc.returncode == 2 and "writes no checkpoints" in proc.stderr and "enable_checkpointing" in proc.stderr
    proc, _ = run_cli(["chaos", "tiny", "--faults", "kill:slise=1@step=3"], tmp_path, check=False)
    assert proc.returncode == 2 and "slise" in proc.stderr


def test_soak_mode_draws_random_faults_and_stops_at_the_duration(tmp_path):
    proc, _ = run_cli(["chaos", "tiny", "steps=100000", "elastic_spares=1", "run_name=soak", "--mtbf", "4s",
                       "--duration", "7s", "--seed", "3"], tmp_path, check=False)
    report = json.loads((pathlib.Path(tmp_path) / "soak" / "report.json").read_text())
    jsonschema.validate(report, SCHEMA)
    assert report["chaos"]["mtbf_seconds"] == 4 and report["chaos"]["duration_seconds"] == 7
    assert len(report["faults"]) >= 1, "seed 3 draws faults within 7 s (three corrupt messages and a kill)"
    steps = report["steps_completed"]
    assert 0 < steps < 100000 and report["steps_requested"] == steps
    passed(report, steps=steps)
    assert proc.returncode == 0


def test_the_step_watchdog_finds_the_worker_holding_a_step_up_and_replaces_it(tmp_path):
    # w1's grad phase becomes ~2000x slower: the step stalls; the watchdog asks every worker where it is.
    _, report, events = chaos(tmp_path, "straggle(factor=2000,for=120s):slice=1@step=4", "elastic_spares=1",
                              "elastic_replace_stragglers=true", "elastic_step_watchdog_factor=5",
                              "elastic_step_watchdog_min_seconds=1")
    passed(report)
    fired = [e for e in kinds(events, "step_watchdog") if e["suspects"]]
    assert fired and fired[0]["suspects"] == ["w1"] and fired[0]["progress"]["w1"][1] == "grad"
    assert [s["action"] for s in report["stragglers"] if s["worker"] == "w1"] == ["replaced"]
    [failure] = report["failures"]
    assert failure["workers"] == ["w1"] and failure["path"] == "replace" and failure["kind"] == "straggler"
    # Its stacks were kept before it was replaced, linked from the failure: they show where it was stuck.
    [(worker, path)] = failure["stacks"].items()
    stacks = (tmp_path / "faulted" / path).read_text()
    assert worker == "w1" and path == f"stacks/w1-{fired[0]['step']}.txt"
    assert stacks.startswith("== w1 on ") and "in straggle\n" in stacks and "time.sleep(" in stacks


def test_a_fault_that_cannot_fire_is_refused_and_one_that_did_not_fire_fails_the_verdict(tmp_path):
    proc, _ = run_cli(["chaos", "tiny", "steps=4", "run_name=never", "--faults", "kill@step=500"], tmp_path,
                      check=False)
    assert proc.returncode == 2 and "step=500 is never reached" in proc.stderr
    assert not (pathlib.Path(tmp_path) / "never").exists(), "nothing may start for a fault that can never fire"
    proc, report, events = chaos(tmp_path, "kill@time=10m", check=False, steps=4)   # no duration: known at the end
    assert proc.returncode == 1 and report["verdict"] == "fail" and report["steps_completed"] == 4
    [fault] = report["faults"]
    assert fault["spec"] == "kill@time=600s" and fault["injected_at"] is None
    assert fault["skipped"].startswith("never fired: the run ended") and "before time=600s" in fault["skipped"]
    assert report["verdict_reasons"] == [f"fault 'kill@time=600s' was not injected ({fault['skipped']}), "
                                         "so the run was not tested against it."]
