"""Client faults (``kill:client``, ``hang(resume=S):client``): the grammar, the rules that refuse what can never
fire, the injector's side (what a restarted client's injector fires, the order, what it never fires) and the
supervisor's decisions, pure where they can be; real signals only to small stand-in processes (no JAX, no
workers: tests/chaos/test_client_faults.py runs the real thing)."""

import json
import multiprocessing
import os
import pathlib
import pickle
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from chaos import Fault, FaultSpecError, Target, When, parse_faults, validate
from chaos.injector import ClientSide, FaultInjector, backstop_seconds, outlasts_lease
from chaos.promise import promises
from chaos.reach import RunShape, check_reachable
from chaos.supervisor import (SUPERSEDED_EXIT, ClientEnd, _Supervision, _Tail, after_exit, job_blob,
                              supervision_reasons, takeover_due, wake_due)
from tests.conftest import ROOT
from tests.support.fake_controller import timed_controller

SIDE = ClientSide(steps=10, lease_seconds=5.0, grace_seconds=20.0)


# --------------------------------------------------------------------------- the grammar


@pytest.mark.parametrize("text", ["kill:client@step=20", "hang(resume=8s):client@step=10", "kill:client@transfer",
                                  "hang(resume=1.5s):client@time=3s", "kill:client@checkpoint=4",
                                  "kill:client@snapshot=2", "hang(resume=2s):client@transfer"])
def test_client_faults_read_back_as_themselves(text):
    [fault] = parse_faults(text)
    assert fault.target == Target("client") and fault.hits_client and fault.spec() == text
    validate([fault])
    assert not parse_faults("kill:slice=1@step=3")[0].hits_client


@pytest.mark.parametrize("text, message", [
    ("kill:client,x=0", "a comma separates faults, so 'x=0' was read as another fault"),
    ("kill:client,replica=0", "replica=R is only valid right after a stage=K target (e.g. "
                              "kill:stage=1,replica=0@step=3), not after 'client'"),
    ("kill:client=0@step=3", "target 'client' takes no value, got 'client=0'"),
    ("hang:client@step=3", "hang:client needs resume=DURATION"),
    ("hang:client(resume=8s)@step=10", "options go right after the kind, before ':TARGET': hang(resume=8s):client"),
    ("hang(seconds=8):client@step=10", "unknown option 'seconds' for hang (options: resume) (how long a hang lasts "
                                       "is resume=DURATION)"),
    ("kill(phase=grad):client@step=3", "kill:client takes no options"),
    ("straggle:client@step=3", "only kill and hang hit the client"),
    ("kill_save:client@step=3", "only kill and hang hit the client"),
    ("corrupt:client@transfer", "only kill and hang hit the client"),
])
def test_a_bad_client_fault_gets_one_line_naming_it(text, message):
    with pytest.raises(FaultSpecError) as info:
        parse_faults(text)
    assert message in str(info.value) and "\n" not in str(info.value)
    assert str(info.value).startswith("fault 1 ")


def test_hand_built_client_faults_are_checked_like_written_ones():
    for bad, why in [(Fault("kill", Target("client", 0), When(step=1)), "takes no value"),
                     (Fault("hang", Target("client"), When(step=1)), "needs resume"),
                     (Fault("partition", Target("client"), When(step=1)), "only kill and hang")]:
        with pytest.raises(FaultSpecError, match=why):
            validate([bad])


# --------------------------------------------------------------------------- faults that can never fire

SHAPE = RunShape(steps=40, slices=2, spares=0)


@pytest.mark.parametrize("text, shape, message", [
    ("kill:client@step=3", RunShape(steps=40, slices=2, spares=0, client_grace_seconds=0.0),
     "elastic_client_grace_seconds=0 sends them home"),
    ("kill:client@step=3", RunShape(steps=40, slices=2, spares=0, random_faults=True, duration_seconds=60.0),
     "does not run in soak mode"),
    ("kill:client@step=0", SHAPE, "strikes before the run has a state"),
    ("kill:client@checkpoint=37", RunShape(steps=40, slices=2, spares=0, checkpoints=True, checkpoint_period=4),
     "the first checkpoint of step 37 or later is the run's last (step 40)"),
    ("hang(resume=4.5s):client@step=3", SHAPE, "use at most 4s (the client goes on) or more than 5s"),
    ("hang(resume=5s):client@step=3", SHAPE, "too close to the workers' lease"),
    ("kill:client@step=3,kill:client@transfer", SHAPE, "no other fault in the list can lose one"),
])
def test_client_faults_that_cannot_work_in_this_run_are_refused_up_front(text, shape, message):
    with pytest.raises(FaultSpecError, match="^fault [12] ") as info:
        check_reachable(parse_faults(text), shape)
    assert message in str(info.value)


