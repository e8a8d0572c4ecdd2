"""The plans of every membership change, table-tested: plan_recovery from a RunState and one Survey, plan_start,
plan_grow, plan_swap (the rules inside: test_policy.py, test_tiers.py)."""

import dataclasses

import pytest

from runtime.control.calls import WorkerStatus
from runtime.control.controller_options import ControllerOptions
from runtime.control.plan import (Action, Copy, Failure, Restore, Survey, Wait, plan_grow, plan_recovery, plan_start,
                                  plan_swap)
from runtime.control.placement import Placement, WorkerInfo
from runtime.control.run_state import RunState, Series
from runtime.control.tiers import Holding

P = Placement(epoch=3, active=("a", "b"), spares=("s",))
LIMITS = {"slices": 2, "min_slices": 1, "max_retries": 5, "recoveries": 1, "committed": 7}


def plan(*, placement=P, dead=frozenset(), replicas=frozenset(), recoveries=1, committed=7, slices=2, min_slices=1,
         max_retries=5, may_wait=False, stages=1, now=0.0, statuses=None, applied=None, relaunch=True, **survey):
    """plan_recovery over a RunState of ``placement`` (``committed`` steps, ``dead``, ``replicas``), a Survey in
    which every live member answered it applied ``applied`` (default: ``committed``) steps, and options; the
    placement grid has ``stages`` rows."""
    placement = dataclasses.replace(placement, stages=stages)
    state = RunState(placement=placement, losses=Series([1.0] * committed), dead={w: "lost" for w in dead},
                     recoveries=recoveries, replicas=frozenset(replicas))
    opts = ControllerOptions(slices=slices, devices_per_slice=1, run_dir="", min_slices=min_slices,
                             max_retries=max_retries, pipeline_stages=stages, relaunch=may_wait if relaunch is None else relaunch,
                             capacity_timeout_seconds=60.0 if may_wait else 0.0)
    if statuses is None:
        statuses = {w: WorkerStatus(committed if applied is None else applied.get(w, committed), {})
                    for w in placement.members if w not in dead}
    return plan_recovery(state, Survey(statuses=statuses, **survey), opts, now)


def recover(**facts):
    return plan(**{k: v for k, v in facts.items() if k not in ("slices",)}, slices=facts.get("slices", 2))


# (facts, action, active, spares, tier, source, relaunch now, relaunch later)
HELD = {"a": WorkerStatus(7, {}), "b": WorkerStatus(7, {}), "s": WorkerStatus(0, {}, (6,))}   # s's host: a snapshot
RECOVERIES = [
    # a dead active slice, a spare: replace, the survivor supplies the state, the dead restart after a commit
    ({"dead": frozenset({"b"}), "replicas": frozenset({"a", "b"})}, Action.REPLACE, ("a", "s"), (), "replica",
     "a", (), ("b",)),
    # the spare shadows: it is a replica too, and the survivor is still preferred as the source
    ({"dead": frozenset({"b"}), "replicas": frozenset({"a", "b"}), "shadows": frozenset({"s"})}, Action.REPLACE,
     ("a", "s"), (), "replica", "a", (), ("b",)),
    # every active slice lost, a shadowing spare left: it takes over alone (shrink), from the shadow tier
    ({"dead": frozenset({"a", "b"}), "replicas": frozenset({"a", "b"}), "shadows": frozenset({"s"})}, Action.SHRINK,
     ("s",), (), "shadow", "s", (), ("a", "b")),
    # nobody died: a retry in a new epoch, nothing copied
    ({"replicas": frozenset({"a", "b"})}, Action.RETRY, ("a", "b"), ("s",), "replica", "a", (), ()),
    # no replica left, a snapshot on the spare's host and an older checkpoint: the snapshot (the one tier rule)
    ({"dead": frozenset({"a", "b"}), "replicas": frozenset({"a", "b"}), "snapshots": (Holding("snapshot", 6),),
      "checkpoints": (Holding("ckpt", 4),), "statuses": HELD}, Action.RESTORE, ("s",), (), "snapshot", "s", (),
     ("a", "b")),
    # only a checkpoint: restored
    ({"dead": frozenset({"a", "b"}), "replicas": frozenset({"a", "b"}), "checkpoints": (Holding("ckpt", 4),)},
     Action.RESTORE, ("s",), (), "checkpoint", "ckpt", (), ("a", "b")),
    # no state yet (the run starts): every member counts, the dead restart at once, nothing is copied
    ({"dead": frozenset({"b"}), "has_state": False}, Action.REPLACE, ("a", "s"), (), None, None, ("b",), ()),
]


