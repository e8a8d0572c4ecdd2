"""The controller's side of persistent checkpoints (runtime.control.checkpointing), over the fake worker group
(``tests/support/fake_group.py``: its workers' checkpoints and saves in flight, in memory) and a real local
checkpoint store."""

import dataclasses

import numpy as np
import pytest

from runtime.state.checkpoint import CheckpointStore
from runtime.control.checkpointing import Checkpointing
from runtime.control.run_state import RunLedger, RunState
from runtime.state.state_copy import state_digest
from tests.support.fake_group import STATE_BYTES, FakeGroup, loss_sum


@dataclasses.dataclass(frozen=True)
class Opts:
    checkpoint_directory: str = ""
    checkpoint_period: int = 4
    rpc_timeout_seconds: float = 5.0
    pipeline_stages: int = 1
    snapshot_interval: int = 0


class Events:
    def __init__(self):
        self.log, self._folds = [], []

    def emit(self, kind, **fields):
        self.log.append((kind, fields))
        for fold in self._folds:
            fold({"kind": kind, **fields})

    def subscribe(self, fold):
        self._folds.append(fold)

    def kinds(self):
        return [k for k, _ in self.log]


def checkpointing(group, opts, events, notify=None):
    """The controller's Checkpointing over ``events``, its ledger folding them (a run of ``opts``' stages)."""
    return Checkpointing(group, opts, events, RunLedger(events, RunState(pipeline_stages=opts.pipeline_stages)),
                         notify=notify)


def fake_group(stages=None):
    """The fake worker group; ``stages``: the pipeline stage each worker loaded."""
    group = FakeGroup(Opts(), Events())
    if stages:
        group.load(list(stages), stages=stages)
    return group


def loads(group):
    """The checkpoint loads the group was asked for: ``(workers, directory, step)``."""
    return [c[1:4] for c in group.calls if c[0] == "load_checkpoints"]


def flushes(group):
    """The group's ``flush_checkpoints`` calls: ``(workers, save)``."""
    return [c[1:] for c in group.calls if c[0] == "flush_checkpoints"]


def test_the_writer_rotates_and_the_order_carries_the_committed_loss_sums():
    ck = checkpointing(fake_group(), Opts(checkpoint_directory="/ck"), Events())
    assert ck.order_for(2, 10, (("a", "b"),), [1.0]) == {}
    assert ck.order_for(3, 10, (("a", "b"),), [1.0, 2.0]) == {"b": ("/ck", [1.0, 2.0])}
    assert ck.order_for(7, 10, (("a", "b"),), []) == {"a": ("/ck", [])}
    assert set(ck.order_for(9, 10, (("a", "b"),), [])) <= {"a", "b"}   # the last step is always saved
    assert ck.next_writer(4, 10, (("a", "b"),)) == "a" and ck.next_writer(10, 10, (("a", "b"),)) is None
    off = checkpointing(fake_group(), Opts(), Events())
    assert off.order_for(3, 10, (("a",),), []) == {} and off.next_writer(0, 10, (("a",),)) is None


def test_saved_checkpoints_become_events_and_reach_the_observer():
    seen, events = [], Events()
    ck = checkpointing(fake_group(), Opts(checkpoint_directory="/ck"), events, notify=seen.append)
    ck.note({"a": ([4, 8], ""), "b": ([], "disk full")})
    assert seen == [4, 8]
    assert events.kinds() == ["checkpoint_saved", "checkpoint_saved", "checkpoint_failed"]


