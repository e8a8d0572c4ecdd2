"""plan_change: every membership change as one pure decision, table-tested (the rules inside each case:
test_policy.py and test_tiers.py)."""

import dataclasses

import pytest

from runtime.control.plan import Action, Change, Facts, Failure, plan_change
from runtime.control.policy import Placement, WorkerInfo
from runtime.control.tiers import Holding

P = Placement(epoch=3, active=("a", "b"), spares=("s",))
LIMITS = {"slices": 2, "min_slices": 1, "max_retries": 5, "recoveries": 1, "committed": 7}


def recover(**facts):
    return plan_change(Facts(Change.RECOVER, placement=P, **{**LIMITS, **facts}))


# (facts, action, active, spares, tier, source, relaunch now, relaunch later)
RECOVERIES = [
    # a dead active slice, a spare: replace, the survivor supplies the state, the dead restart after a commit
    ({"dead": frozenset({"b"}), "replicas": frozenset({"a", "b"})}, Action.REPLACE, ("a", "s"), (), "replica",
     "a", (), ("b",)),
    # the spare shadows: it is a replica too, and the survivor is still preferred as the source
    ({"dead": frozenset({"b"}), "replicas": frozenset({"a", "b", "s"})}, Action.REPLACE, ("a", "s"), (),
     "replica", "a", (), ("b",)),
    # every active slice lost, a shadowing spare left: it takes over alone (shrink), from the shadow tier
    ({"dead": frozenset({"a", "b"}), "replicas": frozenset({"a", "b", "s"})}, Action.SHRINK, ("s",), (),
     "shadow", "s", (), ("a", "b")),
    # nobody died: a retry in a new epoch, nothing copied
    ({"replicas": frozenset({"a", "b"})}, Action.RETRY, ("a", "b"), ("s",), "replica", "a", (), ()),
    # no replica left, a snapshot and an older checkpoint: the snapshot is restored (the one tier rule)
    ({"dead": frozenset({"a", "b"}), "replicas": frozenset({"a", "b"}), "snapshots": (Holding("snapshot", 6),),
      "checkpoints": (Holding("ckpt", 4),)}, Action.RESTORE, ("s",), (), "snapshot", "snapshot", (), ("a", "b")),
    # only a checkpoint: restored
    ({"dead": frozenset({"a", "b"}), "replicas": frozenset({"a", "b"}), "checkpoints": (Holding("ckpt", 4),)},
     Action.RESTORE, ("s",), (), "checkpoint", "ckpt", (), ("a", "b")),
    # no state yet (the run starts): every member counts, the dead restart at once, nothing is copied
    ({"dead": frozenset({"b"}), "replicas": frozenset({"a", "b", "s"}), "has_state": False}, Action.REPLACE,
     ("a", "s"), (), None, None, ("b",), ()),
]


@pytest.mark.parametrize("facts, action, active, spares, tier, source, now, later", RECOVERIES)
def test_a_recovery_plans_the_placement_the_tier_and_the_relaunches(facts, action, active, spares, tier, source,
                                                                    now, later):
    plan = recover(**facts)
    assert plan.action is action
    assert (plan.placement.active, plan.placement.spares, plan.placement.epoch) == (active, spares, 4)
    assert (plan.tier.tier if plan.tier else None, plan.tier.source if plan.tier else None) == (tier, source)
    assert (plan.relaunch_now, plan.relaunch_later) == (now, later)
    assert plan.decision.action is action and plan.decision.placement == plan.placement


@pytest.mark.parametrize("facts, failure, reason", [
    ({"dead": frozenset({"a", "b", "s"}), "replicas": frozenset({"a", "b"})}, Failure.STATE_LOST, "no live replica"),
    ({"dead": frozenset({"b", "s"}), "replicas": frozenset({"a", "b"}), "min_slices": 2}, Failure.CAPACITY,
     "min_slices is 2"),
    ({"dead": frozenset({"b"}), "replicas": frozenset({"a", "b"}), "recoveries": 6}, Failure.CAPACITY,
     "gave up after 5"),
])
def test_a_recovery_that_cannot_go_on_fails_with_its_kind(facts, failure, reason):
    plan = recover(**facts)
    assert (plan.action, plan.failure) == (Action.FAIL, failure) and reason in plan.reason


def test_a_wait_for_capacity_becomes_a_fail_at_its_deadline_not_before():
    facts = {"dead": frozenset({"b", "s"}), "replicas": frozenset({"a", "b"}), "min_slices": 2, "may_wait": True,
             "wait_until": 100.0, "wait_limit": "register_timeout_seconds", "wait_seconds": 30.0}
    assert recover(**facts).action is Action.WAIT
    plan = plan_change(Facts(Change.RECOVER, placement=P, **{**LIMITS, **facts}), now=100.0)
    assert (plan.action, plan.failure, plan.limit) == (Action.FAIL, Failure.CAPACITY, "register_timeout_seconds")
    assert "register_timeout_seconds=30" in plan.reason