@pytest.mark.parametrize("facts, action, active, spares, tier, source, now, later", RECOVERIES)
def test_a_recovery_plans_the_placement_the_tier_and_the_relaunches(facts, action, active, spares, tier, source,
                                                                    now, later):
    p = recover(**facts)
    assert p.action is action
    assert (p.placement.active, p.placement.spares, p.placement.epoch) == (active, spares, 4)
    assert (p.tier.tier if p.tier else None, p.tier.source if p.tier else None) == (tier, source)
    assert (p.relaunch_now, p.relaunch_later) == (now, later)


def test_a_recovery_plan_holds_the_whole_change_the_commits_the_rollbacks_and_each_copy():
    """a applied one step more than b, both one past the committed frontier; b died; the spare takes its slice."""
    p = plan(dead={"c"}, placement=Placement(3, ("a", "b", "c"), ("s",)), replicas="abc", slices=3,
             statuses={"a": WorkerStatus(9, {7: 2.0, 8: 1.5}), "b": WorkerStatus(8, {7: 2.0}),
                       "s": WorkerStatus(0, {})})
    assert p.action is Action.REPLACE and p.placement.active == ("a", "b", "s")
    assert (p.resume, p.commits, p.rollbacks) == (8, ((7, 2.0),), ("a",))
    assert p.copies == (Copy("a", "s"),) and p.restore is None and p.relaunch_later == ("c",)


def test_survivors_that_disagree_fail_the_recovery_as_diverged():
    p = plan(dead={"b"}, replicas="ab", statuses={"a": WorkerStatus(8, {7: 2.0}), "s": WorkerStatus(0, {})},
             placement=Placement(3, ("a", "b", "x"), ("s",)), slices=3)
    assert (p.action, p.failure) == (Action.REPLACE, None)   # x holds no status: it is not a replica
    p = plan(dead={"c"}, placement=Placement(3, ("a", "b", "c"), ("s",)), replicas="abc", slices=3,
             statuses={"a": WorkerStatus(8, {7: 2.0}), "b": WorkerStatus(8, {7: 3.0}), "s": WorkerStatus(0, {})})
    assert (p.action, p.failure) == (Action.FAIL, Failure.DIVERGED) and "no agreed loss for applied step 7" in p.reason


def test_a_restore_takes_the_newest_snapshot_a_member_holds_and_a_checkpoint_once_it_does_not_read():
    facts = {"dead": {"a", "b"}, "replicas": "ab", "placement": Placement(3, ("a", "b"), ("s", "t")),
             "snapshots": (Holding("snapshot", 6),), "checkpoints": (Holding("ckpt", 4),),
             "statuses": {"s": WorkerStatus(0, {}, (5, 6)), "t": WorkerStatus(0, {}, (9,))}}   # 9: past the frontier
    p = plan(**facts)
    assert p.action is Action.RESTORE and p.placement.active == ("s", "t")
    assert p.restore == Restore("snapshot", 6, ("s",)) and p.copies == (Copy("s", "t"),)
    again = plan(**facts, unreadable=frozenset({"s"}))
    assert again.restore == Restore("checkpoint", 4, ("s", "t")) and again.copies == ()
    none = plan(**{**facts, "checkpoints": ()}, unreadable=frozenset({"s"}))
    assert (none.action, none.failure) == (Action.FAIL, Failure.STATE_LOST)


@pytest.mark.parametrize("facts, failure, reason", [
    ({"dead": frozenset({"a", "b", "s"}), "replicas": frozenset({"a", "b"})}, Failure.STATE_LOST, "no live replica"),
    ({"dead": frozenset({"b", "s"}), "replicas": frozenset({"a", "b"}), "min_slices": 2}, Failure.CAPACITY,
     "min_slices is 2"),
    ({"dead": frozenset({"b"}), "replicas": frozenset({"a", "b"}), "recoveries": 6}, Failure.CAPACITY,
     "gave up after 5"),
])
def test_a_recovery_that_cannot_go_on_fails_with_its_kind(facts, failure, reason):
    p = recover(**facts)
    assert (p.action, p.failure) == (Action.FAIL, failure) and reason in p.reason