def test_client_faults_that_can_work_pass():
    check_reachable(parse_faults("kill:client@step=1,hang(resume=3.9s):client@step=2,hang(resume=5.1s):client@step=3,"
                                 "kill:slice=1@step=5,kill:client@transfer,kill:client@checkpoint=36"),
                    RunShape(steps=40, slices=2, spares=1, checkpoints=True, checkpoint_period=4))


def test_the_harness_plan_refuses_them_with_the_config_keys():
    from chaos.harness import ChaosOptions, fault_plan
    from elastic import load_config

    with pytest.raises(FaultSpecError, match="elastic_client_grace_seconds=0"):
        fault_plan(load_config("tiny", ["elastic_client_grace_seconds=0"]),
                   ChaosOptions(faults=tuple(parse_faults("kill:client@step=3"))))
    with pytest.raises(FaultSpecError, match=r"elastic_worker_lease_seconds=2s"):
        fault_plan(load_config("tiny", ["elastic_worker_lease_seconds=2"]),
                   ChaosOptions(faults=tuple(parse_faults("hang(resume=1.5s):client@step=3"))))


def test_a_job_its_clients_cannot_get_is_bad_input():
    import threading

    class Job:
        lock = None

    job = Job()
    job.lock = threading.Lock()
    with pytest.raises(FaultSpecError, match="this job cannot be pickled with cloudpickle .*lock"):
        job_blob(job)


# --------------------------------------------------------------------------- the supervisor's decisions


def test_a_client_killed_by_its_fault_is_restarted_once_per_kill_and_nothing_else_is():
    kill = -signal.SIGKILL
    assert after_exit(kill, kills_fired=1, kills_restarted=0) == "restart"
    assert after_exit(kill, kills_fired=1, kills_restarted=1) == "died"   # a SIGKILL no fault accounts for
    assert after_exit(-signal.SIGSEGV, kills_fired=1, kills_restarted=0) == "died"
    assert after_exit(0, 0, 0) == "finished" and after_exit(1, 0, 0) == "error"
    assert after_exit(SUPERSEDED_EXIT, 0, 0) == "died" and after_exit(None, 0, 0) == "died"


def test_a_stopped_client_is_taken_over_only_when_its_hang_outlasts_the_lease_and_it_did():
    assert outlasts_lease(5.1, 5.0) and not outlasts_lease(5.0, 5.0)
    assert takeover_due(8.0, 5.0, stopped_for=5.2)
    assert not takeover_due(8.0, 5.0, stopped_for=4.9)    # not yet: the workers have not fenced themselves
    assert not takeover_due(8.0, 5.0, stopped_for=None)   # not seen stopped
    assert not takeover_due(3.0, 5.0, stopped_for=60.0)   # within the lease: it wakes by itself
    assert not takeover_due(None, 5.0, stopped_for=60.0)  # stopped by nobody's fault (a debugger): left alone


def test_a_stale_client_wakes_once_its_time_passed_and_the_new_one_attached():
    assert wake_due(now=108.0, stopped_at=100.0, hang_seconds=8.0, attached=True)
    assert not wake_due(now=107.9, stopped_at=100.0, hang_seconds=8.0, attached=True)
    assert not wake_due(now=200.0, stopped_at=100.0, hang_seconds=8.0, attached=False)   # never a race
    # Should no supervisor wake it, it wakes by itself once it can race no new client (its workers are gone).
    assert backstop_seconds(8.0, SIDE) == 8.0 + 5.0 + 20.0 + 30.0


