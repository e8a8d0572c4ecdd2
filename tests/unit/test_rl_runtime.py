"""The RL runtime's pieces without worker processes: the samplers' schedule (runtime.control.sampling) against a
fake group, weights versions held and pulled over real loopback data planes (runtime.worker.weights), and the
batches the client carries (runtime.wire.batches)."""

import json
import socket
import types

import grpc
import ml_dtypes
import numpy as np
import pytest

from runtime._proto import elastic_pb2 as pb
from runtime.control.plan import Action, Failure, plan_sampler_loss
from runtime.control.run_state import RunState
from runtime.control.sampling import Sampling, split, weights_version
from runtime.core.event_kinds import check_event
from runtime.core.errors import ProtocolError, StaleEpochError, StateLostError
from runtime.core.programs import SamplerPrograms
from runtime.state.state_copy import state_digest
from runtime.wire import auth, rpc
from runtime.wire.batches import decode_batch, encode_batch
from runtime.wire.dataplane import DataServer
from runtime.wire.dataplane_client import DataClient
from runtime.wire.peers import PeerChannels
from runtime.worker.weights import WeightOutbox, cast_weights, pull_weights
from tests.support.fake_group import FakeGroup

FENCE = pb.Fence(run_id="r", epoch=1)
SECRET = "s3cret"


# -- pure rules ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("step, off, version", [(0, 0, 0), (5, 0, 5), (0, 1, 0), (1, 1, 0), (5, 1, 4)])
def test_a_steps_rollouts_use_the_weights_of_off_policy_steps_before(step, off, version):
    assert weights_version(step, off) == version


@pytest.mark.parametrize("items, parts, expected", [
    ([0, 1, 2, 3], 2, [[0, 1], [2, 3]]),
    ([0, 1, 2], 2, [[0, 1], [2]]),
    ([5], 3, [[5]]),
    ([0, 1, 2, 3], 1, [[0, 1, 2, 3]]),
])
def test_missing_microbatches_split_into_contiguous_even_runs(items, parts, expected):
    assert split(items, parts) == expected


# -- the batches the client carries -------------------------------------------------------------------------

def test_a_batch_comes_back_bit_exact_and_only_with_the_programs_keys():
    arrays = {"prompts": np.arange(12, dtype=np.int32).reshape(3, 4), "logprobs": np.linspace(-3, 0, 6, dtype=np.float32),
              "rewards": np.ones(3, np.float32)}
    b = encode_batch(7, 2, 5, arrays)
    assert (b.step, b.microbatch, b.version) == (7, 2, 5)
    back = decode_batch(b)
    assert all(np.array_equal(back[k], v) and back[k].dtype == v.dtype for k, v in arrays.items())
    spec = {"prompts": ([3, 4], "<i4"), "logprobs": ([6], "<f4")}
    assert sorted(decode_batch(b, spec)) == ["logprobs", "prompts"]   # rewards are the report's, not the program's


@pytest.mark.parametrize("spec, needle", [
    ({"prompts": ([3, 4], "<i4"), "advantages": ([3], "<f4")}, "lacks ['advantages']"),
    ({"prompts": ([4, 3], "<i4")}, "'prompts' is (3, 4) int32, the program takes (4, 3) int32"),
])
def test_a_batch_that_does_not_fit_the_program_is_refused_naming_the_key(spec, needle):
    b = encode_batch(0, 0, 0, {"prompts": np.zeros((3, 4), np.int32)})
    with pytest.raises(ProtocolError, match=needle.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                       .replace("]", r"\]")):
        decode_batch(b, spec)


def test_a_batch_of_python_objects_or_the_wrong_size_is_refused():
    wrong = pb.FedBatch(step=0, microbatch=0, arrays=[pb.NamedArray(name="x", shape=[4], dtype="<f4", data=b"\0" * 8)])
    with pytest.raises(ProtocolError, match="is not \\(4,\\) float32"):
        decode_batch(wrong)
    objects = pb.FedBatch(step=0, microbatch=0, arrays=[pb.NamedArray(name="x", shape=[1], dtype="|O", data=b"\0" * 8)])
    with pytest.raises(ProtocolError):
        decode_batch(objects)


# -- weights versions ---------------------------------------------------------------------------------------

def test_an_outbox_keeps_the_newest_versions_and_names_what_it_holds():
    box = WeightOutbox(keep=2)
    for v in range(4):
        box.put(v, [np.full(3, v, np.float32)])
    assert box.versions() == [2, 3]
    leaves, digest = box.get(3)
    assert np.array_equal(leaves[0], np.full(3, 3, np.float32)) and digest == state_digest(leaves)
    with pytest.raises(StaleEpochError, match=r"version 1 is not held here \(held: \[2, 3\]\)"):
        box.get(1)


