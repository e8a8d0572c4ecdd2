"""A restarted client takes its run back: the ``STARTING`` phase of a client that re-attaches live workers.

The client that held the run died (SIGKILL, OOM, a preempted VM); its
workers outlived it for their client grace, fenced, holding the state and
the programs. A new client of the same run (the same command, the same
``run_name``) rebuilds the run's state from the event log alone
(:meth:`~runtime.control.run_state.RunState.replay`), then :func:`attach`:

1. asks every worker the log names (registered, not dead, not let go) to take its new
   generation (``Attach``): from then on each refuses the old client, should
   it wake; each answers its applied steps, state hash, recent loss sums and
   snapshots. A worker that loaded other programs refuses, with nothing
   changed (:class:`~runtime.core.errors.AttachRefusedError`: the model
   changed); one that does not answer is declared dead; one the dead client
   had not placed yet (relaunched, or joined, and not warmed) warms again
   and joins as a newcomer;
2. records ``client_attached`` (the same attempt goes on: the fold resets
   nothing);
3. brings the run whole as after any failure
   (:meth:`runtime.control.controller.Controller.recover`): the steps every
   survivor applied are committed (the dead client may have applied steps
   it never recorded), those one ahead roll back, dead members are replaced
   from spares or relaunched, and with no survivor the newest snapshot or
   checkpoint comes back. Training goes on at the first uncommitted step.

No checkpoint or snapshot is read while a live replica is left; the
trajectory is the one an uninterrupted run takes.
"""

from __future__ import annotations

import dataclasses

from runtime.control.run_state import SAMPLER
from runtime.core.errors import ClientLostError

__all__ = ["Reattach", "attach", "can_attach"]


@dataclasses.dataclass(frozen=True)
class Reattach:
    """What a restarted client knows of the run it takes back: the state its log leaves
    (:class:`~runtime.control.run_state.RunState`), how long ago the dead client last wrote, and its pid."""

    state: object
    downtime_seconds: float = 0.0
    previous_pid: int | None = None


def can_attach(state) -> bool:
    """Whether the replayed ``state`` is of a run a restarted client can take back: placed, with a state
    (initialized or resumed) that live workers may hold, not finished."""
    return state.placement is not None and bool(state.replicas) and state.committed < state.steps


def _attached(reply, info, stage: int | None) -> dict:
    """How ``client_attached`` records a worker that answered: as it answered, or a slice of several hosts as
    the log knows it (its hosts keep their processes and addresses: it answered as all of them); a pipelined
    run's with the stage it is of."""
    return {**_answered(reply, info), **({"stage": stage} if stage is not None else {})}


def _answered(reply, info) -> dict:
    if info.hosts:
        return {"address": info.address, "data_address": info.data_address, "devices": reply.num_devices,
                "platform": reply.platform, "pid": info.hosts[0].pid, "host": info.host,
                "applied_steps": reply.applied_steps, "hosts": info.host_records()}
    return {"address": reply.address, "data_address": reply.data_address, "devices": reply.num_devices,
            "platform": reply.platform, "pid": reply.pid, "host": reply.host, "applied_steps": reply.applied_steps}


def attach(ctl, downtime_seconds: float, previous_pid: int | None = None, *, first: bool = True) -> None:
    """Takes the run of ``ctl`` (a :class:`runtime.control.controller.Controller` whose ``state`` is the
    replayed one) over from its dead client; see the module docstring. ``first=False``: the client takes its
    own run back (its workers fenced themselves while it was silent; its observer is attached already)."""
    s, group, o = ctl.state, ctl.group, ctl.opts
    # (the fenced are not dead; those the run let go, given back to a pool or sent home, are no members; an RL
    # run's samplers are taken over by its sampling, after)
    rl = ctl.sampling is not None
    known = {w: info for w, info in s.registered.items()
             if w not in s.dead and w not in s.left and not (rl and s.role_of(w) == SAMPLER)}
    pipelined = s.placement is not None and s.placement.stages > 1
    stages = dict(s.placement.stage_of) if pipelined else None
    replies = group.attach(known, s.registered, stages, placed=s.placement.members)
    ctl.events.emit("client_attached", run_id=ctl.run_id, generation=o.generation, steps=ctl.attempt.steps or s.steps,
                    controller=ctl.address, previous_pid=previous_pid,
                    workers={w: _attached(r, known[w], group.stage_answered(w, r, stages))
                             for w, r in sorted(replies.items())},
                    lost=sorted(set(known) - set(replies)), committed=s.committed,
                    downtime_seconds=max(downtime_seconds, 0.0))
    if first:
        ctl.observer.attach(ctl)
    alive = sorted(replies)
    if rl:
        ctl.sampling.reattach({w: info for w, info in s.registered.items()
                               if w not in s.dead and s.role_of(w) == SAMPLER},
                              ctl.attempt.seed)
    ctl.recover(ClientLostError(
        f"the run's client was lost; client generation {o.generation} attached {len(alive)} of {len(known)} "
        f"workers ({', '.join(alive) or 'none'})"), has_state=True)

