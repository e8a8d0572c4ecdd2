"""A restarted client of a run takes it back: what ``fit`` decides and records for that.

A run's client may die (SIGKILL, OOM, a preempted VM, a rescheduled pod)
while its workers live on for ``elastic_client_grace_seconds``, fenced,
holding the state. Running the same command again (the same ``run_name``)
re-attaches them: :func:`client_options` reads the run directory's client
record (:mod:`elastic.client_record`) and its event log, and when the log's
last attempt is one whose client died with a state to keep, answers the
run id and secret the workers serve and a :class:`runtime.Reattach` (the run
state replayed from the log) for the controller; otherwise this client
starts the run as before (from the newest checkpoint, if any). Either way
this client's generation is one above the record's, and
:func:`record_client` writes the new record as soon as the controller
listens, before any worker hears of it.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import sys
import time

from elastic import client_record, run_records
from runtime import ClientSupersededError, Reattach, RunState, can_attach

__all__ = ["Ownership", "announce", "client_options", "record_client"]


def client_options(run_dir: pathlib.Path, history: list[dict], opts):
    """``(opts, reattach)``: ``opts`` (a ``ControllerOptions``) with this client's generation, and the run id
    and secret of the run it re-attaches; ``reattach`` None when it starts the run instead."""
    record = client_record.read(run_dir)
    opts = dataclasses.replace(opts, generation=record.generation + 1 if record else 0)
    if record is None or not opts.client_grace_seconds or not run_records.client_died(history):
        return opts, None
    state = RunState.replay(history)
    secret = opts.secret or client_record.read_secret(run_dir)
    if not can_attach(state) or state.run_id != record.run_id or not secret:
        return opts, None
    last = history[-1].get("t", time.time())
    return (dataclasses.replace(opts, run_id=record.run_id, secret=secret),
            Reattach(state, downtime_seconds=time.time() - last, previous_pid=record.pid or None))


def record_client(run_dir: pathlib.Path, ctl, opts) -> None:
    """Writes the run directory's client record for controller ``ctl`` (its run id, generation and address);
    the run secret beside it (mode 0600) when this client made it (its workers are this client's to launch)."""
    keep = ctl.group.secret if opts.launcher != "none" else ""
    client_record.write(run_dir, client_record.ClientRecord(run_id=ctl.run_id, generation=opts.generation,
                                                            controller=ctl.address, pid=os.getpid()), secret=keep)


class Ownership:
    """Whether this client still owns its run (the controller's ``ownership``): its run directory's lock and
    event log are still the ones it holds."""

    def __init__(self, run_dir: pathlib.Path, claim, events, opts):
        self.run_dir, self.claim, self.events, self.opts = pathlib.Path(run_dir), claim, events, opts

    def check(self, ctl) -> None:
        """Raises ``ClientSupersededError`` once the run directory is no longer this client's (its lock file and
        event log are not the ones there: a client that found it stopped took both over, and may have finished
        the run since). Called before the client acts on a failure, so a stale client that wakes never recovers
        (relaunches, restores) a run that is another's."""
        log = self.run_dir / "events.jsonl"
        try:
            ours = (self.events.fileno() is not None and
                    os.fstat(self.events.fileno()).st_ino == os.stat(log).st_ino)
        except OSError:
            ours = False
        if not (self.claim.held() and ours):
            raise ClientSupersededError(f"run {ctl.run_id} was taken over by another client while this one was "
                                        "stopped (the run directory is its own now)")

    def take_back(self, ctl, generation: int) -> None:
        """This client's workers fenced themselves while it was silent: it may take its run back as
        ``generation`` only while the run directory is still its own (:meth:`check`, else
        ``ClientSupersededError``); the client record then names the new generation."""
        self.check(ctl)
        record_client(self.run_dir, ctl, dataclasses.replace(self.opts, generation=generation))


def announce(event: dict) -> None:
    """Event-log listener: one line when this client re-attached the run's live workers."""
    if event.get("kind") != "client_attached":
        return
    workers, lost = event["workers"], event["lost"]
    if not workers:
        print(f"elastic: no live worker of run {event['run_id']} answered (lost: {', '.join(lost) or 'none'}): the "
              "run restores its newest snapshot or checkpoint", file=sys.stderr)
        return
    print(f"elastic: re-attached {len(workers)} live worker{'s' * (len(workers) != 1)} of run {event['run_id']} "
          f"(client generation {event['generation']}, {event['downtime_seconds']:.1f} s after the last client's "
          f"last event){'; lost: ' + ', '.join(lost) if lost else ''}; {event['committed']} steps were committed "
          "before it died", file=sys.stderr)