def test_the_weights_published_are_the_chosen_leaves_in_the_samplers_dtype():
    state = [np.arange(6, dtype=np.float32).reshape(2, 3), np.ones(4, np.float32), np.zeros(2, np.float32)]
    out = cast_weights(state, [0, 2], "bfloat16")
    assert [x.shape for x in out] == [(2, 3), (2,)] and all(x.dtype == ml_dtypes.bfloat16 for x in out)
    assert out[0].nbytes == state[0].nbytes // 2
    assert np.array_equal(cast_weights(state, [1], "")[0], state[1])
    with pytest.raises(ProtocolError, match="weights leaf 3 is not one of the state's 3 leaves"):
        cast_weights(state, [3], "")


class _Source:
    """A data server serving ``box``'s weights versions (as a trainer's or a sampler's worker does)."""

    def __init__(self, box):
        self.box = box
        self.server = DataServer("127.0.0.1", secret=SECRET, tls=None, status_name=rpc.status_name,
                                 on_push=lambda chunks: None, on_state=self.state, refusals=auth.Refusals(),
                                 dropped=lambda: False)

    def state(self, request):
        assert request.weights
        return self.box.parts(request.weights_version, 1024)

    def peer(self):
        return pb.Peer(address="127.0.0.1:1", data_address=self.server.address)


def test_a_sampler_pulls_a_version_whole_from_the_first_source_that_has_it():
    leaves = [np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32), np.arange(5, dtype=np.float32)]
    old, new = WeightOutbox(), WeightOutbox()
    old.put(3, [x * 0 for x in leaves])
    new.put(4, leaves)
    with socket.socket() as s:   # nothing listens here: a source lost before the pull
        s.bind(("127.0.0.1", 0))
        gone = pb.Peer(address="127.0.0.1:1", data_address=f"127.0.0.1:{s.getsockname()[1]}")
    a, b = _Source(old), _Source(new)
    data = DataClient(SECRET, None)
    try:
        layout = [(x.shape, x.dtype) for x in leaves]
        request = pb.SyncWeightsRequest(fence=FENCE, version=4, sources=[gone, a.peer(), b.peer()],
                                        expected_digest=state_digest(leaves))
        got, digest, reply = pull_weights(request, layout, data=data, peers=PeerChannels(SECRET, None), timeout=5.0)
        assert all(np.array_equal(x, y) for x, y in zip(got, leaves)) and digest == state_digest(leaves)
        assert reply.version == 4 and reply.bytes == sum(x.nbytes for x in leaves)
        assert reply.source == "127.0.0.1:1" and len(reply.failed) == 2
        assert "version 4 is not held here (held: [3])" in reply.failed[1]
        with pytest.raises(StaleEpochError, match="no source sent weights version 5"):
            pull_weights(pb.SyncWeightsRequest(fence=FENCE, version=5, sources=[a.peer(), b.peer()]), layout,
                         data=data, peers=PeerChannels(SECRET, None), timeout=5.0)
        wrong = pb.SyncWeightsRequest(fence=FENCE, version=4, sources=[b.peer()], expected_digest="xxh3_128:00")
        with pytest.raises(StaleEpochError, match="expected xxh3_128:00"):
            pull_weights(wrong, layout, data=data, peers=PeerChannels(SECRET, None), timeout=5.0)
    finally:
        data.close()
        a.server.close()
        b.server.close()


# -- the samplers' schedule ---------------------------------------------------------------------------------

class _Events:
    """The run's event log and its ledger as sampling sees them: each event checked against its kind, kept, and
    folded into the run state (placed on trainers ``w0`` and ``w1``)."""

    def __init__(self, trainers=("w0", "w1")):
        self.emitted = []
        self.state = RunState().apply({"kind": "placement", "epoch": 1, "active": list(trainers), "spares": []})

    def emit(self, kind, **fields):
        check_event({"t": 0.0, "kind": kind, **fields})
        self.emitted.append((kind, fields))
        self.state = self.state.apply(json.loads(json.dumps({"kind": kind, **fields})))


