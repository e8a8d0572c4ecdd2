"""Worker-side fault injection, armed by the chaos harness through ``Chaos``.

Off unless the worker was started with chaos enabled (``--chaos`` or
``ELASTIC_CHAOS=1``): a worker that is not in a chaos run refuses every
``Chaos`` call, so production runs cannot be faulted by accident.

Faults act from outside the training math: a partition drops calls at the
gRPC layer (:class:`PartitionInterceptor`), a straggler sleeps after its grad
phase, corruption flips bits in an outgoing message after its checksum was
computed, and the transfer faults signal the process itself at a fixed point
of a state transfer. Nothing here changes what a healthy step computes.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time

import grpc

from runtime.wire.auth import handler_like
from runtime.core.errors import ProtocolError

__all__ = ["WorkerFaults", "PartitionInterceptor", "ACTIONS", "PHASES", "corrupt_first", "mid_stream"]

# The worker-side action vocabulary, exported as ``runtime.FAULT_ACTIONS``: the
# chaos harness maps its fault kinds onto these; ``Chaos`` refuses anything else.
ACTIONS = ("straggle", "partition", "corrupt", "kill_on_send_state", "kill_on_receive_state",
           "hang_on_send_state", "kill_in_phase", "clear")
# Where ``kill_in_phase`` may strike: the phases of a step, in order, and "save" (mid-write of the next
# persistent checkpoint this worker writes, once its temporary directory exists).
# "rollout": a sampler's, after its rollouts were made; "weights": a trainer's, while it sends a weights version
PHASES = ("grad", "reduce", "apply", "save", "eval", "rollout", "weights")


class WorkerFaults:
    """The faults armed on one worker. Thread-safe; every method is cheap when nothing is armed.

    Armed by the worker's ``Chaos`` handler (:meth:`arm`); consulted by the
    worker at fixed points of its paths (the other methods). When to arm
    what is the chaos harness's decision, not this class's.
    """

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._lock = threading.Lock()
        self._disarm()

    def _disarm(self) -> None:
        self._straggle_until = 0.0
        self._factor = 1.0
        self._partition_until = 0.0
        self._corrupt = False
        self._on_send_state: str | None = None
        self._on_receive_state: str | None = None
        self._kill_in_phase: str | None = None
        self.save_after = 0   # kill_in_phase "save": only the save of a later step counts

    def arm(self, action: str, factor: float = 0.0, seconds: float = 0.0, phase: str = "",
            after_step: int = 0) -> None:
        """Arms one fault (one of :data:`ACTIONS`; ``clear`` disarms all).

        Raises ``PermissionError`` when chaos is off on this worker, and
        :class:`ProtocolError` (a ``ValueError``) for an unknown action, a
        phase not in :data:`PHASES` or bad numbers (negative, not finite).
        """
        if not self.enabled:
            raise PermissionError("fault injection is off on this worker (start it with chaos enabled)")
        if action not in ACTIONS:
            raise ProtocolError(f"unknown chaos action {action!r}; expected one of {', '.join(ACTIONS)}")
        if (not (math.isfinite(seconds) and math.isfinite(factor)) or seconds < 0
                or (action == "straggle" and factor < 1)):
            raise ProtocolError(f"chaos {action}: factor must be >= 1 and seconds >= 0 (got {factor}, {seconds})")
        if action == "kill_in_phase" and phase not in PHASES:
            raise ProtocolError(f"chaos kill_in_phase: phase must be one of {', '.join(PHASES)}, got {phase!r}")
        now = time.monotonic()
        with self._lock:
            if action == "straggle":
                self._straggle_until, self._factor = now + seconds, factor
            elif action == "partition":
                self._partition_until = now + seconds
            elif action == "corrupt":
                self._corrupt = True
            elif action == "kill_on_send_state":
                self._on_send_state = "kill"
            elif action == "hang_on_send_state":
                self._on_send_state = "hang"
            elif action == "kill_on_receive_state":
                self._on_receive_state = "kill"
            elif action == "kill_in_phase":
                self._kill_in_phase, self.save_after = phase, after_step
            else:
                self._disarm()

    # -- checks on the worker's paths ----------------------------------------

    def partitioned(self) -> float:
        """Seconds of partition left (0.0 when connected)."""
        return max(self._partition_until - time.monotonic(), 0.0)

    def straggle(self, spent: float) -> None:
        """Called after the grad phase took ``spent`` seconds: sleeps so it took ``factor`` times as long."""
        if self._straggle_until and time.monotonic() < self._straggle_until:
            time.sleep(spent * (self._factor - 1.0))

    def take_corruption(self) -> bool:
        """True once after ``corrupt`` was armed: the caller corrupts its next message."""
        with self._lock:
            hit, self._corrupt = self._corrupt, False
            return hit

    def in_phase(self, phase: str) -> None:
        """Called inside each phase of a step (after grad, mid-reduction, after apply, after its eval) and mid-save."""
        if self._kill_in_phase == phase:
            _signal_self("kill")

    def armed_in(self, phase: str) -> bool:
        """True when a kill waits in ``phase`` (the caller may first bring about the moment it strikes)."""
        return self._kill_in_phase == phase

    def sending_state(self) -> None:
        """Called between two chunks of an outgoing state transfer."""
        with self._lock:
            action, self._on_send_state = self._on_send_state, None
        _signal_self(action)

    def receiving_state(self) -> None:
        """Called between two chunks of an incoming state transfer."""
        with self._lock:
            action, self._on_receive_state = self._on_receive_state, None
        _signal_self(action)


def _signal_self(action: str | None) -> None:
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "hang":
        os.kill(os.getpid(), signal.SIGSTOP)


class PartitionInterceptor(grpc.ServerInterceptor):
    """While a partition is armed, every incoming call is dropped.

    A dropped call waits until the partition heals or its deadline passes,
    then fails with UNAVAILABLE: to the caller it looks like an unreachable
    host, not like a refused connection. Install it first (outermost), so a
    dropped call reaches nothing else: not the secret check, not the
    worker's lease (which only calls that reach their handler renew, see
    ``runtime.wire.rpc.make_server``'s ``on_authenticated``).
    """

    def __init__(self, faults: WorkerFaults):
        self._faults = faults

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        if not self._faults.partitioned():
            return handler
        faults = self._faults

        def drop(_request, context):
            left = faults.partitioned()
            remaining = context.time_remaining()
            time.sleep(min(left, remaining if remaining is not None else left, 5.0))
            context.abort(grpc.StatusCode.UNAVAILABLE, "partitioned (chaos)")

        return handler_like(handler, drop)


def mid_stream(chunks, hook):
    """Passes ``chunks`` through, calling ``hook()`` after the first (chaos: a fault mid-transfer)."""
    for i, chunk in enumerate(chunks):
        if i == 1:
            hook()
        yield chunk


def corrupt_first(parts):
    """Chaos: flips one byte of the first part after its checksum was computed."""
    for i, part in enumerate(parts):
        if i == 0 and len(part.payload):
            flipped = bytearray(part.payload)
            flipped[0] ^= 0xFF
            part = type(part)(part.header, memoryview(flipped))
        yield part
