"""Why a run ended, as types: each reason is its own error, picklable, and still an ElasticTrainingFailedError."""

import pickle

import pytest

import elastic
import runtime
from runtime import (BadInputError, CapacityExhaustedError, DeviceMismatchError, ElasticTrainingFailedError,
                     ReplicaDivergenceError, StateLostError)

REASONS = [CapacityExhaustedError, StateLostError, DeviceMismatchError, ReplicaDivergenceError, BadInputError]


@pytest.mark.parametrize("kind", REASONS)
def test_each_reason_round_trips_through_pickle_and_keeps_its_fields(kind):
    err = kind("cannot recover", step=7, cause="1 slices left")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is kind and str(back) == str(err)
    assert (back.message, back.step, back.cause) == ("cannot recover", 7, "1 slices left")


@pytest.mark.parametrize("kind", REASONS)
def test_each_reason_is_caught_as_the_base_and_says_what_to_do(kind):
    with pytest.raises(ElasticTrainingFailedError):
        raise kind("x")
    assert kind.advice.startswith("what to do:") and str(kind("x", cause="y")).endswith(f"({kind.advice})")


def test_the_reasons_tell_capacity_from_corrupt_numerics_from_bad_input():
    assert not issubclass(StateLostError, CapacityExhaustedError)   # capacity cannot bring lost state back
    assert issubclass(DeviceMismatchError, CapacityExhaustedError)   # workers that do not fit: capacity too
    assert not issubclass(ReplicaDivergenceError, CapacityExhaustedError)
    assert not issubclass(BadInputError, (CapacityExhaustedError, ReplicaDivergenceError))
    assert issubclass(BadInputError, ValueError)
    assert str(ElasticTrainingFailedError("m", step=2, cause="c")) == "m at step 2: c"   # the base says no more


def test_the_reasons_are_exported_where_callers_find_them():
    for kind in REASONS:
        assert kind.__name__ in runtime.__all__ and kind.__name__ in elastic.__all__
        assert getattr(elastic, kind.__name__) is kind