def test_a_wait_for_capacity_becomes_a_fail_at_its_deadline_not_before():
    facts = {"dead": frozenset({"b", "s"}), "replicas": frozenset({"a", "b"}), "min_slices": 2, "may_wait": True,
             "wait": Wait(100.0, "register_timeout_seconds", 30.0)}
    waiting = recover(**facts)
    assert waiting.action is Action.WAIT and waiting.relaunch_now == ("b", "s")
    p = recover(**facts, now=100.0)
    assert (p.action, p.failure, p.limit) == (Action.FAIL, Failure.CAPACITY, "register_timeout_seconds")
    assert "register_timeout_seconds=30" in p.reason
    joined = recover(**facts, joined=("n",))   # a worker joined: it takes the lost slice
    assert joined.action is Action.REPLACE and joined.placement.active == ("a", "n")


def workers(*ids):
    return tuple(WorkerInfo(w, f"{w}:1", 1) for w in ids)


@pytest.mark.parametrize("registered, lost, action, active", [
    (("a", "b", "s"), (), Action.REPLACE, ("a", "b")),
    (("a", "b", "s"), ("a",), Action.REPLACE, ("b", "s")),
    (("a",), ("b", "s"), Action.SHRINK, ("a",)),
    ((), ("a", "b", "s"), Action.FAIL, ()),
])
def test_the_start_places_what_registered(registered, lost, action, active):
    p = plan_start(2, 1, workers(*registered), lost=lost, min_slices=1)
    assert (p.action, p.placement.active) == (action, active)


def boundary(placement, slices=2, stages=1):
    placement = dataclasses.replace(placement, stages=stages)
    return (RunState(placement=placement, losses=Series([1.0] * 7), replicas=frozenset(placement.active)),
            ControllerOptions(slices=slices, devices_per_slice=1, run_dir="", pipeline_stages=stages))


@pytest.mark.parametrize("placement, slices, active, spares", [
    (Placement(3, ("a",), ("s", "t")), 2, ("a", "s"), ("t",)),
    (Placement(3, ("a", "b"), ("s",)), 2, None, None),   # already whole: nothing changes
    (Placement(3, ("a",), ()), 2, None, None),           # no spare to promote
])
def test_growing_promotes_spares_up_to_the_slice_count(placement, slices, active, spares):
    p = plan_grow(*boundary(placement, slices), {})
    assert (p.placement.active if p.placement else None) == active
    assert (p.placement.spares if p.placement else None) == spares
    assert p.action is (Action.GROW if active else Action.KEEP)
    if active:
        assert p.copies == (Copy("a", "s"),) and p.resume == 7


@pytest.mark.parametrize("slow, placement, active, reason", [
    ("b", Placement(3, ("a", "b"), ("s",)), ("a", "s"), ""),
    ("b", Placement(3, ("a", "b"), ()), None, "no spare"),
    ("x", Placement(3, ("a", "b"), ("s",)), None, "no longer runs a slice"),
])
def test_a_swap_moves_the_stragglers_slice_or_says_why_not(slow, placement, active, reason):
    p = plan_swap(*boundary(placement), {}, slow)
    assert (p.placement.active if p.placement else None) == active
    assert reason in p.reason


# A pipelined run: 2 stages x 2 replicas, stage-major (a, b: stage 0; c, d: stage 1).
PIPE = Placement(epoch=3, active=("a", "b", "c", "d"), spares=("s",), stages=2)
LOADED = {"a": 0, "b": 0, "c": 1, "d": 1}
PIPE_LIMITS = {"placement": PIPE, "slices": 4, "min_slices": 4, "stages": 2, "replicas": frozenset("abcd"),
               "loaded": LOADED}


def test_a_pipelined_recovery_puts_the_spare_in_the_lost_slices_stage():
    p = plan(**{**PIPE_LIMITS, "dead": frozenset({"c"})})
    assert p.action is Action.REPLACE and p.placement.active == ("a", "b", "s", "d")
    assert p.tier.tier == "replica"
    assert p.loads == (("s", 1),) and p.copies == (Copy("d", "s", 1),)   # the spare loads stage 1, copies from d


