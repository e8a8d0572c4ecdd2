"""Unit tests for elastic.data: determinism, pickling, spec checks, grain adapter."""

import hashlib
import os
import pickle
import subprocess
import sys
from pathlib import Path

import cloudpickle
import grain
import grain.python as pygrain
import numpy as np
import pytest

from elastic.data import DataSource, FunctionSource, GrainSource, check_batch
from elastic.models import SyntheticTokens


def _square_fn(step, m):
    x = np.full((2, 3), step * 10 + m, np.float32)
    return {"x": x, "y": np.arange(2, dtype=np.int32) + m}


_SPEC = {"x": ((2, 3), np.float32), "y": ((2,), np.int32)}


def _to_record(i):
    return {"tok": np.full((4,), i, np.int32), "label": i}


def _records(n):
    return [_to_record(i) for i in range(n)]


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes(), k


SOURCES = {
    "synthetic": lambda: SyntheticTokens(7, 64, 16, 4),
    "function": lambda: FunctionSource(_square_fn, _SPEC),
    "grain_list": lambda: GrainSource(_records(10), 3, 4, shuffle_seed=5),
}


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_batch_is_pure_function_of_step_and_microbatch(name):
    a, b = SOURCES[name](), SOURCES[name]()
    assert isinstance(a, DataSource)
    _assert_same(a.batch(3, 1), b.batch(3, 1))
    _assert_same(a.batch(3, 1), a.batch(3, 1))  # repeated calls, any order
    assert any(a.batch(3, 1)[k].tobytes() != a.batch(3, 2)[k].tobytes() for k in a.element_spec())
    for key, (shape, dtype) in a.element_spec().items():
        assert a.batch(0, 0)[key].shape == shape and a.batch(0, 0)[key].dtype == dtype


@pytest.mark.parametrize("name", sorted(SOURCES))
@pytest.mark.parametrize("dumps", [pickle.dumps, cloudpickle.dumps])
def test_pickle_round_trip(name, dumps):
    src = SOURCES[name]()
    src.batch(5, 0)  # warm any cache before shipping
    copy = pickle.loads(dumps(src))
    _assert_same(copy.batch(5, 0), src.batch(5, 0))
    assert copy.element_spec() == src.element_spec()


def test_function_source_lambda_round_trips_with_cloudpickle():
    src = FunctionSource(lambda s, m: {"a": np.array([s, m], np.int64)}, {"a": ((2,), np.int64)})
    copy = pickle.loads(cloudpickle.dumps(src))
    np.testing.assert_array_equal(copy.batch(4, 2)["a"], [4, 2])


@pytest.mark.parametrize(
    "fn, match",
    [
        (lambda s, m: {"x": np.zeros((2, 4), np.float32), "y": np.zeros(2, np.int32)}, r"'x'.*\(2, 3\).*\(2, 4\)"),
        (lambda s, m: {"x": np.zeros((2, 3), np.float32), "y": np.zeros(2, np.int64)}, r"'y'.*int32.*int64"),
        (lambda s, m: {"x": np.zeros((2, 3), np.float32)}, r"missing \['y'\]"),
        (lambda s, m: {**_square_fn(s, m), "z": np.zeros(1)}, r"unexpected \['z'\]"),
    ],
)
def test_function_source_spec_mismatch_names_key(fn, match):
    with pytest.raises(ValueError, match=match):
        FunctionSource(fn, _SPEC).batch(0, 0)


def test_negative_index_rejected():
    with pytest.raises(ValueError):
        FunctionSource(_square_fn, _SPEC).batch(-1, 0)


def test_check_batch_converts_to_numpy():
    out = check_batch({"y": [1, 2]}, {"y": ((2,), np.dtype(np.int64))})
    assert isinstance(out["y"], np.ndarray)


def test_grain_source_unshuffled_index_arithmetic_and_wraparound():
    src = GrainSource(_records(10), microbatch_size=3, microbatches=2)
    assert src.element_spec() == {"tok": ((3, 4), np.dtype(np.int32)), "label": ((3,), np.dtype(np.int64))}
    # step 1, microbatch 1 -> global indices 9, 10, 11 -> records 9, 0, 1
    np.testing.assert_array_equal(src.batch(1, 1)["label"], [9, 0, 1])
    np.testing.assert_array_equal(src.batch(1, 1)["tok"][:, 0], [9, 0, 1])