def workers(*ids):
    return tuple(WorkerInfo(w, f"{w}:1", 1) for w in ids)


@pytest.mark.parametrize("registered, lost, action, active", [
    (("a", "b", "s"), (), Action.REPLACE, ("a", "b")),
    (("a", "b", "s"), ("a",), Action.REPLACE, ("b", "s")),
    (("a",), ("b", "s"), Action.SHRINK, ("a",)),
    ((), ("a", "b", "s"), Action.FAIL, ()),
])
def test_the_start_places_what_registered(registered, lost, action, active):
    plan = plan_change(Facts(Change.START, slices=2, devices_per_slice=1, min_slices=1,
                             workers=workers(*registered), lost=lost))
    assert (plan.action, plan.placement.active) == (action, active)


@pytest.mark.parametrize("applied, losses, action, target, commits, rollbacks", [
    ({"a": 7, "s": 7}, {"a": {}, "s": {}}, None, 7, (), ()),
    ({"a": 8, "b": 7}, {"a": {7: 2.0}, "b": {}}, None, 7, (), ("a",)),
    ({"a": 8, "b": 8}, {"a": {7: 2.0}, "b": {7: 2.0}}, None, 8, ((7, 2.0),), ()),
    ({"a": 8, "b": 8}, {"a": {7: 2.0}, "b": {7: 3.0}}, Action.FAIL, 8, (), ()),
    ({"a": 9, "b": 7}, {"a": {}, "b": {}}, Action.FAIL, 7, (), ()),
])
def test_a_realign_commits_what_every_survivor_applied_and_rolls_back_the_rest(applied, losses, action, target,
                                                                               commits, rollbacks):
    plan = plan_change(Facts(Change.REALIGN, placement=P, committed=7, applied=applied, losses=losses))
    assert (plan.action, plan.target, plan.commits, plan.rollbacks) == (action, target, commits, rollbacks)


@pytest.mark.parametrize("snapshots, checkpoints, tier, step", [
    ((Holding("w1", 5),), (Holding("d", 4),), "snapshot", 5),
    ((), (Holding("d", 4),), "checkpoint", 4),
    ((Holding("w1", 9),), (), "fail", None),   # a snapshot ahead of the committed step is never used
])
def test_a_restore_chooses_from_what_the_fenced_members_hold(snapshots, checkpoints, tier, step):
    plan = plan_change(Facts(Change.RESTORE, placement=P, committed=7, snapshots=snapshots, checkpoints=checkpoints))
    assert (plan.tier.tier, plan.tier.step) == (tier, step)
    assert plan.action is (Action.FAIL if tier == "fail" else Action.RESTORE)


@pytest.mark.parametrize("placement, slices, active, spares", [
    (Placement(3, ("a",), ("s", "t")), 2, ("a", "s"), ("t",)),
    (Placement(3, ("a", "b"), ("s",)), 2, None, None),   # already whole: nothing changes
    (Placement(3, ("a",), ()), 2, None, None),           # no spare to promote
])
def test_growing_promotes_spares_up_to_the_slice_count(placement, slices, active, spares):
    plan = plan_change(Facts(Change.GROW, placement=placement, slices=slices))
    assert (plan.placement.active if plan.placement else None) == active
    assert (plan.placement.spares if plan.placement else None) == spares
    assert plan.action is (Action.GROW if active else None)


@pytest.mark.parametrize("slow, placement, active, reason", [
    ("b", Placement(3, ("a", "b"), ("s",)), ("a", "s"), ""),
    ("b", Placement(3, ("a", "b"), ()), None, "no spare"),
    ("x", Placement(3, ("a", "b"), ("s",)), None, "no longer runs a slice"),
])
def test_a_swap_moves_the_stragglers_slice_or_says_why_not(slow, placement, active, reason):
    plan = plan_change(Facts(Change.SWAP, placement=placement, slow=slow))
    assert (plan.placement.active if plan.placement else None) == active
    assert reason in plan.reason


# A pipelined run: 2 stages x 2 replicas, stage-major (a, b: stage 0; c, d: stage 1).
PIPE = Placement(epoch=3, active=("a", "b", "c", "d"), spares=("s",))
PIPE_LIMITS = {**LIMITS, "placement": PIPE, "slices": 4, "min_slices": 4, "stages": 2,
               "replicas": frozenset("abcd")}