def _sampling(samplers=2, off=0, microbatches=4):
    opts = types.SimpleNamespace(rl_samplers=samplers, rl_off_policy_steps=off, register_timeout_seconds=1.0,
                                 relaunch=True, max_retries=3, launcher="local")
    programs = SamplerPrograms(rollout=b"", layout={"num_microbatches": microbatches}, prompts=b"",
                               weight_leaves=(0,))
    events = _Events()
    group = _group(opts, events)
    sampling = Sampling(group, opts, events, programs, events)
    sampling.start(["w0", "w1"], seed=0)
    return sampling, group, events


def _group(opts, events, publish_version=0, held=()):
    """The one fake group, its samplers numbered from s10, its trainers answering ``publish_version`` and
    ``held`` to a PublishWeights."""
    group = FakeGroup(types.SimpleNamespace(snapshot_interval=0, **vars(opts)), events, first_worker=10)
    group.publish_version, group.held_versions = publish_version, tuple(held)
    return group


def _answer_syncs(group):
    for w, r, f in group.open("SyncWeights"):
        f.answer(pb.SyncWeightsReply(version=r["version"], bytes=8, source=r["sources"][0]))


def _answer_rollouts(group, only=None):
    for w, r, f in group.open("Rollout"):
        if only is None or w in only:
            f.answer(pb.RolloutReply(batches=[encode_batch(r["step"], m, r["version"],
                                                           {"rewards": np.ones(2, np.float32)})
                                              for m in r["microbatches"]]))


def test_on_policy_a_step_is_sampled_only_with_the_weights_its_previous_step_made():
    sampling, group, _ = _sampling(off=0)
    sampling.pump(committed=0, steps=3, dead={})
    syncs = group.open("SyncWeights")
    assert [(w, r["version"]) for w, r, _ in syncs] == [("s10", 0), ("s11", 0)]
    assert syncs[0][1]["sources"] == ["w0", "w1"]   # rotated per sampler:
    assert syncs[1][1]["sources"] == ["w1", "w0"]   # the syncs spread over the trainers
    _answer_syncs(group)
    sampling.pump(committed=0, steps=3, dead={})
    rollouts = group.open("Rollout")
    assert [(w, r["step"], r["microbatches"], r["version"]) for w, r, _ in rollouts] == [
        ("s10", 0, [0, 1], 0), ("s11", 0, [2, 3], 0)]
    _answer_rollouts(group)
    sampling.pump(committed=0, steps=3, dead={})
    assert sampling.ready(0) and not sampling.ready(1)
    assert not group.open("Rollout") and not group.open("SyncWeights")   # step 1 waits for version 1
    sampling.committed(0, ["w0", "w1"])
    sampling.pump(committed=1, steps=3, dead={})
    assert [(w, r["version"]) for w, r, _ in group.open("SyncWeights")] == [("s10", 1), ("s11", 1)]


def test_off_policy_the_next_step_is_sampled_while_this_one_trains():
    sampling, group, _ = _sampling(off=1)
    sampling.pump(committed=0, steps=5, dead={})
    _answer_syncs(group)
    sampling.pump(committed=0, steps=5, dead={})
    assert [(r["step"], r["version"]) for _, r, _ in group.open("Rollout")] == [(0, 0), (0, 0)]
    _answer_rollouts(group)
    sampling.pump(committed=0, steps=5, dead={})   # step 1 uses version 0 too: made before step 0 commits
    assert [(r["step"], r["version"]) for _, r, _ in group.open("Rollout")] == [(1, 0), (1, 0)]


def test_a_lost_samplers_microbatches_go_to_the_others_and_a_fresh_one_is_launched():
    sampling, group, events = _sampling(off=0)
    sampling.pump(committed=0, steps=2, dead={})
    _answer_syncs(group)
    sampling.pump(committed=0, steps=2, dead={})
    _answer_rollouts(group, only={"s10"})   # s11 dies before it answers microbatches 2 and 3
    for w, r, f in group.open("Rollout"):
        f.answer(error=grpc.FutureCancelledError())
    plan = plan_sampler_loss(events.state, sampling.opts, "s11")   # the planner's, as the controller asks it
    assert plan.action is Action.REASSIGN and plan.retired == ("s11",) and plan.placement is events.state.placement
    assert [(x.replaces, x.role, x.host) for x in plan.launches] == [("s11", "sampler", "")]
    sampling.forget("s11")
    group.relaunch(plan.launches[0])
    dead = {"s11": "killed"}
    sampling.pump(committed=0, steps=2, dead=dead)
    assert [(w, r["microbatches"]) for w, r, _ in group.open("Rollout")] == [("s10", [2, 3])]
    assert ("worker_relaunched", {"replaces": "s11", "worker": "s12", "host": "", "role": "sampler"}) in events.emitted
    _answer_rollouts(group)
    sampling.pump(committed=0, steps=2, dead=dead)
    assert sampling.ready(0) and sorted(sampling.feed(0).batches) == [0, 1, 2, 3]
    assert [k for k, _ in events.emitted].count("rollouts_made") == 1
    load = group.open("Load")   # the fresh sampler loads its program, then joins
    assert [w for w, _, _ in load] == ["s12"]
    load[0][2].answer(pb.LoadReply())
    sampling.pump(committed=0, steps=2, dead=dead)
    assert "s12" in sampling.live and ("sampler_joined", {"worker": "s12"}) in events.emitted