def test_what_the_supervisor_saw_fails_the_verdict_when_a_client_was_not_refused_or_died_unaccounted_for():
    specs = ["hang(resume=8s):client@step=10", "kill:client@step=20"]
    fine = [ClientEnd(0, 11, "killed", -9, 1, ""), ClientEnd(1, 12, "superseded", 3, 0, ""),
            ClientEnd(2, 13, "finished", 0, None, "")]
    assert supervision_reasons(fine, specs) == []
    [woke] = supervision_reasons([ClientEnd(1, 12, "stale", 0, 0, "it finished")], specs)
    assert "woke and exited with status 0 instead of being refused" in woke and specs[0] in woke
    [killed] = supervision_reasons([ClientEnd(1, 12, "stale", -9, 0, "did not exit")], specs)
    assert "exited with signal SIGKILL instead of being refused" in killed
    [died] = supervision_reasons([ClientEnd(0, 11, "died", -9, None, "")], specs)
    assert "died (signal SIGKILL) and no client fault accounts for it" in died


# --------------------------------------------------------------------------- the injector


def _kinds(ctl, *kinds):
    return [e for e in ctl.events.emitted if e["kind"] in kinds]


def test_a_restarted_clients_injector_fires_only_what_the_log_does_not_record_as_fired():
    faults = parse_faults("kill:client@step=4,kill:slice=1@step=2,straggle:slice=0@step=6,kill:slice=0@checkpoint=8")
    history = [{"kind": "chaos_started", "t": time.time() - 30.0},
               *({"kind": "step_committed", "step": s} for s in range(5)),
               {"kind": "fault_injected", "index": 1, "fault": faults[1].spec()},
               {"kind": "fault_injected", "index": 0, "fault": faults[0].spec()},
               {"kind": "checkpoint_saved", "step": 4}]
    ctl = timed_controller()
    injector = FaultInjector(faults, info={"spec": "x"}, history=history, supervised=SIDE)
    assert injector.fired == {0, 1} and injector.committed == 5 and injector.checkpointed == 4
    injector.attach(ctl)
    try:
        assert not _kinds(ctl, "chaos_started")   # the first client's, once
        assert time.monotonic() - injector.t0 >= 29.0   # @time counts from the first client's start
        injector.step_committed(4)   # the re-attach commits what every survivor applied
        assert _kinds(ctl, "fault_injected") == []      # nothing fired again (kill:client@step=4 is in the log)
        injector.step_committed(5)
        [straggle] = _kinds(ctl, "fault_injected")      # ...and a step trigger still fires at its step
        assert straggle["index"] == 2 and straggle["step"] == 6
    finally:
        injector.close()
    [skipped] = _kinds(ctl, "fault_skipped")
    assert skipped["index"] == 3 and "step 4" in skipped["reason"]


def test_faults_due_with_a_client_fault_fire_first_and_a_client_fault_waits_for_a_committed_step():
    faults = parse_faults("kill:client@step=0,kill:client@step=3,kill:slice=1@step=3,corrupt:slice=0@step=3")
    ctl = timed_controller()
    injector = FaultInjector(faults, supervised=SIDE)
    struck = []
    injector._strike_client = lambda index, fault: struck.append((index, [e["index"] for e in
                                                                         _kinds(ctl, "fault_injected")]))
    injector.attach(ctl)   # kill:client@step=0 is due, but there is no state to keep yet
    assert struck == [] and injector.fired == set()
    try:
        injector.step_committed(0)   # the first commit: now it strikes
        assert struck == [(0, [])]
        injector.step_committed(1)
        injector.step_committed(2)
        assert struck == [(0, []), (1, [2, 3])]   # the worker faults of step 3 went first
    finally:
        injector.close()


def test_a_client_fault_never_strikes_once_every_step_is_committed_nor_without_a_supervisor():
    ctl = timed_controller()
    injector = FaultInjector(parse_faults("kill:client@time=0s"), supervised=ClientSide(2, 5.0, 20.0))
    injector._strike_client = lambda index, fault: pytest.fail("struck after the last commit")
    injector.attach(ctl)
    injector.step_committed(0)
    injector.step_committed(1)
    time.sleep(0.15)   # the clock ticks past time=0s
    injector.close()
    [skipped] = _kinds(ctl, "fault_skipped")
    assert "came due with every step committed" in skipped["reason"]

    ctl = timed_controller()
    alone = FaultInjector(parse_faults("kill:client@step=1"))   # no supervisor: it would kill this process
    alone.attach(ctl)
    alone.step_committed(0)
    alone.close()
    [skipped] = _kinds(ctl, "fault_skipped")
    assert "needs the chaos supervisor" in skipped["reason"] and not _kinds(ctl, "fault_injected")


