"""runtime/control/tiers.py: which tier a recovery takes the state from, and what elastic_backup_kind means."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.control.tiers import BACKUP_KINDS, FAIL, TIERS, Holding, TierChoice, backup_tier, choose_source

H = Holding


@pytest.mark.parametrize("replicas, shadows, snapshots, checkpoints, committed, want", [
    # a replica at the committed step wins, whatever else exists
    ({"w1": 10, "w0": 10}, {"s0": 10}, [H("w2", 9)], [H("/c/10", 10)], 10, ("replica", "w0", 10, 0)),
    # replicas elsewhere than the committed step do not count; a shadow at it does
    ({"w1": 11, "w2": 9}, {"s1": 10, "s0": 9}, [], [], 10, ("shadow", "s1", 10, 0)),
    # no replica or shadow at it: the newest complete snapshot at or before it, even if a checkpoint is newer
    ({}, {"s0": 7}, [H("w1", 5), H("w2", 8, complete=False), H("w3", 12), H("w4", 3)], [H("/c/9", 9)], 10,
     ("snapshot", "w1", 5, 5)),
    # no snapshot: the newest complete checkpoint at or before it
    ({}, {}, [H("w1", 11)], [H("/c/4", 4), H("/c/8", 8), H("/c/10", 10, complete=False), H("/c/12", 12)], 10,
     ("checkpoint", "/c/8", 8, 2)),
    # a checkpoint at step 0 (the initial state) counts
    ({}, {}, [], [H("/c/0", 0)], 3, ("checkpoint", "/c/0", 0, 3)),
    # equal steps: the smallest source
    ({}, {}, [H("w9", 6), H("w3", 6), H("w5", 6)], [], 6, ("snapshot", "w3", 6, 0)),
    # an incomplete shadow does not count
    ({}, [H("s0", 4, complete=False)], [], [H("/c/2", 2)], 4, ("checkpoint", "/c/2", 2, 2)),
])
def test_the_cheapest_usable_tier_is_chosen(replicas, shadows, snapshots, checkpoints, committed, want):
    choice = choose_source(replicas, shadows, snapshots, checkpoints, committed)
    assert (choice.tier, choice.source, choice.step, choice.steps_lost) == want
    assert choice.ok and choice.reason


def test_the_reason_says_what_was_passed_over():
    choice = choose_source({"w0": 9}, {}, [], [H("/c/8", 8)], 10)
    assert choice.reason == ("checkpoint /c/8 holds step 8: 2 committed steps to redo "
                             "(no usable replica: replicas hold steps [9], not 10)")
    assert choose_source({"w0": 3}, {}, [], [], 3).reason == "replica w0 holds the committed step 3"


@pytest.mark.parametrize("replicas, shadows, snapshots, checkpoints, reason", [
    ({}, {}, [], [], "no replica, shadow, snapshot or checkpoint holds the state"),
    ({"w0": 11}, {}, [H("w1", 12)], [H("/c/5", 5, complete=False)],
     "no copy of the committed step 10 or older is usable: replicas hold steps [11], not 10; "
     "snapshots hold only steps after 10; every checkpoint is incomplete"),
])
def test_nothing_usable_fails_with_the_reason(replicas, shadows, snapshots, checkpoints, reason):
    choice = choose_source(replicas, shadows, snapshots, checkpoints, 10)
    assert choice == TierChoice(FAIL, None, None, None, reason)
    assert not choice.ok


@pytest.mark.parametrize("args, match", [
    (({"w0": -1}, {}, [], [], 3), "non-negative"),
    (({"": 3}, {}, [], [], 3), "non-empty"),
    (({}, {}, [("w0", 3)], [], 3), "expected Holding"),
    (({}, {}, [], [H("/c", True)], 3), "non-negative int"),
    (({}, {}, [], [], -1), "committed_step"),
    (({}, {}, [], [], 2.0), "committed_step"),
])
def test_malformed_input_is_refused(args, match):
    with pytest.raises(ValueError, match=match):
        choose_source(*args)


@pytest.mark.parametrize("kind, spares, want", [
    ("snapshot", 0, "snapshot"),
    ("checkpoint", 0, "checkpoint"),
    ("snapshot", 1, "shadow"),
    ("checkpoint", 2, "shadow"),
])
def test_backup_tier_is_a_shadow_while_one_exists_else_the_configured_kind(kind, spares, want):
    assert backup_tier(kind, shadow_spares=spares) == want


@pytest.mark.parametrize("kind, spares, match", [
    ("shadow", 0, "elastic_backup_kind"), ("", 1, "elastic_backup_kind"), ("snapshot", -1, "shadow_spares"),
])
def test_backup_tier_refuses_unknown_kinds(kind, spares, match):
    with pytest.raises(ValueError, match=match):
        backup_tier(kind, shadow_spares=spares)


def test_backup_kinds_are_tiers():
    assert set(BACKUP_KINDS) < set(TIERS) and TIERS[0] == "replica"


# -- properties ----------------------------------------------------------------------

holdings = st.lists(st.builds(Holding, source=st.sampled_from(["a", "b", "c", "/ck/1", "w10"]),
                              step=st.integers(0, 12), complete=st.booleans()), max_size=6)


def usable(tier: str, h: Holding, committed: int) -> bool:
    return h.complete and (h.step == committed if tier in ("replica", "shadow") else h.step <= committed)


@settings(max_examples=300, deadline=None)
@given(tiers=st.tuples(holdings, holdings, holdings, holdings), committed=st.integers(0, 12), seed=st.integers())
def test_choice_properties(tiers, committed, seed):
    choice = choose_source(*tiers, committed)
    by_tier = dict(zip(TIERS, tiers))
    any_usable = any(usable(t, h, committed) for t in TIERS for h in by_tier[t])
    assert choice.ok == any_usable
    assert choice.reason
    if not choice.ok:
        assert (choice.source, choice.step, choice.steps_lost) == (None, None, None)
    else:
        i = TIERS.index(choice.tier)
        picked = Holding(choice.source, choice.step)
        assert picked in by_tier[choice.tier]                                  # a real, complete copy
        assert usable(choice.tier, picked, committed)
        assert choice.steps_lost == committed - choice.step >= 0
        assert not any(usable(t, h, committed) for t in TIERS[:i] for h in by_tier[t])   # no cheaper tier had one
        assert all((-h.step, h.source) >= (-choice.step, choice.source)                  # the newest, then the
                   for h in by_tier[choice.tier] if usable(choice.tier, h, committed))   # smallest source
    # the order of the input does not matter, and neither do copies that cannot be used
    rng = random.Random(seed)
    shuffled = [rng.sample(list(hs), len(hs)) for hs in tiers]
    noise = [list(hs) + [Holding("z", committed + 1), Holding("a", committed, complete=False)] for hs in shuffled]
    assert choose_source(*shuffled, committed) == choice
    again = choose_source(*noise, committed)
    assert (again.tier, again.source, again.step) == (choice.tier, choice.source, choice.step)


@given(st.dictionaries(st.sampled_from(["w0", "w1", "w2"]), st.integers(0, 5)), st.integers(0, 5))
def test_a_mapping_means_complete_holdings(replicas, committed):
    as_holdings = [Holding(s, n) for s, n in replicas.items()]
    assert choose_source(replicas, replicas, {}, {}, committed) == choose_source(as_holdings, as_holdings, [], [],
                                                                                  committed)


def test_a_pipelined_restore_takes_the_newest_step_every_stage_holds():
    from runtime.control.tiers import stage_snapshot

    held = [{"a": (2, 4), "b": (4,)}, {"c": (2,), "d": (2, 6)}]   # stage 0: a, b; stage 1: c, d
    assert stage_snapshot(held, 10) == (2, ("a", "c"))   # stage 1 holds no 4; 6 is stage 1's only
    assert stage_snapshot([{"a": (2, 4), "b": (4,)}, {"c": (4,)}], 10) == (4, ("a", "c"))
    assert stage_snapshot([{"a": (2, 4)}, {"c": (2, 4)}], 3) == (2, ("a", "c"))   # none after the committed step
    assert stage_snapshot([{"a": (4,)}, {"c": (2,)}], 10) is None
    assert stage_snapshot([{"a": (4,)}, {}], 10) is None   # a stage with no worker holding any