def test_grain_source_shuffle_is_a_per_epoch_permutation():
    n = 12
    src = GrainSource(_records(n), microbatch_size=2, microbatches=3, shuffle_seed=0)
    # 6 records per step: steps 0-1 are epoch 0, steps 2-3 epoch 1.
    epoch0 = np.concatenate([src.batch(s, m)["label"] for s in (0, 1) for m in range(3)])
    epoch1 = np.concatenate([src.batch(s, m)["label"] for s in (2, 3) for m in range(3)])
    assert sorted(epoch0) == list(range(n)) and sorted(epoch1) == list(range(n))
    assert list(epoch0) != list(range(n)) and list(epoch0) != list(epoch1)
    other = GrainSource(_records(n), microbatch_size=2, microbatches=3, shuffle_seed=1)
    assert list(other.batch(0, 0)["label"]) + list(other.batch(0, 1)["label"]) != list(epoch0[:4])


def test_grain_source_with_grain_range_source():
    # Scalar records become the single feature "value".
    src = GrainSource(pygrain.RangeDataSource(0, 20, 1), microbatch_size=4, microbatches=2)
    assert src.element_spec() == {"value": ((4,), np.dtype(np.int64))}
    np.testing.assert_array_equal(src.batch(1, 1)["value"], [12, 13, 14, 15])


def test_grain_source_with_grain_map_dataset():
    ds = grain.MapDataset.source(pygrain.RangeDataSource(0, 8, 1)).map(_to_record)
    src = GrainSource(ds, microbatch_size=2, microbatches=2, shuffle_seed=3)
    copy = pickle.loads(pickle.dumps(src))
    _assert_same(copy.batch(2, 1), src.batch(2, 1))
    labels = np.concatenate([src.batch(0, m)["label"] for m in range(2)] + [src.batch(1, m)["label"] for m in range(2)])
    assert sorted(labels) == list(range(8))


def test_grain_source_rejects_bad_arguments():
    with pytest.raises(ValueError):
        GrainSource([], 1, 1)
    with pytest.raises(ValueError):
        GrainSource(_records(3), 0, 1)


def _digest(src, step, m):
    return hashlib.sha256(b"".join(v.tobytes() for _, v in sorted(src.batch(step, m).items()))).hexdigest()


def test_same_bytes_in_another_process():
    srcs = [SyntheticTokens(7, 64, 16, 4), GrainSource(_records(10), 3, 4, shuffle_seed=5)]
    code = (
        "import hashlib, pickle, sys\n"
        "for src in pickle.load(sys.stdin.buffer):\n"
        "    b = src.batch(6, 3)\n"
        "    print(hashlib.sha256(b''.join(v.tobytes() for _, v in sorted(b.items()))).hexdigest())\n"
    )
    root = str(Path(__file__).resolve().parents[2])  # the child unpickles classes from elastic/
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    out = subprocess.run(
        [sys.executable, "-c", code], input=cloudpickle.dumps(srcs), capture_output=True, timeout=120, check=True, env=env
    )
    assert out.stdout.decode().split() == [_digest(s, 6, 3) for s in srcs]


def test_a_batch_that_is_not_a_dict_says_how_to_wrap_it():
    src = FunctionSource(lambda s, m: np.zeros((2, 3), np.float32), {"x": ((2, 3), np.float32)})
    with pytest.raises(ValueError, match=r"must be a dict of arrays, got ndarray; wrap one array as \{'x': array\}"):
        src.batch(0, 0)


@pytest.mark.parametrize("spec, message", [
    (((2, 3), np.float32), "element_spec must be a dict"),
    ({"x": (2, 3)}, r"element_spec\['x'\] must be \(shape tuple, dtype\)"),
])
def test_a_malformed_element_spec_says_what_it_must_be(spec, message):
    with pytest.raises(ValueError, match=message):
        FunctionSource(lambda s, m: {}, spec)
