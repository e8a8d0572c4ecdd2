"""The hosts of a slice decide together whether a step starts and whether it applies, and learn when all have
written their parts of a checkpoint.

Every host of a slice of several (:mod:`runtime.core.hosts`) must call the
same programs in the same order: each program's collectives wait for every
host, so a host that gives up a step the others go on with leaves them
waiting in a collective for ever (gloo's or NCCL's timeout, minutes). A host
may decide alone at two points: when the step's turn comes (its epoch may
have moved: an abort came first) and before the apply (an abort may have
come during the cross-slice reduction, which runs outside any program, or
that reduction failed on this host alone). At both points the hosts vote,
and all go on only if all voted to. Between the two, the step's programs run
to their end on every host (no abort interrupts them).

Each vote is one slot per (point, epoch, step, host) in the slice's own key-
value store (the coordinator of its JAX distributed system), written once:
by its host, or with "no" by another host that waited for it past the
step's deadline (a host that never got the request). So every host reads
the same votes and decides the same. A host that died leaves its slot
empty: the others wait, and its slice is retired (its processes stopped)
meanwhile. A slice of one host decides alone, as before.

A checkpoint of a slice of several hosts is each host's blocks, written by
each in the background (:mod:`runtime.state.checkpoint_hosts`): a host marks
its part :meth:`~SliceAgreement.done` (or failed) in the same store, and the
slice reports the checkpoint saved only once every host's part is, and gives
it up as soon as one host's failed (:meth:`~SliceAgreement.outcome`).
"""

from __future__ import annotations

import logging
import time

__all__ = ["SliceAgreement"]

log = logging.getLogger("jax_elastic.worker")

_YES, _NO = "1", "0"
#: Votes of steps this far behind the newest are deleted (the store keeps what is still read).
_KEEP_STEPS = 4
#: While waiting for the hosts' parts, each is asked again this often (seconds).
_POLL = 0.05


class SliceAgreement:
    """The votes of this host (``host`` of ``hosts``) of a slice. ``client``: the JAX distributed runtime's
    client (its key-value store); None with one host. Thread-safe (the store is)."""

    def __init__(self, hosts: int = 1, host: int = 0, client=None):
        if hosts > 1 and client is None:
            raise ValueError("a slice of several hosts votes through its distributed system's client")
        self.hosts, self.host, self._client = hosts, host, client

    @classmethod
    def of_this_process(cls) -> SliceAgreement:
        """This process's slice: its JAX distributed system's hosts, if it joined one."""
        import jax

        if jax.process_count() == 1:
            return cls()
        from jax._src import distributed   # the client has no public name; multihost_utils uses it too

        return cls(jax.process_count(), jax.process_index(), distributed.global_state.client)

    def agree(self, point: str, epoch: int, step: int, ok: bool, deadline: float) -> bool:
        """This host's vote ``ok`` on ``point`` ("start" or "apply") of ``step`` of ``epoch``; True when every
        host of the slice voted yes (waiting for them until ``deadline``, monotonic, then voting "no" for a host
        that has not voted)."""
        if self.hosts == 1:
            return ok
        prefix = _prefix(point, epoch, step)
        self._decide(prefix + str(self.host), ok)
        agreed = all([self._read(prefix + str(k), deadline) for k in range(self.hosts)])
        self._forget(point, epoch, step - _KEEP_STEPS)
        return agreed

    def refuse(self, point: str, epoch: int, step: int) -> None:
        """This host votes "no" on ``point`` of ``step`` of ``epoch`` (it gives the step up before voting), unless
        it voted already."""
        if self.hosts > 1:
            self._decide(_prefix(point, epoch, step) + str(self.host), False)

    def done(self, what: str, step: int, ok: bool = True) -> None:
        """This host finished its part of ``what`` of ``step`` (its blocks of a checkpoint written; ``ok`` False:
        failed): said in the slice's store, so :meth:`outcome` on every host sees it."""
        if self.hosts > 1:
            self._client.key_value_set(_done(what, step) + str(self.host), _YES if ok else _NO, allow_overwrite=True)

    def undone(self, what: str, step: int) -> None:
        """This host starts its part of ``what`` of ``step`` (again: a step redone is written again): an earlier
        :meth:`done` of it no longer counts."""
        if self.hosts > 1:
            try:
                self._client.key_value_delete(_done(what, step) + str(self.host))
            except Exception:  # noqa: BLE001 - nothing to delete, or the store is gone (so is the slice)
                pass

    def outcome(self, what: str, step: int, deadline: float | None = None) -> bool | None:
        """Whether every host of the slice finished its part of ``what`` of ``step``: True when all did, False
        as soon as one failed (its host reports the error), None while one has not finished (waiting for them
        until ``deadline``, monotonic; None: not at all) or the store is gone. A slice of one host's own part
        is all of it."""
        if self.hosts == 1:
            return True
        keys = [_done(what, step) + str(k) for k in range(self.hosts)]
        while True:
            said = [self._said(key) for key in keys]
            if _NO in said:
                return False
            if all(x == _YES for x in said):
                return True
            left = (deadline - time.monotonic()) if deadline is not None else 0.0
            if left <= 0:
                return None
            try:   # until the first host not heard from says, for a moment: another may fail meanwhile
                self._client.blocking_key_value_get(keys[said.index(None)], max(int(min(left, _POLL) * 1000), 1))
            except Exception:  # noqa: BLE001 - not yet; asked again
                pass

    def _said(self, key: str) -> str | None:
        try:
            return self._client.key_value_try_get(key)
        except Exception:  # noqa: BLE001 - not there (yet), or the store is gone
            return None

    def _decide(self, key: str, ok: bool) -> None:
        try:
            self._client.key_value_set(key, _YES if ok else _NO)   # once: a slot already decided stays
        except Exception as e:  # noqa: BLE001 - decided already (ALREADY_EXISTS), or the store is gone
            if "exist" not in str(e).lower():
                log.warning("could not vote on %s: %s", key, e)

    def _read(self, key: str, deadline: float) -> bool:
        try:
            left_ms = max(int((deadline - time.monotonic()) * 1000), 1)
            return self._client.blocking_key_value_get(key, left_ms) == _YES
        except Exception:  # noqa: BLE001 - timed out: that host never voted; "no" for it, unless it just did
            self._decide(key, False)
            try:
                return self._client.key_value_try_get(key) == _YES
            except Exception:  # noqa: BLE001 - the store is gone: the slice is
                return False

    def _forget(self, point: str, epoch: int, step: int) -> None:
        if step < 0:
            return
        try:
            self._client.key_value_delete(_prefix(point, epoch, step) + str(self.host))
        except Exception:  # noqa: BLE001 - only housekeeping
            pass


def _done(what: str, step: int) -> str:
    return f"jax-elastic/done/{what}/{step}/"


def _prefix(point: str, epoch: int, step: int) -> str:
    return f"jax-elastic/{point}/{epoch}/{step}/"
