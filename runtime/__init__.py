"""jax-elastic runtime: controller, workers, scheduling and recovery.

Imports none of ``elastic``, ``integrations`` or ``chaos``.
"""

from runtime.errors import (
    ElasticError,
    ElasticTrainingFailedError,
    ProgramExportError,
    ProtocolError,
    RegistrationTimeoutError,
    StaleEpochError,
    StepAbortedError,
    WorkerError,
    WorkerLostError,
)
from runtime.microbatch import Node, assign_microbatches, tree_reduce, tree_sum
from runtime.programs import MESH_AXIS, ProgramSet

__all__ = [
    "ElasticError",
    "ElasticTrainingFailedError",
    "MESH_AXIS",
    "Node",
    "ProgramExportError",
    "ProgramSet",
    "ProtocolError",
    "RegistrationTimeoutError",
    "StaleEpochError",
    "StepAbortedError",
    "WorkerError",
    "WorkerLostError",
    "assign_microbatches",
    "tree_reduce",
    "tree_sum",
]
