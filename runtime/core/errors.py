"""One error hierarchy for jax-elastic.

Every error is picklable (plain constructor arguments) so it can cross process
boundaries. Code branches on the type, never on the message text.
"""

from __future__ import annotations

__all__ = [
    "AuthenticationError",
    "ElasticError",
    "WorkerError",
    "WorkerLostError",
    "StepAbortedError",
    "ProgramExportError",
    "RegistrationTimeoutError",
    "StaleEpochError",
    "ElasticTrainingFailedError",
    "CapacityExhaustedError",
    "StateLostError",
    "DeviceMismatchError",
    "ReplicaDivergenceError",
    "BadInputError",
    "ClusterUnreachableError",
    "ProtocolError",
    "PlatformMismatchError",
    "ClientSupersededError",
    "ClientLostError",
    "WorkerFencedError",
    "AttachRefusedError",
    "UserInputError",
]


class ElasticError(Exception):
    """Base of every error raised by jax-elastic."""


class UserInputError(Exception):
    """A mixin: what the user gave (a config key, a data file, a checkpoint to start from) is unusable, and the
    message names it and what to do. Said in one line wherever it is raised: a worker answers it without its
    traceback (which it keeps in its own log), so the client's ``WorkerError`` is the message alone. Its
    subclasses are also of their own kind (``elastic.ConfigError`` a ``ValueError``, :class:`BadInputError`)."""


class WorkerError(ElasticError):
    """User code (a program, a data source) raised on a worker.

    Carries the worker's id and the remote traceback text.
    """

    def __init__(self, worker_id: str, message: str, remote_traceback: str = ""):
        super().__init__(worker_id, message, remote_traceback)
        self.worker_id = worker_id
        self.message = message
        self.remote_traceback = remote_traceback

    def __str__(self) -> str:
        text = f"worker {self.worker_id}: {self.message}"
        if self.remote_traceback:
            text += "\n--- remote traceback ---\n" + self.remote_traceback
        return text


class WorkerLostError(ElasticError):
    """A worker stopped answering (process died, connection broken, deadline)."""

    def __init__(self, worker_id: str, reason: str):
        super().__init__(worker_id, reason)
        self.worker_id = worker_id
        self.reason = reason

    def __str__(self) -> str:
        return f"worker {self.worker_id} lost: {self.reason}"


class StepAbortedError(ElasticError):
    """A step could not complete on this worker (a peer vanished mid-reduction)."""

    def __init__(self, step: int, reason: str):
        super().__init__(step, reason)
        self.step = step
        self.reason = reason

    def __str__(self) -> str:
        return f"step {self.step} aborted: {self.reason}"


class StaleEpochError(ElasticError):
    """A message from an older membership epoch (or another run) was refused."""


class ClientSupersededError(ElasticError):
    """This client was taken over: a newer client of the same run (a restart, started while this one was
    stopped or cut off) drives its workers now, and every worker refuses this one. Never retried: the process
    exits without touching the run's workers or its files."""


class ClientLostError(ElasticError):
    """The run's client was lost (killed, crashed) and a restarted one took its workers over: the failure a
    re-attach recovers from, like a worker's loss. Not raised: recorded as ``failure_detected``."""


class WorkerFencedError(StaleEpochError):
    """The worker fenced itself: this client was silent longer than the worker's lease (it was stopped, or
    cut off) and the worker now waits, holding its state, for a client to attach it. The client, if it still
    owns the run, takes it back as a new generation (as a restarted client would)."""


class AuthenticationError(ElasticError, PermissionError):
    """A peer or client did not present this run's secret."""


class ProtocolError(ElasticError, ValueError):
    """A malformed RPC message or tensor chunk (bad size, bad checksum, ...)."""


class PlatformMismatchError(ProtocolError):
    """Programs exported for a platform this process's JAX does not run on (config key ``hardware``).

    A worker refuses them when it loads them, before any compile; the
    controller sees a ``ProtocolError`` (INVALID_ARGUMENT) carrying this
    message, and the run ends: another worker of the same kind would refuse
    them too.
    """


class ProgramExportError(ElasticError):
    """The step could not be exported with ``jax.export``; says why and what to do."""


class AttachRefusedError(ElasticError):
    """A restarted client cannot take over the run's live workers: they run other programs (the model or a
    config key its programs depend on changed since the client died). Nothing on the workers changed."""


class ClusterUnreachableError(ElasticError, ConnectionError):
    """The cluster engine the run was told to use (a Ray address) did not answer; the message names the key
    and the address. Nothing was started."""


class RegistrationTimeoutError(ElasticError, TimeoutError):
    """Workers did not register with the controller within the deadline."""


class ElasticTrainingFailedError(ElasticError):
    """The run cannot continue; carries what failed where.

    The base of why (catch it to catch every one): :class:`CapacityExhaustedError`
    (too few workers to go on: retry with more), :class:`ReplicaDivergenceError`
    (replicas disagree: a determinism violation, never retried) and
    :class:`BadInputError` (what the run was told to start from is unusable:
    refused before any worker starts). ``advice`` (a class attribute) says
    what to do next; the text ends with it.
    """

    advice = ""

    def __init__(self, message: str, step: int | None = None, cause: str = ""):
        super().__init__(message, step, cause)
        self.message = message
        self.step = step
        self.cause = cause

    def __str__(self) -> str:
        where = f" at step {self.step}" if self.step is not None else ""
        why = f": {self.cause}" if self.cause else ""
        then = f" ({self.advice})" if self.advice else ""
        return f"{self.message}{where}{why}{then}"


class CapacityExhaustedError(ElasticTrainingFailedError):
    """Too few workers are left to go on: no spare for a lost slice, fewer than ``min_slices`` after the
    capacity wait, or the recoveries allowed (``max_retries``) used up. The numerics are sound; the same run
    with more capacity would go on."""

    advice = ("what to do: run again with more workers or spares, allow more recoveries (max_retries), a "
              "lower minimum (min_slices) or a longer capacity wait")


class StateLostError(ElasticTrainingFailedError):
    """Every worker holding the training state was lost and no snapshot or checkpoint holds it. More capacity
    would not bring it back: running again starts over (or from a checkpoint)."""

    advice = ("what to do: run again with spares, and keep in-memory snapshots or checkpoints so a later loss "
              "restores the state instead of ending the run")


class DeviceMismatchError(CapacityExhaustedError):
    """Workers joined, but too few with the devices a slice needs: the message names those that do not fit and
    what they have. More workers like them would not help; workers with the right devices would."""

    advice = "what to do: start workers with the devices a slice needs (see why); more workers like these won't fit"


class ReplicaDivergenceError(ElasticTrainingFailedError):
    """Replicas that applied the same steps disagree (loss sums or state hashes): a determinism violation,
    the numerics cannot be trusted. Never retried: another attempt would hide the bug."""

    advice = ("what to do: do not trust this run's state; look for nondeterministic operations in the step or "
              "the data source, and report it as a bug with the run's events.jsonl")


class BadInputError(ElasticTrainingFailedError, UserInputError, ValueError):
    """What the run was told to start from is unusable (``load_full_state_path``: missing, unreadable, or no
    complete checkpoint). Raised before any worker starts; the message names the input."""

    advice = "what to do: name a checkpoint directory, or one complete step in it (<directory>/<step>)"