def test_a_step_commits_its_rewards_and_version_once():
    sampling, group, events = _sampling(off=0)
    sampling.pump(committed=0, steps=1, dead={})
    _answer_syncs(group)
    sampling.pump(committed=0, steps=1, dead={})
    _answer_rollouts(group)
    sampling.pump(committed=0, steps=1, dead={})
    sampling.committed(0, ["w0", "w1"])
    [(kind, fields)] = [e for e in events.emitted if e[0] == "rl_step"]
    assert fields["step"] == 0 and fields["version"] == 0 and fields["mean_reward"] == 1.0
    assert not sampling.ready(0) and events.state.weights == {"w0": (0, 1), "w1": (0, 1), "s10": (0,), "s11": (0,)}


def test_with_every_sampler_lost_and_none_on_the_way_the_run_is_starved():
    sampling, group, events = _sampling(samplers=1)
    sampling.opts.relaunch = False
    plan = plan_sampler_loss(events.state, sampling.opts, "s10")
    assert plan.action is Action.FAIL and plan.failure is Failure.CAPACITY and not plan.launches
    sampling.forget("s10")
    assert sampling.starved({"s10": "killed"})


def _exported() -> bytes:
    """A real exported program (what a restarted client fingerprints to re-attach its samplers)."""
    import jax
    import jax.numpy as jnp

    return bytes(jax.export.export(jax.jit(lambda x: x + 1))(jax.ShapeDtypeStruct((2,), jnp.float32)).serialize())


def test_a_restarted_client_learns_the_older_versions_the_trainers_hold_and_samplers_move_back_to_one():
    """One step off-policy, the new client stands at version 14; step 14 needs version 13, which the trainers'
    outboxes still hold (PublishWeightsReply.held): the samplers sync to 13, not to the newest."""
    opts = types.SimpleNamespace(rl_samplers=2, rl_off_policy_steps=1, register_timeout_seconds=1.0, relaunch=True,
                                 max_retries=3)
    programs = SamplerPrograms(rollout=_exported(), layout={"num_microbatches": 4}, prompts=b"", weight_leaves=(0,))
    events = _Events()
    group = _group(opts, events, publish_version=14, held=(12, 13, 14))
    sampling = Sampling(group, opts, events, programs, events)
    sampling.reattach({"s2": None, "s3": None}, seed=0)
    sampling.trainers_changed(["w0", "w1"])
    sampling.pump(committed=14, steps=30, dead={})
    assert [(w, r["version"]) for w, r, _ in group.open("SyncWeights")] == [("s2", 13), ("s3", 13)]


def test_a_version_an_uncommitted_step_needs_held_nowhere_fails_the_run_in_one_line():
    opts = types.SimpleNamespace(rl_samplers=1, rl_off_policy_steps=1, register_timeout_seconds=1.0, relaunch=True,
                                 max_retries=3)
    programs = SamplerPrograms(rollout=_exported(), layout={"num_microbatches": 4}, prompts=b"", weight_leaves=(0,))
    events = _Events(trainers=("w0",))
    sampling = Sampling(_group(opts, events, publish_version=14, held=(14,)), opts, events, programs, events)
    sampling.reattach({"s2": None}, seed=0)
    sampling.trainers_changed(["w0"])
    with pytest.raises(StateLostError, match="step 14's rollouts need weights version 13") as err:
        sampling.pump(committed=14, steps=30, dead={})
    assert "\n" not in str(err.value)


def test_a_step_committed_without_its_rollouts_here_records_the_rules_version_and_no_reward():
    """A restarted client commits a step from its workers' reports: the rollouts were an earlier client's."""
    sampling, _, events = _sampling(off=1)
    sampling.committed(7, ["w0", "w1"])
    [(kind, fields)] = [e for e in events.emitted if e[0] == "rl_step"]
    assert fields["version"] == 6 and "mean_reward" not in fields and fields["rollout_bytes"] == 0