def test_workers_that_skipped_a_corrupt_checkpoint_all_load_the_same_older_one():
    events, group = Events(), fake_group()
    for step in (4, 8):
        group.checkpoint("a", "/ck", step)
    group.checkpoint("b", "/ck", 4)
    group.checkpoint("b", "/ck", 8, spoiled=True)   # b's 8 does not read back (a lost write, say)
    loaded = checkpointing(group, Opts(checkpoint_directory="/ck"), events).load(["a", "b"], 8)
    assert loaded.step == 4 and loaded.bytes == {"a": STATE_BYTES, "b": STATE_BYTES}
    assert loaded.loss_sums == [loss_sum(s) for s in range(4)] and loaded.written_on is None
    assert group.hashes(["a", "b"])["a"] == group.hashes(["a", "b"])["b"]   # both hold step 4's state
    resharded = fake_group()
    resharded.checkpoint("a", "/ck", 4, written_on=(2, 4))   # the same model, written on another mesh
    assert checkpointing(resharded, Opts(checkpoint_directory="/ck"), events).load(["a"], 4).written_on == (2, 4)
    assert loads(group) == [(("a", "b"), "/ck", 8), (("a", "b"), "/ck", 4)]
    assert [f["worker"] for k, f in events.log if k == "checkpoint_skipped"] == ["b"]


def test_newest_lists_complete_checkpoints_and_an_unreadable_store_is_none(tmp_path):
    directory = str(tmp_path / "ck")
    store = CheckpointStore(directory, async_save=False)
    leaves = [np.arange(4, dtype=np.float32)]
    for step in (4, 8, 12):
        store.save(step, leaves, digest=state_digest(leaves))
    events = Events()
    ck = checkpointing(fake_group(), Opts(checkpoint_directory=directory), events)
    assert ck.newest(12) == 12 and ck.newest(11) == 8 and ck.newest(3) is None
    assert checkpointing(fake_group(), Opts(checkpoint_directory=str(tmp_path / "none")), events).newest(9) is None
    assert checkpointing(fake_group(), Opts(), events).newest(9) is None and events.log == []


def test_finish_removes_the_leftovers_of_cut_saves_only_when_nobody_writes(tmp_path):
    directory = tmp_path / "ck"
    leaves = [np.arange(4, dtype=np.float32)]
    CheckpointStore(str(directory), async_save=False).save(4, leaves, digest=state_digest(leaves))
    (directory / "8.orbax-checkpoint-tmp").mkdir()   # what a writer killed mid-save leaves
    busy, events = fake_group(), Events()
    busy.writing("b", str(directory), 8, rounds=None)   # b writes on past the deadline
    checkpointing(busy, Opts(checkpoint_directory=str(directory), rpc_timeout_seconds=0.2),
                  events).finish([("a", "b")], [0.5] * 8)
    assert (directory / "8.orbax-checkpoint-tmp").exists()   # b may be writing it
    assert [f["error"] for k, f in events.log if k == "checkpoint_failed"] == ["still writing after 0.2 s"]
    idle = fake_group()
    idle.writing("a", str(directory), 8)
    checkpointing(idle, Opts(checkpoint_directory=str(directory)), events).finish([("a", "b")], [0.5] * 8)
    assert not (directory / "8.orbax-checkpoint-tmp").exists() and (directory / "4").exists()
    removed = [f for k, f in events.log if k == "checkpoint_leftovers_removed"]
    assert len(removed) == 1 and removed[0]["paths"][0].endswith("8.orbax-checkpoint-tmp")
    failed = fake_group()
    failed.writing("a", str(directory), 12, error="disk full")
    (directory / "12.orbax-checkpoint-tmp").mkdir()
    checkpointing(failed, Opts(checkpoint_directory=str(directory)), events).finish([("a",)], [0.5] * 8)
    assert (directory / "12.orbax-checkpoint-tmp").exists()   # kept for whoever looks into the failure


def test_finish_reports_each_save_as_it_completes_while_the_next_is_written(tmp_path):
    """The end of a run waits for the saves in flight in rounds: the observer hears of checkpoint 4 while 8 is
    still being written (so a fault waiting for checkpoint 4 can still cut 8 off)."""
    seen, rounds = [], []
    group = fake_group()
    group.writing("a", str(tmp_path), 4)             # done in the first round
    group.writing("a", str(tmp_path), 8, rounds=2)   # then in the third
    group.writing("b", str(tmp_path), 6)

    def notify(step):
        seen.append(step)
        rounds.append(len(flushes(group)))

    ck = checkpointing(group, Opts(checkpoint_directory=str(tmp_path)), Events(), notify=notify)
    ck.finish([("a", "b")], [0.5] * 8)
    assert sorted(seen) == [4, 6, 8] and rounds[seen.index(4)] == 1 and rounds[seen.index(8)] == 3
    assert [workers for workers, _ in flushes(group)] == [("a", "b"), ("a",), ("a",)]   # the idle not asked again


