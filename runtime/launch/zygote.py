"""The zygote: one process that imports the worker's modules once, then forks every local worker from itself.

A worker process spends most of its start importing JAX and the runtime
(1.3-1.5 s of CPU here); a run of five workers and a standby paid that six
times, side by side on the same cores. The local launcher instead starts one
zygote per run (with the workers' environment),
which imports :mod:`runtime.worker.worker_process` (JAX, gRPC, numpy) and forks a
worker on each request. JAX's backend is not started in the zygote (its
devices, the device count of ``XLA_FLAGS``, the compilation cache): each
child starts its own, so forking is safe and each child is a fresh JAX
process from there on. A forked worker is serving in about 0.3 s of CPU.

Protocol (the launcher writes to the zygote's stdin, it answers on stdout;
one line of JSON each):

- ``{"start": seq, "argv": [...], "env": {...}, "log": path}``:
  fork a worker running ``runtime.worker.worker_process.main(argv)`` with exactly
  ``env`` as its environment (the run secret, the device count of
  ``XLA_FLAGS``: all read after the fork), stdout and stderr appended to
  ``log`` and ``/dev/null`` as stdin; answers ``{"started": seq, "pid": pid}``.
  (A standby reads its identity from a named pipe of the launcher's,
  ``--identity-fifo``, not through the zygote.)
- ``{"import": [module, ...]}``: imports more modules before the next fork
  (a later run of the same process needs others).
- Once its imports are done it says ``{"ready": true}`` (starts asked for
  earlier wait for them).
- It reports every child's end: ``{"exited": pid, "status": code}`` (a
  negative code: killed by that signal, as ``subprocess`` reports it).

The zygote exits at end-of-file on its stdin (its launcher closed it, or
died). It is a helper, and its death costs nothing but itself: the workers
it forked hold nothing of it (no pipe, no parent watch; each watches the
run's owner, the client, with ``--owner-pid``) and go on serving, adopted by
the system; the launcher starts later workers as processes of their own
until a new zygote is ready (:class:`runtime.launch.launcher.LocalLauncher`).

A zygote depends only on what its imports read from the environment (the
JAX platform, the import path), so the runs of one process share it: a
launcher :func:`acquire` s one (started ahead by :func:`prestart` while the
client traces its programs, or left by an earlier run) and :func:`release` s
it when its run ends; the pooled ones end with the process.
:class:`Zygote` is the launcher's side, and :class:`Child` the handle of one
forked worker, with the part of ``subprocess.Popen``'s interface the
launcher uses.
"""

from __future__ import annotations

import atexit
import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
import traceback

__all__ = ["Child", "Signalled", "Zygote", "ZygoteError", "acquire", "prestart", "release"]

READY_SECONDS = 120.0   # how long a start may wait for the zygote's imports
#: Imported by the zygote beside the worker's own modules: what JAX imports on its first lowering of an
#: exported program (a worker's Load). With the data source's module (the launcher's ``preload``, which a
#: worker imports when it unpickles the data source), a warm Load measured 0.85-0.98 -> 0.46-0.68 s.
#: One that is missing is left out.
PRELOAD = ("scipy.linalg", "jax.experimental.multihost_utils", "jaxlib.mlir.extras", "jaxlib.mlir.dialects.mhlo")


class ZygoteError(OSError):
    """The zygote did not start, or stopped answering."""


class Signalled:
    """A process this one may signal but is not the parent of: ``send_signal``, ``kill`` and ``terminate`` as
    ``subprocess.Popen``'s, once ``poll`` (a subclass's) says it still runs."""

    pid: int

    def poll(self) -> int | None:
        raise NotImplementedError

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class Child(Signalled):
    """One forked worker: ``pid``, ``poll``, ``wait``, ``kill``, ``terminate`` (as ``subprocess.Popen``'s).

    Its end is reported by the zygote; once the zygote is gone, by looking
    at the process itself (it was adopted by another).
    """

    def __init__(self, zygote: Zygote, pid: int):
        self.pid, self._zygote = pid, zygote
        self.returncode: int | None = None
        self._ended = threading.Event()

    def _exited(self, status: int) -> None:
        self.returncode = status
        self._ended.set()

    def poll(self) -> int | None:
        if self.returncode is None and not self._zygote.alive() and not _exists(self.pid):
            self._exited(-signal.SIGKILL)   # its zygote is gone, so no one reports its end: it is over
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:   # told by the zygote, or looked at every 0.1 s once the zygote is gone
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"worker process {self.pid}", timeout)
            self._ended.wait(0.1 if left is None else min(left, 0.1))
        return self.returncode


