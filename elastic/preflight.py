"""Checks a run makes before it starts anything: its run directory and what the local host can run.

Called on the client side by the trainer (``fit``, before it builds programs or
starts a worker) and by ``elastic run`` (before it imports JAX, so bad input
fails fast). Every refusal is a :class:`~elastic.config.ConfigError` whose one
line names the config key to change. Nothing here imports JAX.

* :func:`claim_run_directory`: creates ``<base_output_directory>/<run_name>``,
  proves it writable (a probe file written and removed) and locks it
  (``fcntl.flock`` on ``.lock`` inside it) until :meth:`RunDirectory.release`,
  so two runs never share a directory. The lock dies with the process.
* :func:`check_local_capacity`: refuses more worker processes (slices +
  spares) or simulated devices than this host can hold: a pure function of the
  counts and a :class:`HostCapacity`; :func:`check_config_capacity` applies it
  to a Config and this host.
* :func:`check_ray_cluster`: for Ray actors, refuses a cluster that does not
  answer, has no node on this machine, or cannot hold every actor at once;
  asked over its control store's gRPC, without starting a Ray driver.
* :func:`check_data_source`: refuses a data source whose ``element_spec()``
  does not describe one microbatch of the config (a global batch's shapes,
  most often), which the workers would otherwise find only when they run the
  programs. Pure apart from calling ``element_spec()``; no data is read.
* :func:`check_load_full_state_path`: refuses a ``load_full_state_path`` the
  run would start from but cannot (missing, unreadable, no complete
  checkpoint, or one at or past ``steps``): a listing of the store, before
  any worker starts.
* :func:`check_checkpoint_directory`: refuses a local checkpoint directory
  that local workers could not write (it is created here).
"""

from __future__ import annotations

import errno
import fcntl
import os
import pathlib
import sys
import tempfile
import time
from dataclasses import dataclass

from elastic.config import Config, ConfigError
from elastic.data import normalize_spec
from elastic.options import controller_options, run_settings
from runtime import BadInputError, locate_checkpoint, newest_checkpoint, ray_cluster_problem, ray_cluster_room

__all__ = [
    "PER_WORKER_BYTES",
    "HostCapacity",
    "RunDirectory",
    "check_config_capacity",
    "check_data_source",
    "check_checkpoint_directory",
    "check_load_full_state_path",
    "check_load_parameters_path",
    "check_local_capacity",
    "check_metrics_file",
    "check_output_directory",
    "check_ray_cluster",
    "claim_run_directory",
    "host_capacity",
]

#: A conservative estimate of one worker process's memory (Python + JAX + the bundled model).
PER_WORKER_BYTES = 300_000_000
#: Simulated devices allowed per worker process, on average.
_DEVICES_PER_WORKER = 4
_LOCK_NAME = ".lock"


# --------------------------------------------------------------------------- capacity


@dataclass(frozen=True)
class HostCapacity:
    """What the local launcher can use: CPU cores this process may run on, physical memory (None: unknown)."""

    cpu_count: int
    memory_bytes: int | None