def test_a_last_checkpoint_cut_off_with_its_writer_is_saved_again_by_a_survivor(tmp_path):
    group = fake_group()
    group.hold("a", 12)
    ck = checkpointing(group, Opts(checkpoint_directory=str(tmp_path), checkpoint_period=4), Events())
    for step in range(12):   # checkpoints of 4 (b), 8 (a), 12 (b: the last)
        ck.order_for(step, 12, (("a", "b"),), [])
    ck.note({"a": ([8], "")})
    ck.finish([("a",)], [0.5] * 12)   # b died writing 12: a saves its state (step 12) first, then reports it
    (flush,) = flushes(group)
    assert flush == (("a",), {"a": (str(tmp_path), [0.5] * 12)}) and ck.unfinished_writer(("a",)) is None
    assert 12 in group.checkpoints["a", str(tmp_path)]   # a's state, saved
    again = fake_group()
    checkpointing(again, Opts(checkpoint_directory=str(tmp_path)), Events()).finish([("a",)], [0.5] * 12)
    assert flushes(again) == [(("a",), {})]   # nothing was cut off: no save asked


def test_the_unfinished_writer_is_the_newest_order_not_reported_complete():
    ck = checkpointing(fake_group(), Opts(checkpoint_directory="/ck", checkpoint_period=2), Events())
    for step in range(10):   # checkpoints of 2 (b), 4 (a), 6 (b), 8 (a), 10 (b)
        ck.order_for(step, 10, (("a", "b"),), [])
    assert ck.unfinished_writer(("a", "b")) == "b" and ck.unfinished_writer(("a",)) == "a"
    ck.note({"b": ([10], "")})   # b's newest: its older orders (2, 6) are done or were replaced
    assert ck.unfinished_writer(("a", "b")) == "a"
    ck.note({"a": ([8], "")})
    assert ck.unfinished_writer(("a", "b")) is None


def test_each_pipeline_stage_writes_and_loads_its_own_checkpoints(tmp_path):
    """2 stages x 2 replicas (a, b: stage 0; c, d: stage 1): a writer per stage, each into its stage's directory;
    a step is checkpointed once every stage holds it; each worker loads its stage's."""
    group = fake_group(stages={"a": 0, "b": 0, "c": 1, "d": 1})
    group.checkpoint("a", f"{tmp_path}/stage0", 4, [0.0] * 4)   # stage 0 computes no loss: its sums are 0
    group.checkpoint("c", f"{tmp_path}/stage1", 4, [0.5] * 4)
    ck = checkpointing(group, Opts(checkpoint_directory=str(tmp_path), pipeline_stages=2), Events())
    assert ck.order_for(3, 10, (("a", "b"), ("c", "d")), [1.0]) == {"b": (f"{tmp_path}/stage0", [1.0]),
                                                                 "d": (f"{tmp_path}/stage1", [1.0])}
    leaves = [np.arange(4, dtype=np.float32)]
    for stage, steps in ((0, (4, 8)), (1, (4,))):
        for step in steps:
            CheckpointStore(f"{tmp_path}/stage{stage}", async_save=False).save(step, leaves, digest=state_digest(leaves))
    assert ck.newest(10) == 4   # stage 1 holds no 8
    loaded = ck.load(["a", "c"], 4)
    assert loaded.step == 4 and loads(group) == [(("a",), f"{tmp_path}/stage0", 4), (("c",), f"{tmp_path}/stage1", 4)]
    assert loaded.loss_sums == [0.5] * 4   # the last stage's
    seen = []
    ck.notify = seen.append
    ck.note({"b": ([4], "")})
    assert seen == []   # stage 1's checkpoint of step 4 is not reported yet: step 4 is not checkpointed
    ck.note({"d": ([4], ""), "b": ([4], "")})
    assert seen == [4]
    assert [f["directory"] for k, f in ck.events.log if k == "checkpoint_saved"] == [f"{tmp_path}/stage{k}"
                                                                                   for k in (0, 1, 0)]