@pytest.mark.parametrize("facts, action, failure, reason", [
    # both replicas of stage 1 lost: stage 0's replicas cannot supply stage 1's state, a spare or not
    ({"dead": frozenset({"c", "d"})}, Action.FAIL, Failure.STATE_LOST, "pipeline stage 1 lost every replica (c, d)"),
    # no spare, every slice asked for (min_slices 4), no worker relaunched: fail ...
    ({"dead": frozenset({"a", "s"}), "relaunch": False}, Action.FAIL, Failure.CAPACITY, "min_slices is 4"),
    # ... or wait for capacity when a relaunched worker may take the slice
    ({"dead": frozenset({"a", "s"}), "may_wait": True}, Action.WAIT, None, "waiting for capacity"),
    # a lower minimum: a whole pipeline replica is dropped
    ({"dead": frozenset({"a", "s"}), "min_slices": 2}, Action.SHRINK, None, "1 dropped, 1 take over"),
])
def test_a_pipelined_recovery_needs_a_replica_of_every_stage(facts, action, failure, reason):
    p = plan(**{**PIPE_LIMITS, **facts})
    assert (p.action, p.failure) == (action, failure) and reason in p.reason


def test_a_pipelined_realign_reads_the_loss_of_the_last_stages_survivors_only():
    """Every survivor's applied steps count; only the loss workers' sums are compared (earlier stages have none)."""
    p = plan(**{**PIPE_LIMITS, "dead": frozenset({"c"}),
                "statuses": {"a": WorkerStatus(8, {}), "b": WorkerStatus(8, {}), "d": WorkerStatus(8, {7: 2.5}),
                             "s": WorkerStatus(0, {})}})
    assert (p.action, p.resume, p.commits) == (Action.REPLACE, 8, ((7, 2.5),))


def test_a_pipelined_restore_gives_each_stage_a_worker_where_its_snapshot_lies():
    from runtime.control.stage_plan import arrange_stages

    hosts = {"a": "h0", "b": "h1", "c": "h2", "d": "h3", "s": "h4"}

    def arrange(active, holders, spares=()):
        p = arrange_stages(Placement(4, tuple(active), tuple(spares), 2), tuple(map(frozenset, holders)), hosts)
        return "".join(p.active) + "/" + "".join(p.spares)

    assert arrange("abcd", ({"h0"}, {"h2"})) == "abcd/"      # already matched (stage 0 on h0, stage 1 on h2)
    assert arrange("abcd", ({"h3"}, {"h0"})) == "dbac/"      # d and a swap in; the others fill in order
    # a greedy choice would give stage 0 the worker both stages could use: the matching does not
    assert arrange("ab", ({"h0", "h1"}, {"h1"})) == "ab/" and arrange("ba", ({"h0", "h1"}, {"h1"})) == "ab/"
    # a stage no host holds: the others are matched, it gets what is left (its restore then fails, saying so)
    assert arrange("ab", (set(), {"h0"})) == "ba/"
    # the snapshot lies on a spare's host: the spare takes a slice, an active worker becomes a spare
    assert arrange("abcd", ({"h0"}, {"h4"}), spares="s") == "absc/d"


PIPE_LOST = {**PIPE_LIMITS, "dead": frozenset("abcd"), "placement": Placement(3, ("a", "b", "c", "d"), ("p", "q", "r", "s")),
             "snapshots": (Holding("snapshot", 6),), "hosts": {"p": "h1", "q": "h8", "r": "h2", "s": "h9"}}


def test_a_pipelined_recovery_that_restores_arranges_the_stages_loads_them_then_asks_again():
    facts = {**PIPE_LOST, "snapshot_hosts": (frozenset({"h9"}), frozenset({"h8"})), "loaded": {"p": 0, "q": 0, "r": 0, "s": 0}}
    p = plan(**facts)
    assert p.action is Action.RESTORE and p.tier.tier == "snapshot"
    assert p.placement.active == ("s", "p", "q", "r") and p.placement.spares == ()   # stage 0: s (h9); 1: q (h8)
    assert p.resurvey and p.loads == (("q", 1), ("r", 1)) and p.restore is None   # listed with stage 1's programs
    loaded = {"s": 0, "p": 0, "q": 1, "r": 1}
    held = {"s": WorkerStatus(0, {}, (4, 6)), "p": WorkerStatus(0, {}, ()), "q": WorkerStatus(0, {}, (6,)),
            "r": WorkerStatus(0, {}, (4,))}
    then = plan(**{**facts, "loaded": loaded, "statuses": held})
    assert then.restore == Restore("snapshot", 6, ("s", "q")) and not then.resurvey
    assert then.copies == (Copy("s", "p", 0), Copy("q", "r", 1))
    older = plan(**{**facts, "loaded": loaded, "statuses": held, "at_most": 5})   # q's 6 did not read
    assert older.restore == Restore("snapshot", 4, ("s", "r"))