def host_capacity() -> HostCapacity:
    """This host's :class:`HostCapacity` (cores in this process's affinity mask, total physical memory)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        memory = None
    return HostCapacity(cpu_count=max(cores, 1), memory_bytes=memory if memory and memory > 0 else None)


def check_local_capacity(slices: int, spares: int, devices_per_slice: int, max_local_workers: int,
                         host: HostCapacity, hosts_per_slice: int = 1) -> None:
    """Refuses a run the local launcher cannot hold; pure.

    Worker processes (``slices + spares``, times ``hosts_per_slice``) may number at most
    ``max_local_workers`` when it is positive, else the smaller of
    ``max(64, 4 x cores)`` and what the host's memory holds at
    :data:`PER_WORKER_BYTES` each. Simulated devices (workers x devices per
    slice) may number at most 4 x that limit.
    """
    workers = (slices + spares) * hosts_per_slice
    keys = f"config keys 'dcn_data_parallelism' ({slices}) and 'elastic_spares' ({spares})" + (
        f" with 'elastic_hosts_per_slice' ({hosts_per_slice})" if hosts_per_slice > 1 else "")
    override = "set elastic_max_local_workers to the most worker processes this host should run"
    if max_local_workers > 0:
        limit, why = max_local_workers, f"elastic_max_local_workers={max_local_workers}"
        override = "raise elastic_max_local_workers"
    else:
        limit = max(64, 4 * host.cpu_count)
        why = f"max(64, 4 x {host.cpu_count} CPU cores)"
        if host.memory_bytes is not None and host.memory_bytes // PER_WORKER_BYTES < limit:
            limit = max(host.memory_bytes // PER_WORKER_BYTES, 1)
            why = (f"{host.memory_bytes / 1e9:.1f} GB of memory at an estimated "
                   f"{PER_WORKER_BYTES / 1e6:.0f} MB per worker")
    if workers > limit:
        raise ConfigError(f"{keys} ask for {workers} local worker processes; this host allows {limit} ({why}); "
                          f"ask for fewer, or {override}")
    devices = (slices + spares) * devices_per_slice
    if devices > _DEVICES_PER_WORKER * limit:
        raise ConfigError(f"config keys 'dcn_data_parallelism' ({slices}), 'elastic_spares' ({spares}) and "
                          f"'ici_fsdp_parallelism' ({devices_per_slice}) ask for {devices} simulated "
                          f"devices on this host; it allows {_DEVICES_PER_WORKER * limit} "
                          f"({_DEVICES_PER_WORKER} x {limit} workers, {why}); ask for fewer, or {override}")


def check_config_capacity(cfg: Config, host: HostCapacity | None = None) -> None:
    """:func:`check_local_capacity` for the workers ``cfg`` starts (spares after ``elastic_enabled``); for Ray
    actors, :func:`check_ray_cluster`."""
    opts = controller_options(cfg, "")
    if opts.launcher == "ray":
        check_ray_cluster(opts)
    if opts.launcher != "local":
        return   # the workers run elsewhere: Ray's or the scheduler's capacity, not this host's
    check_local_capacity(opts.slices, opts.spares, opts.devices_per_slice, run_settings(cfg).max_local_workers,
                         host or host_capacity(), opts.hosts_per_slice)


def check_ray_cluster(opts) -> None:
    """Refuses a run on a Ray cluster (``opts``: its ``ControllerOptions``) that does not answer within
    ``elastic_register_timeout_seconds`` (at most 60 s), that has no node on this machine for the client to join,
    or whose live nodes cannot hold every worker actor at once (slices and spares, an actor per host of each, 1
    CPU each and its devices as GPUs on the GPU platform): such actors would wait for a CPU until the registration
    timeout. The nodes are those up now (an autoscaler's later ones do not count). Starts no Ray driver."""
    timeout = min(opts.register_timeout_seconds, 60.0)
    if problem := ray_cluster_problem(opts.ray_address, timeout):
        raise ConfigError(problem)
    hosts = opts.hosts_per_slice   # a slice of several hosts is an actor per host, each with its share of devices
    gpus = opts.devices_per_slice // hosts if opts.platform == "gpu" else 0
    room = ray_cluster_room(opts.ray_address, timeout, gpus)
    workers = (opts.slices + opts.spares) * hosts
    if room is None or room.actors >= workers:
        return
    where = f"ray_address={opts.ray_address}" if opts.ray_address else f"$RAY_ADDRESS={os.environ['RAY_ADDRESS']}"
    each = f"1 CPU and {gpus} GPUs" if gpus else "1 CPU"
    has = f"{room.cpus:g} CPUs" + (f" and {room.gpus:g} GPUs" if gpus else "")
    keys = f"'dcn_data_parallelism' ({opts.slices}) and 'elastic_spares' ({opts.spares})"
    if hosts > 1:
        keys = f"'dcn_data_parallelism' ({opts.slices}), 'elastic_spares' ({opts.spares}) and " \
               f"'elastic_hosts_per_slice' ({hosts})"
    raise ConfigError(f"config keys {keys} ask for {workers} Ray actors of {each} each; the cluster at {where} holds "
                      f"{room.actors} ({has} on {room.nodes} node{'s' * (room.nodes != 1)}): add CPUs or nodes to it "
                      "(`ray start --num-cpus=N`), or ask for fewer")


# --------------------------------------------------------------------------- data source


def check_data_source(data, cfg: Config) -> None:
    """Refuses ``data`` when its ``element_spec()`` is not one microbatch of ``cfg``: a ConfigError saying that the
    spec is per microbatch, the microbatch size and the keys it comes from.

    Refused: a key whose leading (batch) dimension is the global batch (``cfg.global_batch_size``, when that
    differs from ``cfg.microbatch_size``), and a spec in which no key's leading dimension is
    ``cfg.microbatch_size``. A key with another leading dimension beside a key of the microbatch's is allowed
    (a table every microbatch carries). A data source without ``element_spec``, or with a malformed one, is
    left to the trainer, which names what it must be. Called by ``fit`` in the client before anything starts
    (the run directory, the workers); no batch is read: a source may read files that only the workers' hosts
    have.
    """
    element_spec = getattr(data, "element_spec", None)
    if not callable(element_spec):
        return
    try:
        spec = normalize_spec(element_spec())
    except ValueError:
        return   # the trainer's own check names what the spec must look like
    size, total = cfg.microbatch_size, cfg.global_batch_size
    leading = {key: shape[0] if shape else None for key, (shape, _) in spec.items()}
    wrong = next((k for k, n in leading.items() if n == total != size), None)
    if wrong is None and spec and size not in leading.values():
        wrong = next(iter(leading))
    if wrong is None:
        return
    shape, n = spec[wrong][0], leading[wrong]
    if n == total:
        hint = f"; {n} is the global batch ({cfg.microbatches} microbatches x {size})"
    elif n and n % cfg.ici_fsdp_parallelism == 0:
        hint = (f" (or, if a microbatch of yours has {n} examples, set per_device_batch_size="
                f"{n // cfg.ici_fsdp_parallelism})")
    else:
        hint = ""
    raise ConfigError(
        f"the data source's element_spec()[{wrong!r}] has shape {shape}, but element_spec is per microbatch: a "
        f"microbatch here has {size} examples (per_device_batch_size {cfg.per_device_batch_size} x "
        f"ici_fsdp_parallelism {cfg.ici_fsdp_parallelism}), so its leading dimension must be {size}, as "
        f"batch(step, microbatch) returns it{hint}")


# --------------------------------------------------------------------------- run directory


class RunDirectory:
    """A run directory this process owns: created, writable and locked until :meth:`release`."""

    def __init__(self, path: pathlib.Path, lock_fd: int):
        self.path = path
        self._fd: int | None = lock_fd

    def held(self) -> bool:
        """Whether this process still holds the run directory: its lock file is the one there (a client that
        found this one stopped took the run over by renaming it aside)."""
        if self._fd is None:
            return False
        try:
            return os.fstat(self._fd).st_ino == os.stat(self.path / _LOCK_NAME).st_ino
        except OSError:
            return False

    def release(self) -> None:
        """Drops the lock (idempotent); another run may take the directory from now on."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunDirectory:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def claim_run_directory(base_output_directory: str, run_name: str) -> RunDirectory:
    """Creates, probes and locks ``<base_output_directory>/<run_name>``; ConfigError if it cannot be used.

    An empty ``run_name`` names the run by its start time (``run-YYYYmmdd-HHMMSS``,
    with ``-1``, ``-2``... for runs started in the same second). A directory
    another live run holds is refused, naming it and suggesting another
    ``run_name``. The run name is already validated by the Config (it stays
    inside ``base_output_directory``).
    """
    base = pathlib.Path(base_output_directory)
    _make_base(base)
    if run_name:
        path = base / run_name
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise _unusable(path, e, "run_name") from None
    else:
        path = _fresh_dir(base, time.strftime("run-%Y%m%d-%H%M%S"))
    fd = _lock(path)
    try:
        _probe(path)
    except BaseException:
        os.close(fd)
        raise
    return RunDirectory(path, fd)


def check_load_full_state_path(path: str, checkpoint_directory: str, steps: int) -> None:
    """Refuses ``load_full_state_path`` (``path``) when the run would start from it and cannot: it cannot be
    read or holds no complete checkpoint (``runtime.locate_checkpoint``, the controller's own rule).

    Called by ``fit`` before any worker starts. Nothing to check without a
    path, or when the run's own ``checkpoint_directory`` holds a complete
    checkpoint at or before ``steps`` (the run resumes from that and never
    reads ``path``, as MaxText does). Raises a one-line ``ConfigError``
    naming the key; also when the checkpoint is of a step at or past
    ``steps`` (the run would train nothing).
    """
    if not path or newest_checkpoint(checkpoint_directory, steps) is not None:
        return
    try:
        _, step = locate_checkpoint(path)
    except BadInputError as e:
        raise ConfigError(f"config key {str(e).splitlines()[0]}") from None
    if step >= steps:
        raise ConfigError(f"config key load_full_state_path {path!r} holds the state after {step} steps, and the run "
                          f"has steps={steps}: nothing to train; give steps greater than {step}")


def check_checkpoint_directory(directory: str) -> None:
    """Refuses a local checkpoint ``directory`` this host's workers could not write (a file in the way, no
    permission, a path under ``/proc``): created now, or one-line ``ConfigError`` naming the key. Called by
    ``fit`` for local workers before any starts (remote workers' file systems are theirs to check; ``gs://``
    is reached by the workers)."""
    if not directory or "://" in directory:
        return
    try:
        os.makedirs(directory, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=directory, prefix=".write-check-")
        probe.close()
    except OSError as e:
        raise ConfigError(f"config key elastic_checkpoint_directory {directory!r} cannot be written: "
                          f"{e.strerror or e}; choose a writable directory (or leave it empty for "
                          "<run directory>/checkpoints)") from None


def check_load_parameters_path(path: str, programs, checkpoint_directory: str = "", steps: int = 0) -> None:
    """Refuses ``load_parameters_path`` (``path``) when a fresh start would read it and cannot: it does not
    exist, holds no ``items`` tree, or the model's checkpoints name no parameters (``programs``' checkpoint
    tree has no ``params`` subtree). Nothing to check without a path, or when the run resumes from its own
    ``checkpoint_directory`` (it then never reads ``path``, as MaxText does). One-line ``ConfigError``."""
    if not path or (checkpoint_directory and newest_checkpoint(checkpoint_directory, steps) is not None):
        return
    tree = programs.checkpoint_tree
    if not (isinstance(tree, dict) and isinstance(tree.get("skeleton"), dict) and "params" in tree["skeleton"]):
        raise ConfigError("config key load_parameters_path: this model's checkpoints name no parameters (no "
                          "'params' in its checkpoint tree; elastic.wrap(..., checkpoint_tree=) names them); "
                          "use load_full_state_path with a whole state")
    root = path.rstrip("/").removesuffix("/items")
    if "://" not in root and not os.path.isdir(os.path.join(root, "items")):
        what = ("does not exist" if not os.path.exists(path) else
                "holds its state as a flat list that names no parameters (an older jax-elastic wrote it); start "
                "from it whole with load_full_state_path"
                if os.path.isdir(os.path.join(root, "state")) else
                "holds no 'items' tree (a checkpoint's <dir>/<step>, or a run's checkpoint directory)")
        raise ConfigError(f"config key load_parameters_path {path!r} {what}")


def check_metrics_file(path: str) -> None:
    """Refuses a ``metrics_file`` the client cannot append to (its directory missing or not writable, a
    directory given): a one-line ``ConfigError`` naming the key. Called by ``fit`` before anything starts;
    the file is created empty if it was not there (the run's first step would create it)."""
    if not path:
        return
    try:
        with open(path, "a", encoding="utf-8"):
            pass
    except OSError as e:
        raise ConfigError(f"config key 'metrics_file' ({path!r}): cannot append to it: {e.strerror or e}; choose a "
                          "writable file (its directory must exist)") from None


def check_output_directory(base_output_directory: str, run_name: str) -> None:
    """``elastic run``'s early check: the directory a run would claim is usable now (claimed, then released).

    An unnamed run only checks that ``base_output_directory`` is a writable
    directory (its name is picked when the run claims it).
    """
    if run_name:
        claim_run_directory(base_output_directory, run_name).release()
        return
    base = pathlib.Path(base_output_directory)
    _make_base(base)
    _probe(base)


def _make_base(base: pathlib.Path) -> None:
    if base.exists() and not base.is_dir():
        raise ConfigError(f"config key 'base_output_directory' ({str(base)!r}): {base} is not a directory")
    try:
        base.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _unusable(base, e, "base_output_directory") from None


def _fresh_dir(base: pathlib.Path, stem: str) -> pathlib.Path:
    for i in range(1000):
        path = base / (stem if i == 0 else f"{stem}-{i}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
        except OSError as e:
            raise _unusable(path, e, "base_output_directory") from None
    raise ConfigError(f"config key 'run_name' is empty and {base} already holds 1000 runs named {stem}*; "
                      "set run_name")


def _lock(path: pathlib.Path) -> int:
    lock = path / _LOCK_NAME
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise _unusable(path, e, "base_output_directory") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read_holder(fd)
        os.close(fd)
        pid = int(holder.strip(" ()pid") or 0) if holder else 0
        if pid and _stopped(pid):
            return _take_over(path, pid)
        raise ConfigError(f"run directory {path} is in use by another run{holder}; wait for it to finish or "
                          f"choose another run_name (config key 'run_name')") from None
    except OSError as e:
        os.close(fd)
        raise _unusable(path, e, "base_output_directory") from None
    return _hold(path, fd)


def _hold(path: pathlib.Path, fd: int) -> int:
    """The locked ``fd`` of ``path``'s lock file, with this process written in it; stale locks of stopped
    clients that have ended since are removed."""
    for stale in path.glob(f"{_LOCK_NAME}.stale-*"):
        pid = stale.name.rpartition("-")[2]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            stale.unlink(missing_ok=True)
    try:   # who holds it, for the message another run gets
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError as e:
        os.close(fd)
        raise _unusable(path, e, "base_output_directory") from None
    return fd


def _stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP, a terminal's Ctrl-Z, a debugger): it holds its run
    directory but drives nothing."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _take_over(path: pathlib.Path, pid: int) -> int:
    """The run directory's lock is held by ``pid``, a stopped client: this one takes the run over.

    The stopped client keeps its lock on the old lock file, renamed aside
    (``.lock.stale-<pid>``); this one locks a new one. Should the stopped
    client wake, every worker refuses it (this client's generation is newer)
    and it exits without writing to the run directory. Serialized by a second
    lock, so two clients never both take over."""
    guard = os.open(path / f"{_LOCK_NAME}.takeover", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(guard, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(f"run directory {path} is being taken over by another client; choose another "
                              "run_name (config key 'run_name')") from None
        fd = os.open(path / _LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return _hold(path, fd)   # the stopped client ended meanwhile
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
        if holder != f" (pid {pid})" or not _stopped(pid):
            raise ConfigError(f"run directory {path} is in use by another run{holder}; wait for it to finish or "
                              f"choose another run_name (config key 'run_name')")
        os.replace(path / _LOCK_NAME, path / f"{_LOCK_NAME}.stale-{pid}")
        fd = os.open(path / _LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        print(f"elastic: the client holding {path} (pid {pid}) is stopped: this one takes the run over (the "
              "stopped one is refused by every worker if it resumes)", file=sys.stderr)
        return _hold(path, fd)
    finally:
        os.close(guard)


def _read_holder(fd: int) -> str:
    try:
        pid = os.pread(fd, 32, 0).decode().strip()
    except (OSError, UnicodeDecodeError):
        return ""
    return f" (pid {pid})" if pid.isdigit() else ""


def _probe(path: pathlib.Path) -> None:
    """Writes and removes a small file: a directory that refuses it would fail the run later."""
    probe = path / f".write-probe-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            if os.write(fd, b"probe\n") != 6:
                raise OSError(errno.ENOSPC, "short write (is the disk full?)")
        finally:
            os.close(fd)
        os.unlink(probe)
    except OSError as e:
        try:
            os.unlink(probe)
        except OSError:
            pass   # never created, or the directory refuses even that: the error below says why
        raise _unusable(path, e, "base_output_directory") from None


def _unusable(path: pathlib.Path, error: OSError, key: str) -> ConfigError:
    why = error.strerror or str(error)
    return ConfigError(f"cannot write run files to {path}: {why}; choose a writable directory "
                       f"(config key {key!r})")