def test_a_pipelined_recovery_puts_the_spare_in_the_lost_slices_stage():
    plan = plan_change(Facts(Change.RECOVER, **{**PIPE_LIMITS, "dead": frozenset({"c"})}))
    assert plan.action is Action.REPLACE and plan.placement.active == ("a", "b", "s", "d")
    assert plan.tier.tier == "replica"


@pytest.mark.parametrize("facts, action, failure, reason", [
    # both replicas of stage 1 lost: stage 0's replicas cannot supply stage 1's state, a spare or not
    ({"dead": frozenset({"c", "d"})}, Action.FAIL, Failure.STATE_LOST, "pipeline stage 1 lost every replica (c, d)"),
    # no spare, every slice asked for (min_slices 4): fail ...
    ({"dead": frozenset({"a", "s"})}, Action.FAIL, Failure.CAPACITY, "min_slices is 4"),
    # ... or wait for capacity when a relaunched worker may take the slice
    ({"dead": frozenset({"a", "s"}), "may_wait": True}, Action.WAIT, None, "waiting for capacity"),
    # a lower minimum: a whole pipeline replica is dropped
    ({"dead": frozenset({"a", "s"}), "min_slices": 2}, Action.SHRINK, None, "1 dropped, 1 take over"),
])
def test_a_pipelined_recovery_needs_a_replica_of_every_stage(facts, action, failure, reason):
    plan = plan_change(Facts(Change.RECOVER, **{**PIPE_LIMITS, **facts}))
    assert (plan.action, plan.failure) == (action, failure) and reason in plan.reason


def test_a_pipelined_realign_reads_the_loss_of_the_last_stages_survivors_only():
    """Every survivor's applied steps count; only the loss workers' sums are compared (earlier stages have none)."""
    plan = plan_change(Facts(Change.REALIGN, placement=PIPE, committed=7, applied={"a": 8, "b": 8, "d": 8},
                             losses={"d": {7: 2.5}}))
    assert (plan.action, plan.target, plan.commits) == (None, 8, ((7, 2.5),))


def test_a_pipelined_restore_gives_each_stage_a_worker_where_its_snapshot_lies():
    from runtime.control.stage_plan import arrange_stages

    hosts = {"a": "h0", "b": "h1", "c": "h2", "d": "h3", "s": "h4"}

    def arrange(active, holders, spares=()):
        p = arrange_stages(Placement(4, tuple(active), tuple(spares)), 2, tuple(map(frozenset, holders)), hosts)
        return "".join(p.active) + "/" + "".join(p.spares)

    assert arrange("abcd", ({"h0"}, {"h2"})) == "abcd/"      # already matched (stage 0 on h0, stage 1 on h2)
    assert arrange("abcd", ({"h3"}, {"h0"})) == "dbac/"      # d and a swap in; the others fill in order
    # a greedy choice would give stage 0 the worker both stages could use: the matching does not
    assert arrange("ab", ({"h0", "h1"}, {"h1"})) == "ab/" and arrange("ba", ({"h0", "h1"}, {"h1"})) == "ab/"
    # a stage no host holds: the others are matched, it gets what is left (its restore then fails, saying so)
    assert arrange("ab", (set(), {"h0"})) == "ba/"
    # the snapshot lies on a spare's host: the spare takes a slice, an active worker becomes a spare
    assert arrange("abcd", ({"h0"}, {"h4"}), spares="s") == "absc/d"


def test_a_pipelined_recovery_that_restores_arranges_the_stages_by_where_the_snapshots_lie():
    plan = plan_change(Facts(Change.RECOVER, **{**PIPE_LIMITS, "dead": frozenset("abcd"), "replicas": frozenset("abcd"),
                                                "placement": Placement(3, ("a", "b", "c", "d"), ("p", "q", "r", "s")),
                                                "snapshots": (Holding("snapshot", 6),),
                                                "backup_hosts": (frozenset({"h9"}), frozenset({"h8"})),
                                                "hosts": {"p": "h1", "q": "h8", "r": "h2", "s": "h9"}}))
    assert plan.action is Action.RESTORE and plan.tier.tier == "snapshot"
    assert plan.placement.active == ("s", "p", "q", "r")   # stage 0: s (on h9); stage 1: q (on h8)
    assert plan.placement.spares == ()