@pytest.mark.parametrize("spares, shadows, spare_stages, active, tier", [
    # the spare that shadows stage 1 takes stage 1's lost slice, ahead of stage 0's shadow: no copy needed
    (("p", "q"), "pq", {"p": 0, "q": 1}, ("a", "b", "q", "d"), "replica"),
    # a plain spare before a shadow of another stage (which keeps shadowing); the copy comes from d
    (("p", "q"), "p", {"p": 0, "q": 0}, ("a", "b", "q", "d"), "replica"),
    # only another stage's shadow: it takes the slice (and then needs a copy from stage 1's survivor)
    (("p",), "p", {"p": 0}, ("a", "b", "p", "d"), "replica"),
])
def test_a_pipelined_recovery_takes_the_lost_stages_own_shadow_first(spares, shadows, spare_stages, active, tier):
    p = plan(**{**PIPE_LIMITS, "placement": Placement(3, PIPE.active, spares), "dead": frozenset({"c"}),
                "shadows": frozenset(shadows), "loaded": {**LOADED, **spare_stages}})
    assert p.action is Action.REPLACE and p.placement.active == active and p.tier.tier == tier


def test_a_pipelined_stage_with_no_replica_left_is_saved_only_by_a_shadow_of_its_own():
    one = Placement(3, ("a", "c"), ("p",))   # one replica per stage: a (stage 0), c (stage 1)
    facts = {**PIPE_LIMITS, "placement": one, "slices": 2, "min_slices": 2, "dead": frozenset({"c"}),
             "replicas": frozenset("ac"), "shadows": frozenset("p")}
    saved = plan(**{**facts, "loaded": {"a": 0, "c": 1, "p": 1}})
    assert saved.action is Action.REPLACE and saved.placement.active == ("a", "p") and saved.tier.tier == "shadow"
    assert saved.copies == ()   # the shadow of stage 1 holds its state
    lost = plan(**{**facts, "loaded": {"a": 0, "c": 1, "p": 0}})
    assert lost.action is Action.FAIL and "pipeline stage 1 lost every replica (c)" in lost.reason


@pytest.mark.parametrize("dead, spares, active, left", [
    # stage 0's first replica lost, no spare: replica 0 is dropped whole, its stage-1 survivor c becomes a spare
    ("a", "", "bd", "c"),
    # both replicas lost a worker, one spare: one replica is kept, its lost slice taken by the survivor of the
    # dropped one in the same stage (it holds that stage's state: nothing to copy), not by the spare
    ("ad", "s", "bc", "s"),
    ("bc", "", "ad", ""),
    # a replica lost both its workers, one spare: not enough to rebuild it; the other runs alone
    ("bd", "s", "ac", "s"),
])
def test_a_pipelined_run_with_too_few_workers_drops_whole_replicas(dead, spares, active, left):
    """2 stages x 2 replicas (stage 0: a, b; stage 1: c, d); min_slices 2: one pipeline replica is enough."""
    p = plan(**{**PIPE_LIMITS, "placement": Placement(3, PIPE.active, tuple(spares)), "dead": frozenset(dead),
                "min_slices": 2})
    assert p.action is Action.SHRINK
    assert "".join(p.placement.active) == active and "".join(p.placement.spares) == left


def test_a_pipelined_replica_dropped_gives_its_survivor_back_to_its_stage():
    """Stage 0 lost a and b (its both replicas), stage 1 lost nothing, no spare: nothing holds stage 0's state."""
    p = plan(**{**PIPE_LIMITS, "dead": frozenset("ab"), "min_slices": 2, "placement": Placement(3, PIPE.active, ())})
    assert p.action is Action.FAIL and "pipeline stage 0 lost every replica (a, b)" in p.reason


