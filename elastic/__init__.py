"""jax-elastic: fault-tolerant, elastic training for JAX train loops.

Public API::

    import elastic
    cfg = elastic.load_config("tiny", ["steps=30"])
    report = elastic.Trainer(init=..., loss=..., optimizer=optax.adam(1e-3), data=..., config=cfg).fit()

or, for an existing fused step that marks ``grads = elastic.cross_slice_mean(grads)``::

    report = elastic.wrap(train_step, init_state=..., data=..., config=cfg).fit()

Names that pull in JAX load lazily, so ``elastic.config`` and the CLI can set
``XLA_FLAGS`` before JAX starts.
"""

from __future__ import annotations

import importlib

from elastic.config import Config, ConfigError
from elastic.config_loading import load_config
from elastic.data import DataSource, FunctionSource, GrainSource
from elastic.marker import cross_slice_mean
from elastic.stages import pipeline_stage

__all__ = [
    "BadInputError",
    "CapacityExhaustedError",
    "CheckpointTree",
    "Config",
    "ConfigError",
    "DataSource",
    "DeviceMismatchError",
    "ElasticError",
    "ElasticTrainingFailedError",
    "FunctionSource",
    "GrainSource",
    "ModelMetrics",
    "ReplicaDivergenceError",
    "RunRecordsLostError",
    "StateLostError",
    "Trainer",
    "WrappedStep",
    "build_report",
    "cross_slice_mean",
    "load_config",
    "pipeline_stage",
    "wrap",
]

_LAZY = {"RunRecordsLostError": "elastic.trainer", "Trainer": "elastic.trainer", "WrappedStep": "elastic.trainer",
         "wrap": "elastic.trainer", "build_report": "elastic.report", "ModelMetrics": "elastic.metrics",
         # why a run ended (runtime.core.errors): what ``fit`` raises, for callers to branch on
         "CheckpointTree": "runtime",   # how checkpoints name the state's leaves (elastic.wrap(checkpoint_tree=))
         **{name: "runtime" for name in ("BadInputError", "CapacityExhaustedError", "DeviceMismatchError",
                                         "ElasticError", "ElasticTrainingFailedError", "ReplicaDivergenceError",
                                         "StateLostError")}}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'elastic' has no attribute {name!r}")