@pytest.mark.parametrize("spares, replicas, spare_stages, active, tier", [
    # the spare that shadows stage 1 takes stage 1's lost slice, ahead of stage 0's shadow: no copy needed
    (("p", "q"), "abdpq", {"p": 0, "q": 1}, ("a", "b", "q", "d"), "replica"),
    # a plain spare before a shadow of another stage (which keeps shadowing); the copy comes from d
    (("p", "q"), "abdp", {"p": 0, "q": 0}, ("a", "b", "q", "d"), "replica"),
    # only another stage's shadow: it takes the slice (and then needs a copy from stage 1's survivor)
    (("p",), "abdp", {"p": 0}, ("a", "b", "p", "d"), "replica"),
])
def test_a_pipelined_recovery_takes_the_lost_stages_own_shadow_first(spares, replicas, spare_stages, active, tier):
    plan = plan_change(Facts(Change.RECOVER, **{**PIPE_LIMITS, "placement": Placement(3, PIPE.active, spares),
                                                "dead": frozenset({"c"}), "replicas": frozenset(replicas),
                                                "spare_stages": spare_stages}))
    assert plan.action is Action.REPLACE and plan.placement.active == active and plan.tier.tier == tier


def test_a_pipelined_stage_with_no_replica_left_is_saved_only_by_a_shadow_of_its_own():
    one = Placement(3, ("a", "c"), ("p",))   # one replica per stage: a (stage 0), c (stage 1)
    facts = {**PIPE_LIMITS, "placement": one, "slices": 2, "min_slices": 2, "dead": frozenset({"c"}),
             "replicas": frozenset("acp")}
    saved = plan_change(Facts(Change.RECOVER, **facts, spare_stages={"p": 1}))
    assert saved.action is Action.REPLACE and saved.placement.active == ("a", "p") and saved.tier.tier == "shadow"
    lost = plan_change(Facts(Change.RECOVER, **facts, spare_stages={"p": 0}))
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
    plan = plan_change(Facts(Change.RECOVER, **{**PIPE_LIMITS, "placement": Placement(3, PIPE.active, tuple(spares)),
                                                "dead": frozenset(dead), "min_slices": 2,
                                                "replicas": frozenset("abcd")}))
    assert plan.action is Action.SHRINK
    assert "".join(plan.placement.active) == active and "".join(plan.placement.spares) == left


def test_a_pipelined_replica_dropped_gives_its_survivor_back_to_its_stage():
    """Stage 0 lost a and b (its both replicas), stage 1 lost nothing, no spare: nothing holds stage 0's state."""
    plan = plan_change(Facts(Change.RECOVER, **{**PIPE_LIMITS, "dead": frozenset("ab"), "min_slices": 2,
                                                "placement": Placement(3, PIPE.active, ())}))
    assert plan.action is Action.FAIL and "pipeline stage 0 lost every replica (a, b)" in plan.reason


def test_a_pipelined_run_grows_back_by_whole_replicas_a_spare_per_stage():
    from runtime.control.plan import decide_grow

    one = Placement(3, ("a", "c"), ("p",))   # stage 0: a, stage 1: c; one replica of 2 asked for
    assert decide_grow(one, 4, 2, {"p": 0}) is None   # one spare is not a replica
    grown = decide_grow(Placement(3, ("a", "c"), ("p", "q", "r")), 4, 2, {"p": 1, "q": 0})
    assert grown.active == ("a", "q", "c", "p") and grown.spares == ("r",)   # each stage its own stage's spare
    from runtime.control.plan import membership_change_due
    assert not membership_change_due(one, 4, (), unadopted=False, warmed=False, swaps=False, stages=2)
    assert membership_change_due(grown, 6, (), unadopted=False, warmed=False, swaps=False, stages=1)


def test_a_pipelined_restore_waits_for_a_worker_where_a_stages_snapshot_lies_until_its_deadline():
    facts = Facts(Change.RECOVER, **{**PIPE_LIMITS, "dead": frozenset("abcd"), "replicas": frozenset("abcd"),
                                     "placement": Placement(3, ("a", "b", "c", "d"), ("p", "q", "r", "s")),
                                     "snapshots": (Holding("snapshot", 6),), "may_wait": True,
                                     "backup_hosts": (frozenset({"h1"}), frozenset({"h9"})),   # h9: nobody's yet
                                     "hosts": {"p": "h1", "q": "h2", "r": "h3", "s": "h4"}})
    waiting = plan_change(facts)
    assert waiting.action is Action.WAIT and "holding the snapshot of stage 1" in waiting.reason
    late = dataclasses.replace(facts, wait_until=10.0)
    assert plan_change(late, now=5.0).action is Action.WAIT
    assert plan_change(late, now=11.0).action is Action.RESTORE   # past the deadline: what the members hold
    came = dataclasses.replace(late, placement=Placement(3, facts.placement.active, ("p", "q", "r", "s", "t")),
                               hosts={**facts.hosts, "t": "h9"})
    assert plan_change(came, now=5.0).placement.active == ("p", "q", "t", "r")