class Zygote:
    """The launcher's side: starts the zygote with ``env``, importing ``preload`` modules too (besides
    :data:`PRELOAD`); its stderr goes to ``log_path``."""

    def __init__(self, env: dict[str, str], log_path: str, preload: tuple[str, ...] = ()):
        self.key = _key(env)
        self.imported = set(preload)
        with open(log_path, "ab") as log:
            self._proc = subprocess.Popen([sys.executable, "-c", "from runtime.launch.zygote import serve; serve()",
                                           *PRELOAD, *preload], env=env, stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, stderr=log)
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._seq = 0
        self._started: dict[int, int] = {}          # seq -> pid, until start() takes it
        self._children: dict[int, Child] = {}
        self._early: dict[int, int] = {}            # pid -> status reported before its Child existed
        self._ready = threading.Event()
        threading.Thread(target=self._read, name="zygote-reader", daemon=True).start()

    def alive(self) -> bool:
        return self._proc.poll() is None

    def ready(self) -> bool:
        """Whether it finished its imports (a start now forks at once) and still runs."""
        return self._ready.is_set() and self.alive()

    def start(self, argv: list[str], log_path: str, env: dict[str, str] | None = None) -> Child:
        """Forks a worker running ``runtime.worker.worker_process.main(argv)`` with ``env`` (None: the zygote's own);
        ``ZygoteError`` when the zygote cannot."""
        if env is not None and _key(env) != self.key:
            raise ZygoteError("a worker's JAX platform or import path differs from its zygote's")
        with self._cond:
            self._seq += 1
            seq = self._seq
            self._send({"start": seq, "argv": argv, "env": env, "log": log_path})
            if not self._cond.wait_for(lambda: seq in self._started or not self.alive(), READY_SECONDS):
                raise ZygoteError(f"the zygote did not fork a worker within {READY_SECONDS:.0f} s")
            if seq not in self._started:
                raise ZygoteError(f"the zygote exited with status {self._proc.poll()}")
            pid = self._started.pop(seq)
            child = self._children[pid] = Child(self, pid)
            if pid in self._early:
                child._exited(self._early.pop(pid))
            return child

    def ensure(self, modules: tuple[str, ...]) -> None:
        """Has the zygote import ``modules`` too (before its next fork) unless it did."""
        missing = [m for m in modules if m not in self.imported]
        if missing:
            with self._lock:
                self._send({"import": missing})
            self.imported.update(missing)

    def close(self) -> None:
        """Ends the zygote (its running workers go on: they answer to the run's owner, not to it)."""
        try:
            self._proc.stdin.close()
        except OSError:
            pass
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()

    def _send(self, message: dict) -> None:
        try:
            self._proc.stdin.write(json.dumps(message).encode() + b"\n")
            self._proc.stdin.flush()
        except (OSError, ValueError) as e:
            raise ZygoteError(f"the zygote is gone: {e}") from e

    def _read(self) -> None:
        for line in self._proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            with self._cond:
                if "ready" in msg:
                    self._ready.set()
                elif "started" in msg:
                    self._started[msg["started"]] = msg["pid"]
                elif "exited" in msg:
                    child = self._children.get(msg["exited"])
                    if child is None:
                        self._early[msg["exited"]] = msg["status"]
                    else:
                        del self._children[msg["exited"]]
                        child._exited(msg["status"])
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()   # the zygote ended: waiting starts fail at once


# -- one zygote per platform and import path, shared by the runs of this process ----------------------

_pool: dict[tuple, Zygote] = {}
_pool_lock = threading.Lock()


def _key(env: dict[str, str]) -> tuple:
    """What a zygote's imports read from its environment: children must agree on it."""
    return sys.executable, env.get("JAX_PLATFORMS", ""), env.get("PYTHONPATH", "")