def test_a_pipelined_run_grows_back_by_whole_replicas_a_spare_per_stage():
    from runtime.control.plan import decide_grow, membership_change_due

    one = Placement(3, ("a", "c"), ("p",), stages=2)   # stage 0: a, stage 1: c; one replica of 2 asked for
    assert decide_grow(one, 4, {"p": 0}) is None   # one spare is not a replica
    grown = decide_grow(Placement(3, ("a", "c"), ("p", "q", "r"), stages=2), 4, {"p": 1, "q": 0})
    assert grown.active == ("a", "q", "c", "p") and grown.spares == ("r",)   # each stage its own stage's spare
    assert grown.grid == (("a", "q"), ("c", "p")) and grown.stages == 2 and grown.epoch == 4
    assert not membership_change_due(one, 4, (), unadopted=False, warmed=False, swaps=False)
    assert membership_change_due(dataclasses.replace(grown, stages=1), 6, (), unadopted=False, warmed=False,
                                 swaps=False)
    p = plan_grow(*boundary(Placement(3, ("a", "c"), ("p", "q", "r")), 4, 2), {"a": 0, "c": 1, "p": 1, "q": 0})
    assert p.copies == (Copy("a", "q", 0), Copy("c", "p", 1)) and p.loads == ()


def test_a_pipelined_restore_waits_for_a_worker_where_a_stages_snapshot_lies_until_its_deadline():
    facts = {**PIPE_LOST, "may_wait": True, "snapshot_hosts": (frozenset({"h1"}), frozenset({"h9"})),
             "hosts": {"p": "h1", "q": "h2", "r": "h3", "s": "h4"}}   # h9: nobody's yet
    waiting = plan(**facts)
    assert waiting.action is Action.WAIT and "holding the snapshot of stage 1" in waiting.reason
    late = {**facts, "wait": Wait(10.0)}
    assert plan(**late, now=5.0).action is Action.WAIT
    assert plan(**late, now=11.0).action is Action.RESTORE   # past the deadline: what the members hold
    came = {**late, "joined": ("t",), "hosts": {**facts["hosts"], "t": "h9"}}
    assert plan(**came, now=5.0).placement.active == ("p", "q", "t", "r")


def test_room_for_shape_a_copy_says_its_layouts_and_programs_are_keyed_by_role_stage_and_mesh():
    """No reshard is built: a copy between two slice shapes is refused where it would plug in, and the
    programs of a mesh not exported are named missing."""
    import dataclasses as dc

    import pytest as pt

    from runtime.control.placement import Layout, WorkerInfo
    from runtime.control.plan import Copy
    from runtime.control.state_copies import StateCopies
    from runtime.core.errors import DeviceMismatchError

    two = WorkerInfo("w0", "a,b", 4, hosts=(WorkerInfo("w0/0", "a", 4), WorkerInfo("w0/1", "b", 4)))
    assert two.layout == Layout(4, 2) and WorkerInfo("w1", "c", 4).layout == Layout(4) and str(Layout(4, 2)) == \
        "4 device(s) on 2 hosts"
    same = Copy("w0", "w1", 0, Layout(4), Layout(4))
    assert same == Copy("w0", "w1") and not same.reshards and not Copy("w0", "w1").reshards
    other = dc.replace(same, dest_layout=Layout(2))
    assert other.reshards
    copies = StateCopies.__new__(StateCopies)
    with pt.raises(DeviceMismatchError, match=r"w0 \(4 device\(s\)\) cannot be copied to w1 \(2 device\(s\)\)"):
        copies.carry_out([other], 3)

    from runtime.control.plan import Action, Plan, _laid_out
    from runtime.control.run_state import RunState
    from runtime.core.programs import ProgramSet, StagePrograms

    state = RunState.replay([{"kind": "worker_registered", "worker": w, "address": w, "devices": 4,
                              "platform": "cpu", "pid": 1} for w in ("w0", "w1")])
    [laid] = _laid_out(Plan(Action.REPLACE, None, "", copies=(Copy("w0", "w1"),)), state).copies
    assert (laid.source_layout, laid.dest_layout) == (Layout(4), Layout(4))
    stages = tuple(StagePrograms({}, 4, 2, 1, 1, {}, {}, stage=k, num_stages=2) for k in range(2))
    programs = ProgramSet(stages)
    assert programs.keys() == [("trainer", 0, 4), ("trainer", 1, 4)] and programs.for_key("trainer", 1, 4) is stages[1]
    with pt.raises(KeyError, match="no programs exported for trainer stage 0 on a mesh of 2 device"):
        programs.for_key("trainer", 0, 2)