STRIKE = textwrap.dedent("""
    import json, sys, time
    sys.path.insert(0, {root!r})
    from chaos import parse_faults
    from chaos.injector import ClientSide, FaultInjector
    from tests.support.fake_controller import timed_controller
    ctl = timed_controller()
    injector = FaultInjector(parse_faults({spec!r}), supervised=ClientSide(10, {lease}, 20.0))
    injector.attach(ctl)
    t0 = time.monotonic()
    injector.step_committed(0)
    injector.step_committed(1)
    print(json.dumps({{"stopped": time.monotonic() - t0, "fired": sorted(injector.fired),
                      "events": [e["kind"] for e in ctl.events.emitted]}}), flush=True)
""")


def _strike(spec, lease=5.0):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.Popen([sys.executable, "-c", STRIKE.format(root=str(ROOT), spec=spec, lease=lease)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _state(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0]


def _wait_stopped(proc):
    deadline = time.monotonic() + 30
    while _state(proc.pid) not in "Tt":
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.02)


def test_kill_client_records_the_fault_then_sigkills_its_own_process():
    proc = _strike("kill:client@step=1")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, err
    assert out == ""   # it died inside the hook


def test_a_client_hang_within_the_lease_stops_it_for_resume_seconds_and_it_goes_on():
    proc = _strike("hang(resume=0.6s):client@step=1,kill:slice=0@step=2", lease=5.0)
    _wait_stopped(proc)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    result = json.loads(out)
    assert result["stopped"] >= 0.6 and result["fired"] == [0, 1]
    assert result["events"] == ["fault_injected", "fault_injected"]   # and it went on firing


def test_a_client_hang_outlasting_the_lease_waits_for_the_supervisor_and_fires_nothing_after_it_woke():
    proc = _strike("hang(resume=0.3s):client@step=1,kill:slice=0@step=2", lease=0.1)
    _wait_stopped(proc)
    time.sleep(0.8)   # past resume: nobody but the supervisor (here the test) wakes it
    assert _state(proc.pid) in "Tt"
    os.kill(proc.pid, signal.SIGCONT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    result = json.loads(out)
    assert result["events"] == ["fault_injected"] and result["fired"] == [0, 1]   # the run is the new client's


# --------------------------------------------------------------------------- the verdict's promises


def test_a_re_attached_client_goes_on_with_the_open_recovery_of_the_one_that_died():
    cfg = {"elastic_dispatch_depth": 2}
    start = [{"kind": "job_started"}, {"kind": "run_started"},
             {"kind": "placement", "active": ["w0", "w1"], "spares": ["w2"]}, {"kind": "state_initialized"},
             *({"kind": "step_committed", "step": s} for s in range(6))]
    died = [{"kind": "failure_detected", "committed": 6}, {"kind": "worker_dead", "worker": "w1"},
            {"kind": "recovery_decision", "action": "replace", "active": ["w0", "w2"], "spares": []}]
    again = [{"kind": "job_started"}, {"kind": "programs_built"}, {"kind": "worker_dead", "worker": "w2"},
             {"kind": "client_attached", "workers": {}, "steps": 10, "generation": 1},
             {"kind": "failure_detected", "committed": 6},
             {"kind": "recovery_decision", "action": "shrink", "active": ["w0"], "spares": []},
             {"kind": "recovered"}, *({"kind": "step_committed", "step": s} for s in range(6, 10))]
    [one] = promises(start + died + again, cfg)
    assert one.failures == (0, 1) and one.kind == "replica" and one.left["replicas"] == ["w0"] and one.kept
    # A step the dead client committed, committed again after the re-attach, is recomputed: the promise breaks.
    [broken] = promises(start + died + again + [{"kind": "step_committed", "step": 5}], cfg)
    assert broken.recomputed == 1 and not broken.kept and "recomputed" in broken.reason


# --------------------------------------------------------------------------- the supervisor's loop


def test_the_log_is_followed_across_the_copy_a_new_client_replaces_it_with(tmp_path):
    log = tmp_path / "events.jsonl"
    log.write_text(json.dumps({"kind": "a"}) + "\n" + '{"kind": "b"')   # the second line is being written
    tail = _Tail(log)
    assert [e["kind"] for e in tail.read()] == ["a"]
    copy = tmp_path / "copy"
    copy.write_text(log.read_text() + "}\n" + json.dumps({"kind": "c"}) + "\n")
    os.replace(copy, log)   # a client taking the run over copies the log to a new file
    assert [e["kind"] for e in tail.read()] == ["b", "c"] and tail.read() == []


def _append(run_dir, **event):
    with open(pathlib.Path(run_dir) / "events.jsonl", "a") as f:
        f.write(json.dumps({"t": time.time(), **event}) + "\n")


def stand_in(blob, faults, seed, info, run_dir, number, out, side):
    """A client of the supervisor's loop tests (no JAX, no workers): what ``blob`` says, by client number."""
    plan = pickle.loads(blob)[number]
    run_dir = pathlib.Path(run_dir)
    if plan == "kill":       # its kill:client fault, recorded, then SIGKILL
        _append(run_dir, kind="fault_injected", index=0, fault=faults[0].spec())
        os.kill(os.getpid(), signal.SIGKILL)
    if plan == "die":        # killed by nobody's fault
        os.kill(os.getpid(), signal.SIGKILL)
    if plan == "raise":
        pathlib.Path(out).write_bytes(pickle.dumps({"state": None, "error": ValueError("bad config")}))
        os._exit(1)
    if plan == "hang":       # stopped by its hang fault, woken by the supervisor once another attached: refused
        _append(run_dir, kind="fault_injected", index=0, fault=faults[0].spec())
        os.kill(os.getpid(), signal.SIGSTOP)
        (run_dir / "woke").touch()
        os._exit(SUPERSEDED_EXIT)
    if plan == "take over":  # attaches, and finishes once the stale one woke
        _append(run_dir, kind="client_attached")
        deadline = time.monotonic() + 30
        while not (run_dir / "woke").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
    _append(run_dir, kind="step_committed", step=number, loss=0.5)
    pathlib.Path(out).write_bytes(pickle.dumps({"state": f"state of client {number}", "error": None}))
    os._exit(0)


def _supervise(tmp_path, plans, faults, side=SIDE):
    tmp_path.mkdir(exist_ok=True)
    steps = []
    run = _Supervision(multiprocessing.get_context("spawn"), pickle.dumps(plans), parse_faults(faults), 0, {},
                       tmp_path, side, tmp_path, lambda step, loss: steps.append(step), target=stand_in)
    try:
        state, ends = run.run()
    finally:
        run.kill_all()
    return state, [(e.number, e.how, e.status, e.fault) for e in ends], steps


def test_the_supervisor_restarts_a_client_its_kill_fault_killed_and_takes_the_last_ones_state(tmp_path, capfd):
    state, ends, steps = _supervise(tmp_path, ["kill", "finish"], "kill:client@step=3")
    assert state == "state of client 1" and steps == [1]
    assert ends == [(0, "killed", -signal.SIGKILL, 0), (1, "finished", 0, None)]
    assert "fault 'kill:client@step=3' killed client 0" in capfd.readouterr().err


def test_a_client_that_dies_unaccounted_for_ends_the_run_and_one_that_raises_passes_the_error_on(tmp_path):
    state, ends, _ = _supervise(tmp_path / "a", ["die"], "kill:client@step=3")
    assert state is None and ends == [(0, "died", -signal.SIGKILL, None)]
    with pytest.raises(ValueError, match="bad config"):
        _supervise(tmp_path / "b", ["raise"], "kill:client@step=3")


def test_a_client_stopped_past_the_lease_is_taken_over_then_woken_and_refused(tmp_path, capfd):
    side = ClientSide(steps=10, lease_seconds=0.3, grace_seconds=20.0)
    state, ends, _ = _supervise(tmp_path, ["hang", "take over"], "hang(resume=0.5s):client@step=3", side)
    assert state == "state of client 1"
    assert ends == [(1, "finished", 0, None), (0, "superseded", SUPERSEDED_EXIT, 0)]
    err = capfd.readouterr().err
    assert "for longer than the workers' lease (0.3 s): starting a new client" in err
    assert "woke, was refused by every worker and exited with status 3 (superseded)" in err
