"""Why a run ended, as types: each reason is its own error, picklable, and still an ElasticTrainingFailedError."""

import logging
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


def _read_failed(path):
    """A data source's failure as a worker meets it: the user's to fix, raised from the errors under it."""
    try:
        try:
            raise FileNotFoundError(2, "No such object")
        except FileNotFoundError as e:
            raise ConnectionError("fetch failed") from e
    except ConnectionError as e:
        raise elastic.ConfigError(f"config key 'grain_train_files': reading {path}: not found\n(changed since "
                                  "the client listed it)") from e


def test_a_workers_error_that_is_the_users_to_fix_reaches_the_client_as_one_line_its_traceback_in_the_log(caplog):
    from runtime.wire import rpc

    with pytest.raises(elastic.ConfigError) as raised:
        _read_failed("gs://b/docs-3.parquet")
    rpc.log_failure(logging.getLogger("jax_elastic.worker"), "step 3", raised.value)
    err = rpc.to_error("w1", rpc.StatusError(*rpc.error_status(raised.value)))   # a step's answer, as the client reads it
    assert isinstance(err, runtime.WorkerError) and err.remote_traceback == ""
    assert str(err) == ("worker w1: ConfigError: config key 'grain_train_files': reading gs://b/docs-3.parquet: not "
                        "found (changed since the client listed it)")
    logged = caplog.records[-1]
    assert "step 3 failed" in logged.getMessage() and "FileNotFoundError" in caplog.text   # the worker's log keeps it
    # User code's own error keeps its traceback for the client (and the log).
    try:
        raise RuntimeError("disk on fire")
    except RuntimeError as e:
        bug = rpc.to_error("w1", rpc.StatusError(*rpc.error_status(e)))
    assert bug.message == "RuntimeError: disk on fire" and "Traceback" in bug.remote_traceback
    assert issubclass(BadInputError, runtime.UserInputError) and issubclass(elastic.ConfigError, ValueError)
