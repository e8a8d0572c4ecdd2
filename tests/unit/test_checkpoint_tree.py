"""runtime/state/checkpoint_tree.py and the stores' use of it: a checkpoint's state as a named tree, with real orbax.

A store given a tree writes MaxText's layout (orbax item ``items``, beside
jax-elastic's record ``meta``) and reads it back bit for bit; a checkpoint
another program wrote in that layout (``items`` alone, the directory named
one step before the state it holds, as MaxText's trainer names them) is
listed under the step it holds and read with the tree.
"""

import json

import numpy as np
import orbax.checkpoint as ocp
import pytest

from runtime.control.checkpointing import locate_checkpoint
from runtime.state.checkpoint import CheckpointStore
from runtime.state.checkpoint_record import CheckpointCorruptError
from runtime.state.checkpoint_tree import CheckpointTree, from_items, to_items
from runtime.state.state_copy import state_digest
from runtime.worker.worker_state import loss_sums

KEY_IMPL = "threefry2x32"   # key data: uint32[..., 2]

# A train state as the runtime holds it: flat leaves (a PRNG key as its data, the step as NNX's uint32).
LAYOUT = [((3, 2), np.dtype(np.float32)), ((), np.dtype(np.uint32)), ((2,), np.dtype(np.uint32)),
          ((0,), np.dtype(np.float32)), ((3, 2), np.dtype(np.float32))]
TREE = CheckpointTree(
    {"params": {"params": {"w": 0}}, "step": 1, "nnx_aux": {"rngs": {"key": 2}},
     "opt_state": [{"mu": {"params": {"w": 4}}}, None, {"empty": 3}]},
    ((None, None), ("int32", None), (None, KEY_IMPL), (None, None), (None, None)),
    step_path=("step",))


def leaves(step: int) -> list[np.ndarray]:
    rng = np.random.default_rng(step)
    return [rng.standard_normal((3, 2), dtype=np.float32), np.array(step, np.uint32),
            np.array([7, step], np.uint32), np.empty((0,), np.float32), rng.standard_normal((3, 2), dtype=np.float32)]


def write_theirs(directory, name: int, state: list[np.ndarray]) -> None:
    """A checkpoint as MaxText's trainer writes one: only ``items`` (typed keys, the step as int32)."""
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckpt:
        ckpt.save(directory / str(name), args=ocp.args.Composite(items=ocp.args.PyTreeSave(to_items(state, TREE))))


def test_a_tree_places_every_leaf_once_and_names_what_is_wrong():
    with pytest.raises(ValueError, match=r"missing \[1\], twice \[0\]"):
        CheckpointTree({"a": 0, "b": 0}, ((None, None), (None, None)))
    with pytest.raises(ValueError, match="keys are strings"):
        CheckpointTree({1: 0}, ((None, None),))
    with pytest.raises(ValueError, match="leaf indices, got 'x' at a/b"):
        CheckpointTree({"a": {"b": "x"}}, ((None, None),))
    assert CheckpointTree.from_json(json.loads(json.dumps(TREE.to_json()))) == TREE
    with pytest.raises(ValueError, match="not a checkpoint tree"):
        CheckpointTree.from_json({"leaves": []})


def test_a_tree_named_by_pytree_paths_places_each_leaf_at_its_path_or_is_none():
    tree = CheckpointTree.named([("params", "w"), ("opt_state", 0, "mu", "w"), ("opt_state", 2)])
    assert tree.skeleton == {"params": {"w": 0}, "opt_state": [{"mu": {"w": 1}}, None, 2]}   # place 1: an empty node
    assert CheckpointTree.named([("a",), ("a", "b")]) is None          # a leaf where another path goes on
    assert CheckpointTree.named([("a", 0), ("a", "b")]) is None        # a dict and a list at once
    assert CheckpointTree.named([("a.b",), ("a", "b")]) is None        # orbax would write both as a.b


def test_items_hold_each_leaf_at_its_place_in_its_stored_dtype_and_come_back_as_they_were():
    state = leaves(5)
    items = to_items(state, TREE)
    assert items["opt_state"][1] is None and items["opt_state"][2]["empty"] is None   # orbax writes no empties
    assert items["step"].dtype == np.int32 and items["step"].shape == () and int(items["step"]) == 5
    assert str(items["nnx_aux"]["rngs"]["key"].dtype) == "key<fry>"
    back = from_items(items, TREE, LAYOUT)
    assert [(x.shape, x.dtype) for x in back] == [(tuple(s), d) for s, d in LAYOUT]
    assert state_digest(back) == state_digest(state)
    with pytest.raises(ValueError, match="no params/params/w"):
        from_items({**items, "params": {"params": {}}}, TREE, LAYOUT)
    with pytest.raises(ValueError, match=r"opt_state/0/mu/params/w is float32\[2, 3\]"):
        bad = {**items, "opt_state": [{"mu": {"params": {"w": np.zeros((2, 3), np.float32)}}}, None, {}]}
        from_items(bad, TREE, LAYOUT)