def test_a_sampler_that_answers_but_cannot_sync_is_replaced_after_three_failures_in_a_row():
    sampling, group, _ = _sampling(samplers=1)
    refused = grpc.RpcError()
    for attempt in range(3):
        sampling.pump(committed=0, steps=1, dead={})   # takes the last failure in; tries again after a pause
        sampling._retry_at.clear()
        sampling.pump(committed=0, steps=1, dead={})
        [(w, r, f)] = group.open("SyncWeights")
        f.answer(error=refused)
        assert not group.dead
    sampling.pump(committed=0, steps=1, dead={})
    assert list(group.dead) == ["s10"] and sampling.last_error.startswith("sync on s10")


def test_a_restarted_client_reads_who_holds_which_weights_version_from_the_log():
    """One step off-policy. The dead client's log says the trainers hold versions up to 9 and each sampler has 9
    installed; the trainers applied step 9 after it died, so the restarted client commits step 9 from their
    reports, and step 10's rollouts need version 9: the samplers make them with it at once (the dead client's
    facts were the client's memory alone, and the run failed 'every trainer and sampler that held it was lost')."""
    old = _Events()
    old.emit("weights_published", version=8, workers=["w0", "w1"], bytes=8, held={"w0": [6, 7, 8], "w1": [7, 8]})
    old.emit("rl_step", step=8, version=7, trainers=["w0", "w1"], rollout_seconds=0.0, rollout_bytes=0)
    for s in ("s2", "s3", "s4"):
        old.emit("weights_synced", worker=s, version=9, bytes=8, seconds=0.0, source="w0")
    old.emit("worker_dead", worker="s4", reason="killed", cause="crash")
    assert old.state.weights == {"w0": (7, 8, 9), "w1": (7, 8, 9), "s2": (9,), "s3": (9,)}
    new = _Events()
    new.state = RunState.replay([{"kind": "placement", "epoch": 1, "active": ["w0", "w1"], "spares": []},
                                 *({"kind": k, **f} for k, f in old.emitted)])
    opts = types.SimpleNamespace(rl_samplers=2, rl_off_policy_steps=1, register_timeout_seconds=1.0, relaunch=True,
                                 max_retries=3)
    programs = SamplerPrograms(rollout=_exported(), layout={"num_microbatches": 4}, prompts=b"", weight_leaves=(0,))
    group = _group(opts, new)
    sampling = Sampling(group, opts, new, programs, new)
    sampling.reattach({"s2": None, "s3": None}, seed=0)
    sampling.committed(9, ["w0", "w1"])   # from the trainers' reports: they hold version 10 now
    sampling.pump(committed=10, steps=30, dead={})
    assert [(w, r["step"], r["version"]) for w, r, _ in group.open("Rollout")] == [("s2", 10, 9), ("s3", 10, 9)]
    assert new.state.weights["w0"] == (8, 9, 10)


def test_a_sampler_installs_the_version_it_is_asked_for_even_an_older_one():
    """A restarted client's first step may need the version before the one a sampler installed last (the dead
    client had it sample a step ahead): the sampler installs it and samples with it (it refused to go back, so its
    rollouts were refused until it was declared dead)."""
    import jax
    import jax.numpy as jnp

    from runtime.worker.sampler import Sampler

    def rollout(w, prompts, seed, step, microbatch):
        return {"out": prompts * w[0] + step}

    exported = jax.export.export(jax.jit(rollout))([jax.ShapeDtypeStruct((2,), jnp.int32)],
                                                   jax.ShapeDtypeStruct((2,), jnp.int32),
                                                   *[jax.ShapeDtypeStruct((), jnp.int32)] * 3)
    layout = {"devices_per_slice": 1, "weights": [[[2], "int32", None]], "prompt": [[2], "int32"],
              "outputs": [["out", [2], "int32"]], "num_microbatches": 1}
    source = types.SimpleNamespace(prompts=lambda step, m: np.ones(2, np.int32))
    sampler = Sampler(layout, {"rollout": bytes(exported.serialize())}, source, jax.devices()[:1])
    sampler.load()
    for v in (5, 4):
        sampler.install(v, [np.full(2, v, np.int32)], f"d{v}")
    [batch] = sampler.rollout(3, [0], 4, seed=0)
    assert sampler.version == 4 and batch.version == 4
    assert list(decode_batch(batch)["out"]) == [7, 7] and sampler.outbox.versions() == [4, 5]
