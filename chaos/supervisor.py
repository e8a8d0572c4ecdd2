"""The chaos supervisor: a faulted run whose client is killed or stopped, and started again by the harness.

A client fault (``kill:client``, ``hang(resume=S):client``) cannot strike the
harness's own process, so :func:`chaos.harness.run_chaos` runs a plan that
holds one through :func:`run_clients`: each client of the run (the process
calling ``fit``) is a child process (``multiprocessing``'s spawn context, the
job passed with cloudpickle) with a :class:`chaos.injector.FaultInjector`
as its observer, and this process plays the supervisor a deployment would
have (systemd, a Kubernetes controller, a shell loop):

* a client that died of SIGKILL from a ``kill:client`` it fired (its
  ``fault_injected`` is in the run's log, one per restart) is started again
  with the same job: it re-attaches the live workers (:mod:`elastic.reattach`)
  and goes on. Its injector reads the log so far and fires only the faults
  not fired yet; step triggers still fire at their step;
* a client stopped by a ``hang`` longer than the workers' lease
  (:func:`outlasts_lease`) is replaced once it has been stopped (state ``T``
  in ``/proc/<pid>/stat``) for longer than the lease: the new client takes
  the run directory over from the stopped one and re-attaches the workers
  with a newer client generation. The stopped one is woken (SIGCONT) once
  ``resume`` has passed and the new client has attached (so what is tested is
  a stale client refused, never a race with the takeover); every worker
  refuses it, and it exits with :data:`SUPERSEDED_EXIT` and one line. One
  whose ``resume`` had not passed when the run ended is woken then: it finds
  the run directory another client's (and its workers gone) and must exit
  the same way, changing nothing (a short run judges the fault too). A hang
  within the lease is the client's own: a helper wakes it and it goes on;
* any other end of the client ends the run: it finished or failed (exit 0,
  its final :class:`~runtime.RunState` sent back for the verdict's replay
  check), raised (exit 1: the error is raised here), or died with no client
  fault to account for it (judged as it stands: the run did not finish).

What happened to each client is said in one line each on stderr, and what
the supervisor saw goes to the verdict (:func:`supervision_reasons`): a
stopped client that woke (or was woken as the run ended) and did not exit as
superseded, or a client that died unaccounted for, fails it.

The decisions are pure functions (:func:`after_exit`, :func:`takeover_due`,
:func:`wake_due`; :func:`chaos.injector.outlasts_lease`, which the client's
injector applies too); :func:`run_clients` applies them to real processes.
Loading this module does not import JAX.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import pickle
import signal
import sys
import tempfile
import time

from chaos.injector import ClientSide, FaultInjector, outlasts_lease

__all__ = ["SUPERSEDED_EXIT", "ClientEnd", "ClientSide", "after_exit", "client_main", "job_blob", "outlasts_lease",
           "run_clients", "supervision_reasons", "takeover_due", "wake_due"]

#: The exit status of a client woken after another took its run over (every worker refused it).
SUPERSEDED_EXIT = 3
# A woken stale client has this long to be refused and exit before it is killed.
_STALE_EXIT_SECONDS = 60.0
_POLL_SECONDS = 0.1


@dataclasses.dataclass(frozen=True)
class ClientEnd:
    """How one client of the run ended: ``number`` (0: the first), ``pid``, ``how`` ("finished", "killed",
    "superseded", "died", "error"), ``status`` (the exit status; negative: the signal), the
    index of the client fault behind it (None: none) and one sentence."""

    number: int
    pid: int
    how: str
    status: int | None
    fault: int | None
    text: str


# --------------------------------------------------------------------------- decisions (pure)


def after_exit(status: int | None, kills_fired: int, kills_restarted: int) -> str:
    """What to do when the current client ended with exit ``status`` (negative: killed by that signal):

    ``"restart"`` when a SIGKILL is accounted for by a ``kill:client`` recorded in the log and not yet restarted
    from (``kills_fired`` > ``kills_restarted``); ``"finished"`` for 0 (the run finished or failed: its log says
    which); ``"error"`` for 1 (the client raised: the error is passed on); ``"died"`` for anything else."""
    if status == -signal.SIGKILL and kills_fired > kills_restarted:
        return "restart"
    if status == 0:
        return "finished"
    if status == 1:
        return "error"
    return "died"


def takeover_due(hang_seconds: float | None, lease_seconds: float, stopped_for: float | None) -> bool:
    """Whether to start a new client beside the current one, stopped by a hang of ``hang_seconds`` (None: no
    hang) for ``stopped_for`` seconds so far (None: not seen stopped): a hang outlasting the lease, once the
    client was stopped for longer than the lease (its workers have fenced themselves)."""
    return (hang_seconds is not None and outlasts_lease(hang_seconds, lease_seconds) and stopped_for is not None
            and stopped_for > lease_seconds)


def wake_due(now: float, stopped_at: float, hang_seconds: float, attached: bool) -> bool:
    """Whether to wake a stale client stopped at ``stopped_at`` (wall time) for ``hang_seconds``: once that time
    has passed and the new client has ``attached`` the workers (so every one of them refuses the stale one)."""
    return attached and now >= stopped_at + hang_seconds


def supervision_reasons(ends: list[ClientEnd], specs: list[str]) -> list[str]:
    """The verdict's reasons from how the clients ended (``specs``: the faults' text, by index): a stopped client
    that woke (or was woken when the run ended) and did not exit as superseded, a client that died unaccounted
    for."""
    reasons = []
    for end in ends:
        what = f"fault {specs[end.fault]!r}" if end.fault is not None else "no client fault"
        if end.how == "stale":
            reasons.append(f"{what} stopped client {end.number} (pid {end.pid}), which was taken over, woke and "
                           f"exited with {_status(end.status)} instead of being refused by every worker "
                           f"(status {SUPERSEDED_EXIT}): {end.text}")
        elif end.how == "died":
            reasons.append(f"client {end.number} (pid {end.pid}) died ({_status(end.status)}) and {what} "
                           "accounts for it.")
    return reasons


# --------------------------------------------------------------------------- the processes


def job_blob(job) -> bytes:
    """``job`` as its clients get it (cloudpickle); a job that does not pickle is bad input for client faults
    (``FaultSpecError``, one line, before anything starts)."""
    import cloudpickle

    from chaos.spec import FaultSpecError

    try:
        return cloudpickle.dumps(job)
    except Exception as e:   # noqa: BLE001 (whatever the job holds that cannot be pickled)
        raise FaultSpecError(f"client faults run the job in child processes, and this job cannot be pickled "
                             f"with cloudpickle ({type(e).__name__}: {e}); use worker faults only") from None


def run_clients(job, faults, *, seed: int, info: dict, run_dir: pathlib.Path, on_step=None):
    """Runs ``job``'s faulted run as a sequence of client processes (see the module docstring).

    Returns ``(state, ends)``: the final :class:`~runtime.RunState` of the client that ended the run (None when
    it sent none: it died) and a :class:`ClientEnd` per client. Raises what the last client raised (exit 1).
    ``on_step(step, loss)`` is called here for each step committed, from the run's log, and ``on_step.observe(e)``
    (when it has one: the command's progress bar) for each of its events, as ``Trainer.fit(on_event=)`` does.
    """
    import multiprocessing

    cfg = job.config
    side = ClientSide(steps=cfg.steps, lease_seconds=cfg.elastic_worker_lease_seconds,
                      grace_seconds=cfg.elastic_client_grace_seconds)
    with tempfile.TemporaryDirectory(prefix="chaos-clients-") as tmp:
        run = _Supervision(multiprocessing.get_context("spawn"), job_blob(job), list(faults), seed, info,
                           pathlib.Path(run_dir), side, pathlib.Path(tmp), on_step)
        try:
            return run.run()
        finally:
            run.kill_all()


@dataclasses.dataclass
class _Client:
    number: int
    process: object
    out: pathlib.Path
    hang: tuple[int, float, float] | None = None   # (fault index, wall time it stopped, resume seconds)
    stopped_since: float | None = None             # monotonic time it was first seen stopped
    attached_before: int = 0                       # client_attached events seen when it was taken over
    woken: bool = False


class _Supervision:
    """One supervised run: ``target`` is what each client process runs (:func:`client_main`; a test's stand-in)."""

    def __init__(self, ctx, blob, faults, seed, info, run_dir, side, tmp, on_step, target=None):
        self.target = target or client_main
        self.ctx, self.blob, self.faults, self.seed, self.info = ctx, blob, faults, seed, info
        self.run_dir, self.side, self.tmp, self.on_step = run_dir, side, tmp, on_step
        self.specs = [f.spec() for f in faults]
        self.clients: list[_Client] = []
        self.stale: list[_Client] = []
        self.ends: list[ClientEnd] = []
        self.kills: list[int] = []   # indices of the kill:client faults the log records, in order
        self.restarts = 0
        self.attached = 0
        self.tail = _Tail(run_dir / "events.jsonl")

    # -- the loop ------------------------------------------------------------

    def run(self):
        current = self._start()
        while True:
            self._read()
            if not current.process.is_alive():
                current.process.join()
                self._read()   # what it wrote last
                status = current.process.exitcode
                action = after_exit(status, len(self.kills), self.restarts)
                if action == "restart":
                    fault = self.kills[self.restarts]
                    self.restarts += 1
                    self._end(current, "killed", status, fault, f"fault {self.specs[fault]!r} killed client "
                              f"{current.number} (pid {current.process.pid}): starting the same job again")
                    current = self._start()
                    continue
                break
            if current.hang is not None and not self._taken_over(current):
                stopped = _stopped(current.process.pid)
                if not stopped:
                    current.stopped_since = None
                elif current.stopped_since is None:
                    current.stopped_since = time.monotonic()
                stopped_for = time.monotonic() - current.stopped_since if stopped else None
                if takeover_due(current.hang[2], self.side.lease_seconds, stopped_for):
                    current.attached_before = self.attached
                    self.stale.append(current)
                    _say(f"fault {self.specs[current.hang[0]]!r} stopped client {current.number} (pid "
                         f"{current.process.pid}) for longer than the workers' lease "
                         f"({self.side.lease_seconds:g} s): starting a new client, which takes the run over")
                    current = self._start()
                    continue
            self._wake_stale()
            time.sleep(_POLL_SECONDS)
        result = self._result(current, status, action)
        self._finish_stale()
        if isinstance(result, BaseException):
            raise result
        return result, self.ends

    def _start(self) -> _Client:
        number = len(self.clients)
        out = self.tmp / f"client-{number}.pickle"
        process = self.ctx.Process(target=self.target, name=f"chaos-client-{number}",
                                   args=(self.blob, self.faults, self.seed, self.info, str(self.run_dir), number,
                                         str(out), self.side))
        process.start()
        client = _Client(number, process, out)
        self.clients.append(client)
        return client

    def _taken_over(self, client: _Client) -> bool:
        return any(c is client for c in self.stale)

    def _read(self) -> None:
        """Follows the run's log: steps for ``on_step``, the client faults recorded, the attaches."""
        observe = getattr(self.on_step, "observe", None)   # (the command's bar: an RL run's rewards)
        for e in self.tail.read():
            kind = e.get("kind")
            if observe is not None:
                observe(e)
            if kind == "step_committed" and self.on_step is not None:
                self.on_step(e["step"], e["loss"])
            elif kind == "client_attached":
                self.attached += 1
            elif kind == "fault_injected":
                i = e.get("index")
                if not (isinstance(i, int) and 0 <= i < len(self.faults) and self.faults[i].hits_client):
                    continue
                if self.faults[i].kind == "kill":
                    self.kills.append(i)
                else:   # recorded by the current client, which stops itself right after
                    self.clients[-1].hang = (i, float(e["t"]), float(self.faults[i].option("resume")))

    def _wake_stale(self) -> None:
        for c in self.stale:
            if not c.woken and wake_due(time.time(), c.hang[1], c.hang[2], self.attached > c.attached_before):
                _signal(c.process.pid, signal.SIGCONT)
                c.woken = True

    def _result(self, current: _Client, status, action):
        """The final state the client that ended the run sent (or the error it raised), and its end."""
        sent = _load(current.out)
        pid = current.process.pid
        if action == "finished":
            self._end(current, "finished", status, None, f"client {current.number} (pid {pid}) ended the run")
            return sent.get("state")
        if action == "error":
            error = sent.get("error") or RuntimeError(f"chaos client {current.number} (pid {pid}) exited with "
                                                      "status 1")
            self._end(current, "error", status, None, f"client {current.number} (pid {pid}) raised "
                      f"{type(error).__name__}: {error}")
            return error
        self._end(current, "died", status, None, f"client {current.number} (pid {pid}) died ({_status(status)}) "
                  "with no client fault to account for it: the run is judged as it stands")
        return None

    def _finish_stale(self) -> None:
        """Every stale client ends: woken ones are refused and exit. One still stopped (the run ended before its
        ``resume`` passed) is woken now, and must exit the same way: its run is another's, finished."""
        deadline = time.monotonic() + _STALE_EXIT_SECONDS
        for c in self.stale:
            pid, fault = c.process.pid, c.hang[0]
            if not c.woken:
                _say(f"client {c.number} (pid {pid}) was still stopped by fault {self.specs[fault]!r} when the run "
                     "ended: woken now")
                _signal(pid, signal.SIGCONT)
                c.woken = True
            c.process.join(max(deadline - time.monotonic(), 0.1))
            if c.process.is_alive():
                _signal(pid, signal.SIGKILL)
                c.process.join()
            status = c.process.exitcode
            if status == SUPERSEDED_EXIT:
                self._end(c, "superseded", status, fault, f"client {c.number} (pid {pid}), stopped by fault "
                          f"{self.specs[fault]!r}, woke, was refused by every worker and exited with status "
                          f"{status} (superseded)")
            else:
                self._end(c, "stale", status, fault, f"client {c.number} (pid {pid}), stopped by fault "
                          f"{self.specs[fault]!r} and taken over, woke and exited with {_status(status)}, not "
                          f"superseded ({SUPERSEDED_EXIT})")

    def _end(self, c: _Client, how: str, status, fault, text: str) -> None:
        self.ends.append(ClientEnd(c.number, c.process.pid, how, status, fault, text))
        _say(text)

    def kill_all(self) -> None:
        """Nothing this supervision started outlives it (an error or an interrupt here)."""
        for c in self.clients:
            if c.process.is_alive():
                _signal(c.process.pid, signal.SIGKILL)
                _signal(c.process.pid, signal.SIGCONT)
                c.process.join(5)


class _Tail:
    """The complete events appended to a log since the last read. The log may be replaced by a copy of itself
    (a client taking the run over) and read on at the same offset: the copy holds the same lines."""

    def __init__(self, path: pathlib.Path):
        self.path, self.offset = path, 0

    def read(self) -> list[dict]:
        import json

        try:
            with open(self.path, "rb") as f:
                if os.fstat(f.fileno()).st_size < self.offset:
                    self.offset = 0   # a new log (a client that started the run afresh)
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self.offset += end
        out = []
        for line in data[:end].splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out


def _stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _status(status: int | None) -> str:
    if status is None:
        return "no exit status"
    if status < 0:
        try:
            return f"signal {signal.Signals(-status).name}"
        except ValueError:
            return f"signal {-status}"
    return f"status {status}"


def _say(text: str) -> None:
    print(f"chaos: {text}", file=sys.stderr, flush=True)


def _load(path: pathlib.Path) -> dict:
    try:
        return pickle.loads(path.read_bytes())
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ImportError):
        return {}


def _send(path: pathlib.Path, state, error) -> None:
    """Writes what a client hands back to the supervisor (atomically: a killed client leaves nothing half)."""
    try:
        data = pickle.dumps({"state": state, "error": error})
    except Exception:   # an error that does not pickle: its text
        data = pickle.dumps({"state": state, "error": RuntimeError(f"{type(error).__name__}: {error}")})
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


# --------------------------------------------------------------------------- the client process


def client_main(blob: bytes, faults, seed: int, info: dict, run_dir: str, number: int, out: str,
                side: ClientSide) -> None:
    """One client of the run, in a child process: ``fit`` with a fault injector; exits 0 (the run ended: its
    state sent to ``out``), 1 (it raised: the error sent), or :data:`SUPERSEDED_EXIT` (another client took the
    run over: one line)."""
    import cloudpickle

    from runtime import ClientSupersededError, ElasticError, read_events

    job = cloudpickle.loads(blob)
    log = pathlib.Path(run_dir) / "events.jsonl"
    history = read_events(log) if number and log.exists() else []
    injector = FaultInjector(faults, seed=seed, info=info, history=history, supervised=side)
    error = None
    try:
        job.fit(observer=injector, fresh=not number)   # the first client starts the run anew, the others continue it
    except ClientSupersededError as e:
        _say(f"client {number} (pid {os.getpid()}) woke after another client took the run over, and exits: {e}")
        sys.exit(SUPERSEDED_EXIT)   # a normal exit: what this process started (its zygote) ends with it
    except ElasticError:
        pass   # recorded as run_failed; the verdict says why
    except BaseException as e:   # noqa: BLE001 (passed on to the supervisor, which raises it)
        error = e
    _send(pathlib.Path(out), injector.ctl.state if injector.ctl is not None else None, error)
    sys.exit(1 if error is not None else 0)