def test_a_store_with_a_tree_writes_the_named_layout_beside_its_record_and_reads_it_back(tmp_path):
    store = CheckpointStore(str(tmp_path / "ckpt"), tree=TREE, async_save=False)
    state = leaves(4)
    store.save(4, state, digest=state_digest(state), metadata={"fingerprint": "f"})
    assert sorted(p.name for p in (tmp_path / "ckpt" / "4").iterdir() if p.is_dir()) == ["items", "meta"]
    step, back, digest, meta = CheckpointStore(str(tmp_path / "ckpt")).restore(4)   # the record holds the tree
    assert (step, digest, meta["fingerprint"]) == (4, state_digest(state), "f")
    # Another reader of orbax's pytree sees MaxText's names, the step as int32 and the key typed.
    theirs = ocp.PyTreeCheckpointer().restore(tmp_path / "ckpt" / "4" / "items")
    assert int(theirs["step"]) == 4 and theirs["step"].dtype == np.int32
    np.testing.assert_array_equal(np.asarray(theirs["params"]["params"]["w"]), state[0])
    assert str(theirs["nnx_aux"]["rngs"]["key"].dtype) == "key<fry>"


def test_a_checkpoint_another_program_wrote_is_listed_under_the_step_it_holds_and_read_with_the_tree(tmp_path):
    directory = tmp_path / "ckpt"
    write_theirs(directory, 3, leaves(4))   # MaxText's <3>: the state after step 3, i.e. 4 applied steps
    mine = CheckpointStore(str(directory), tree=TREE, layout=LAYOUT, async_save=False)
    state = leaves(6)
    mine.save(6, state, digest=state_digest(state))
    assert mine.steps() == [4, 6] == CheckpointStore(str(directory)).steps()   # a listing needs no tree
    step, back, digest, meta = mine.restore(4)
    assert step == 4 and digest == state_digest(leaves(4)) and meta["written_by"] == "another program"
    assert mine.restore_newest_valid(at_most=5)[0].step == 4
    with pytest.raises(CheckpointCorruptError, match="no jax-elastic record"):
        CheckpointStore(str(directory)).restore(4)
    assert locate_checkpoint(str(directory / "3" / "items")) == (str(directory), 4)   # MaxText's <step>/items form
    assert locate_checkpoint(str(directory / "3")) == (str(directory), 4)
    assert locate_checkpoint(str(directory)) == (str(directory), 6)


def test_a_foreign_checkpoint_whose_step_leaf_disagrees_with_its_directory_is_passed_over(tmp_path):
    directory = tmp_path / "ckpt"
    write_theirs(directory, 1, leaves(2))   # holds step 2 under <1>: right
    write_theirs(directory, 7, leaves(3))   # holds step 3 under <7>: not the state after step 7
    store = CheckpointStore(str(directory), tree=TREE, layout=LAYOUT)
    (restored, skipped) = store.restore_newest_valid()
    assert restored.step == 2 and [(s.step, "holds step 3" in s.reason) for s in skipped] == [(8, True)]


def test_loss_sums_unknown_to_the_controller_are_not_recorded():
    assert loss_sums([1.0, float("nan")], {2: 3.0}, 2) == []   # a run resumed from a checkpoint without them
    assert loss_sums([1.0, 2.0], {2: 3.0}, 2) == [1.0, 2.0, 3.0]


def test_parameters_are_read_alone_from_a_full_or_a_parameter_only_checkpoint(tmp_path):
    from etils import epath

    from runtime.state.checkpoint_orbax import read_parameters

    state = leaves(4)
    CheckpointStore(str(tmp_path / "full"), tree=TREE, async_save=False).save(4, state, digest=state_digest(state))
    got = read_parameters(epath.Path(tmp_path / "full" / "4"), TREE, LAYOUT)
    assert list(got) == [0] and np.array_equal(got[0], state[0])   # params/params/w only: not opt_state's w
    weights = np.arange(6, dtype=np.float32).reshape(3, 2)   # MaxText's parameter-only checkpoint: items/params
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckpt:
        ckpt.save(tmp_path / "params", args=ocp.args.Composite(
            items=ocp.args.PyTreeSave({"params": {"params": {"w": weights}}})))
    assert np.array_equal(read_parameters(epath.Path(tmp_path / "params"), TREE, LAYOUT)[0], weights)
    with pytest.raises(CheckpointCorruptError, match="no 'params' subtree"):
        read_parameters(epath.Path(tmp_path / "params"), CheckpointTree({"w": 0}, ((None, None),)), LAYOUT[:1])
    with pytest.raises(CheckpointCorruptError, match="holds no 'items' tree"):
        read_parameters(epath.Path(tmp_path), TREE, LAYOUT)
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckpt:   # the right name, the wrong shape
        ckpt.save(tmp_path / "bad", args=ocp.args.Composite(
            items=ocp.args.PyTreeSave({"params": {"params": {"w": np.zeros((2, 2), np.float32)}}})))
    with pytest.raises(CheckpointCorruptError, match=r"params/params/w is float32\[2, 2\]"):
        read_parameters(epath.Path(tmp_path / "bad"), TREE, LAYOUT)