def acquire(env: dict[str, str], log_path: str, preload: tuple[str, ...] = ()) -> Zygote:
    """A running zygote for ``env`` (a pooled one, else a new one logging to ``log_path``); give it back
    with :func:`release`."""
    with _pool_lock:
        zygote = _pool.pop(_key(env), None)
    if zygote is not None and zygote.alive():
        zygote.ensure(preload)
        return zygote
    return Zygote(env, log_path, preload)


def release(zygote: Zygote) -> None:
    """Keeps ``zygote`` for the next run of this process (one per key; another is closed)."""
    with _pool_lock:
        keep = zygote.alive() and zygote.key not in _pool
        if keep:
            _pool[zygote.key] = zygote
    if not keep:
        zygote.close()


def prestart(env: dict[str, str], preload: tuple[str, ...] = ()) -> None:
    """Starts a zygote for ``env`` now (its imports overlap the caller's work) unless one is pooled;
    best effort: a launcher that finds none starts its own."""
    with _pool_lock:
        pooled = _pool.get(_key(env))
    if pooled is not None:
        try:
            pooled.ensure(preload)
        except OSError:
            pass
        return
    try:
        zygote = Zygote(env, os.devnull, preload)
    except OSError:
        return
    release(zygote)


@atexit.register
def _close_pooled() -> None:
    with _pool_lock:
        zygotes = list(_pool.values())
        _pool.clear()
    for zygote in zygotes:
        zygote.close()


def _exists(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie no one reaped has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:   # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True


# -- the zygote process ------------------------------------------------------------------------------


def serve() -> None:
    """The zygote process's loop (``python -c "from runtime.launch.zygote import serve; serve()"``)."""
    import runtime.worker.worker_process as worker_process   # the imports every worker needs, once
    from runtime.core.owner import set_title

    _import(sys.argv[1:])   # PRELOAD and the launcher's own
    set_title(f"elastic-zygote (forks the local workers of process {os.getppid()})")

    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)   # a child's prints never land in the reply stream
    out.write(json.dumps({"ready": True}) + "\n")
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)   # wakes the loop through wake_w
    sel = selectors.DefaultSelector()
    sel.register(0, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    pending = b""
    while True:
        for key, _ in sel.select():
            if key.fd == wake_r:
                os.read(wake_r, 4096)
                _reap(out)
                continue
            data = os.read(0, 65536)
            if not data:
                return   # the launcher closed our stdin, or died
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                msg = json.loads(line)
                if "start" in msg:
                    pid = _fork(msg, worker_process, [out.fileno(), wake_r, wake_w])
                    out.write(json.dumps({"started": msg["start"], "pid": pid}) + "\n")
                elif "import" in msg:
                    _import(msg["import"])
        _reap(out)


def _import(modules) -> None:
    import importlib

    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a module that does not import here is imported (or not) by the worker
            pass


def _reap(out) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        out.write(json.dumps({"exited": pid, "status": os.waitstatus_to_exitcode(status)}) + "\n")


def _fork(msg: dict, worker_process, zygote_fds: list[int]) -> int:
    pid = os.fork()
    if pid:
        return pid
    status = 1
    try:   # the child: a worker from here on
        # A process group of its own: a signal to the client's (Ctrl-C, a terminal closing) misses it. Not a
        # session of its own: the kernel's autogroup scheduler would then weigh each worker like a whole
        # session, so local workers' share of a shared host would change with their number.
        os.setpgid(0, 0)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        log = os.open(msg["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        for fd in [log, *zygote_fds]:
            try:
                os.close(fd)
            except OSError:
                pass
        sys.stdin = os.fdopen(0, "r")
        sys.stdout = os.fdopen(1, "w", buffering=1)
        sys.stderr = os.fdopen(2, "w", buffering=1)
        if msg.get("env") is not None:
            os.environ.clear()
            os.environ.update(msg["env"])
        sys.argv = ["runtime.worker.worker_process", *msg["argv"]]
        worker_process.main(msg["argv"])   # ends the process itself (os._exit) once it ran
    except SystemExit as e:   # its arguments were refused (or --help)
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:   # noqa: BLE001 - told in its log, then the child ends
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(status)

if __name__ == "__main__":
    serve()