def test_the_programs_fingerprint_ignores_source_locations_and_names_but_not_the_math():
    """A checkpoint resumes after the code around the model changed (lines moved, the step renamed, traced
    under a deeper call stack); another model's does not (the worker refuses it as written by other programs).
    What older checkpoints recorded is still computed the old way."""
    import jax
    import jax.numpy as jnp

    from runtime.core.fingerprint import legacy_programs_fingerprint, programs_fingerprint

    code = "\n\n\ndef step(x):\n    return jnp.sin(x) * 2\n\n\ndef other(x):\n    return jnp.cos(x) * 2\n"
    ns = {"jnp": jnp}
    exec(compile(code, "moved.py", "exec"), ns)

    def step(x):
        return jnp.sin(x) * 2

    def programs(fn, depth=0):
        def traced(x, d=depth):
            return traced(x, d - 1) if d else fn(x)
        blob = jax.export.export(jax.jit(traced), platforms=["cpu"])(jnp.ones(3)).serialize()
        return {"grad": blob}

    assert programs(step)["grad"] != programs(ns["step"])["grad"]   # the locations differ
    assert programs_fingerprint(programs(step)) == programs_fingerprint(programs(ns["step"]))
    assert programs_fingerprint(programs(step)) == programs_fingerprint(programs(step, depth=5))
    assert programs_fingerprint(programs(step)) != programs_fingerprint(programs(ns["other"]))
    assert legacy_programs_fingerprint(programs(step)) == legacy_programs_fingerprint(programs(ns["step"]))
    assert legacy_programs_fingerprint(programs(step)) != legacy_programs_fingerprint(programs(ns["other"]))


def test_load_full_state_path_of_a_pipelined_run_is_its_stages_newest_common_step_and_must_fit_the_run(tmp_path):
    from runtime.core.errors import BadInputError
    from runtime.control.checkpointing import locate_checkpoint, newest_checkpoint, stage_steps

    leaves = [np.arange(4, dtype=np.float32)]
    for stage, steps in ((0, (2, 4)), (1, (2, 4, 6))):
        for step in steps:
            CheckpointStore(f"{tmp_path}/run/stage{stage}", async_save=False).save(step, leaves,
                                                                                   digest=state_digest(leaves))
    run = str(tmp_path / "run")
    assert stage_steps(run) == [[2, 4], [2, 4, 6]] and locate_checkpoint(run) == (run, 4)
    assert newest_checkpoint(run, 3) == 2
    two = checkpointing(fake_group(), Opts(checkpoint_directory=str(tmp_path / "own"), pipeline_stages=2), Events())
    assert two.locate(run) == (run, 4)
    three = checkpointing(fake_group(), Opts(checkpoint_directory=str(tmp_path / "own"), pipeline_stages=3), Events())
    with pytest.raises(BadInputError, match="holds checkpoints of 2 pipeline stages, and this run has 3 pipeline "
                                            r"stages \(dcn_pipeline_parallelism=3\)"):
        three.locate(run)
    plain = checkpointing(fake_group(), Opts(checkpoint_directory=str(tmp_path / "own")), Events())
    with pytest.raises(BadInputError, match="holds checkpoints of 2 pipeline stages, and this run has no pipeline"):
        plain.locate(run)
    CheckpointStore(f"{tmp_path}/flat", async_save=False).save(2, leaves, digest=state_digest(leaves))
    with pytest.raises(BadInputError, match="holds an unpipelined run's checkpoints, and this run has 2 pipeline"):
        two.locate(str(tmp_path / "flat"))