def test_load_parameters_path_is_refused_in_one_line_when_a_fresh_start_could_not_read_it(tmp_path):
    import types

    from elastic import ConfigError
    from elastic.preflight import check_load_parameters_path

    named = types.SimpleNamespace(checkpoint_tree=TREE.to_json())
    flat = types.SimpleNamespace(checkpoint_tree=None)
    state = leaves(4)
    CheckpointStore(str(tmp_path / "ckpt"), tree=TREE, async_save=False).save(4, state, digest=state_digest(state))
    check_load_parameters_path(str(tmp_path / "ckpt" / "4"), named)            # a step of a named checkpoint
    check_load_parameters_path(str(tmp_path / "ckpt" / "4" / "items"), named)  # MaxText's form of it
    check_load_parameters_path("", flat)                                       # nothing asked
    with pytest.raises(ConfigError, match="load_parameters_path: this model's checkpoints name no parameters"):
        check_load_parameters_path(str(tmp_path / "ckpt" / "4"), flat)
    with pytest.raises(ConfigError, match=r"load_parameters_path '.*ckpt' holds no 'items' tree"):
        check_load_parameters_path(str(tmp_path / "ckpt"), named)
    with pytest.raises(ConfigError, match="does not exist"):
        check_load_parameters_path(str(tmp_path / "nowhere"), named)
    # A run that resumes its own checkpoints never reads it (as MaxText): nothing to refuse.
    check_load_parameters_path(str(tmp_path / "nowhere"), named, str(tmp_path / "ckpt"), 10)


def test_the_bundled_models_checkpoints_name_its_parameters_so_a_later_run_starts_from_them(tmp_path):
    # `elastic run tiny enable_checkpointing=true run_name=a`, then `... load_parameters_path=<a's checkpoints>`:
    # b's parameters are a's, its optimizer state its own fresh one (MaxText's load_parameters_path).
    import elastic
    from elastic.cli_support import bundled_trainer
    from elastic.options import parameters_path
    from elastic.preflight import check_load_parameters_path
    from runtime.worker.reference import LocalRun
    from runtime.worker.worker_state import with_parameters

    cfg = elastic.load_config("tiny", ["dcn_data_parallelism=1", "ici_fsdp_parallelism=1", "elastic_microbatches=2",
                                       f"base_output_directory={tmp_path}"])
    programs = bundled_trainer(cfg).programs()
    tree = CheckpointTree.from_json(programs.checkpoint_tree)
    assert tree.skeleton["params"]["layer_0"]["qkv"] == 7 and "mu" in tree.skeleton["opt_state"][0]
    a = LocalRun(programs, None)
    a.load()
    a.init(1)
    (ex,) = a.stages
    trained = [x + 1 for x in ex.host_state()]   # any state other than b's own init
    CheckpointStore(str(tmp_path / "ckpt"), tree=tree, async_save=False).save(
        3, trained, digest=state_digest(trained))
    assert parameters_path(str(tmp_path / "ckpt")) == str(tmp_path / "ckpt" / "3")   # a directory: its newest
    check_load_parameters_path(parameters_path(str(tmp_path / "ckpt")), programs)   # not refused
    b = LocalRun(programs, None)
    b.load()
    b.init(0)
    fresh = b.stages[0].host_state()
    got, _ = with_parameters(b.stages[0], str(tmp_path / "ckpt" / "3"))
    params = set(leaf_indices(tree.skeleton["params"]))
    assert params == set(range(16))   # the 4 + 2 x 6 weights; adam's count, mu and nu are the rest
    for i, x in enumerate(got):
        np.testing.assert_array_equal(x, trained[i] if i in params else fresh[i])


def leaf_indices(node):
    if isinstance(node, dict):
        return [i for v in node.values() for i in leaf_indices(v)]
    if isinstance(node, list):
        return [i for v in node for i in leaf_indices(v)]
    return [] if node is None else [node]
