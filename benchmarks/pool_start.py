"""A run's time to its first committed step: leasing a warm shared pool's hosts against launching its own workers.

The same ``elastic run tiny dcn_data_parallelism=2 ici_fsdp_parallelism=1
steps=5`` (two workers of one CPU device each), two ways, alternated (ABBA:
a b, b a, ...) ``--repeats`` times in one sitting, each with a run name of its
own:

- (a) warm pool: with ``elastic_pool=ADDRESS`` of a pool this script started
  beforehand (``elastic pool serve DIR --local-hosts N --devices 1``, on
  127.0.0.1), once ``elastic pool status DIR --json`` lists its N hosts free
  and their agents and zygotes have gone quiet (their imports done; at least
  ``--warm-seconds`` after the hosts showed);
- (b) fresh launch: the same run on its own local workers (the default
  launcher: the client starts a zygote as it starts, and forks the workers
  from it once it is ready).

Before every run, (a) or (b), the pool lists every host free again (the
previous run's leases wiped) and its hosts are quiet again.

Cache policy, the same for both: every run gets a fresh, empty
``jax_cache_dir`` of its own (the pool passes a run's compilation cache
directory on to the hosts it leases), so neither gains from another's
compiles: in both, the first worker compiles the programs and the other reads
what it wrote.

Measured per run: Popen (the wall time just before it) -> the ``t`` of the
first ``step_committed`` event in ``<base>/<run>/events.jsonl``; the same to
the client's ``job_started`` (its Python start and imports), ``programs_built``
(tracing and exporting), the last ``worker_registered`` and
``programs_loaded`` (the workers' compile); the client's own CPU seconds up to
the first step (``/proc/<pid>/stat``, its threads only) and the command's CPU
from its rusage (the client and what it reaped: in (b) its zygote and
workers too, in (a) the client alone).

Prints a row per run, the medians, and LAST the ratio warm pool / fresh launch
of the medians of launch -> first committed step. The pool is stopped at the
end (SIGTERM to ``elastic pool serve``, SIGKILL to its agents' sessions) and
the temporary directory removed (unless ``--out``).

Usage: .venv/bin/python benchmarks/pool_start.py [--repeats 3] [--warm-seconds 10] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from _cli import ROOT, new_events

TICK = os.sysconf("SC_CLK_TCK")
RUN = ["run", "tiny", "dcn_data_parallelism=2", "ici_fsdp_parallelism=1", "steps=5"]
HOSTS = 2                     # the run's workers: dcn_data_parallelism=2, no spares
RUN_TIMEOUT = 300.0           # seconds one run may take before it is stopped and the benchmark fails


class Failed(Exception):
    """A run or the pool failed: the message carries the log lines that say why."""


# -- processes -------------------------------------------------------------------------------------------------

def base_env() -> dict[str, str]:
    """The CPU platform, this checkout on the path; no inherited device count, compilation cache or pool
    credentials."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    for k in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR", "ELASTIC_POOL_TOKEN", "ELASTIC_POOL_SECRET",
              "ELASTIC_POOL_TOKENS"):
        env.pop(k, None)
    return env


def elastic(*args: str) -> list[str]:
    return [sys.executable, "-m", "elastic.cli", *args]


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def own_cpu(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid``'s own threads (not its children); None once it is gone."""
    fields = _stat(pid)
    return None if fields is None else (int(fields[11]) + int(fields[12])) / TICK


def tree_of(roots: list[int]) -> list[int]:
    """``roots`` and every process descended from them (by their parent pids, read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat(int(entry))
            if fields is not None:
                children.setdefault(int(fields[1]), []).append(int(entry))
    out, todo = [], list(roots)
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def in_sessions(sids: list[int]) -> list[int]:
    """The processes of these sessions (each pool agent leads one: its zygote and leased workers are in it)."""
    out = []
    for entry in os.listdir("/proc"):
        fields = _stat(int(entry)) if entry.isdigit() else None
        if fields is not None and int(fields[3]) in sids:
            out.append(int(entry))
    return out


def kill(pids, group: bool = False) -> None:
    for pid in pids:
        try:
            (os.killpg if group else os.kill)(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def tail(path: pathlib.Path, lines: int = 15) -> str:
    if not path.exists():
        return f"  ({path}: none)"
    text = path.read_text(errors="replace").splitlines()[-lines:]
    return "\n".join(f"  {path.name}: {line}" for line in text) or f"  ({path.name}: empty)"


# -- the pool ----------------------------------------------------------------------------------------------------

class Pool:
    """``elastic pool serve DIR --local-hosts N --devices 1`` on 127.0.0.1, stopped by :meth:`stop`."""

    def __init__(self, directory: pathlib.Path, hosts: int):
        self.dir, self.hosts = directory, hosts
        self.log = directory.parent / "pool-serve.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                elastic("pool", "serve", str(directory), "--local-hosts", str(hosts), "--devices", "1",
                        "--host", "127.0.0.1"),
                env=base_env(), cwd=directory.parent, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True)
        self.address = self.token = ""

    def agents(self) -> list[int]:
        path = self.dir / "hosts.json"
        try:
            return list(json.loads(path.read_text()).values())
        except (OSError, ValueError):
            return []

    def status(self) -> dict:
        proc = subprocess.run(elastic("pool", "status", str(self.dir), "--json"), env=base_env(),
                              capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            raise Failed(f"elastic pool status failed ({proc.returncode}): {proc.stderr.strip()[-1000:]}")
        return json.loads(proc.stdout)

    def logs(self) -> str:
        return "\n".join([tail(self.log), *(tail(p) for p in sorted((self.dir / "hosts").glob("*.log")))])

    def wait_free(self, timeout: float = 120.0) -> dict:
        """Until the pool lists all its hosts, every one free; answers that status."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise Failed(f"elastic pool serve exited ({self.proc.returncode}):\n{self.logs()}")
            status = None
            if (self.dir / "pool.json").exists():
                try:
                    status = self.status()
                except (Failed, ValueError, subprocess.TimeoutExpired):
                    status = None
            if status and status["hosts"] == self.hosts and status["free"] == self.hosts:
                return status
            if time.monotonic() > deadline:
                raise Failed(f"the pool did not list {self.hosts} free hosts within {timeout:.0f} s (last status: "
                             f"{status}):\n{self.logs()}")
            time.sleep(0.5)

    def start(self, warm_seconds: float, timeout: float = 180.0) -> float:
        """Waits until the hosts are listed free and warm; answers the seconds from the serve's start."""
        t0 = time.monotonic()
        self.wait_free(timeout)
        record = json.loads((self.dir / "pool.json").read_text())
        self.address = record["address"]
        if not self.address.startswith("127.0.0.1:"):
            raise Failed(f"the pool serves on {self.address}, not on 127.0.0.1")
        self.token = (self.dir / "tokens").read_text().splitlines()[0].partition("=")[2].strip()
        self.wait_quiet(min_wait=warm_seconds, timeout=timeout)
        return time.monotonic() - t0

    def wait_quiet(self, min_wait: float = 0.0, timeout: float = 120.0) -> None:
        """Until every agent has a child (its zygote) and the agents with their children used under 0.05 CPU
        seconds in the last second (the zygotes' imports are done), and at least ``min_wait`` seconds."""
        t0 = time.monotonic()
        before = None
        while True:
            agents = self.agents()
            tree = tree_of(agents)
            cpu = sum(c for c in map(own_cpu, tree) if c is not None)
            has_zygote = len(agents) == self.hosts and len(tree) >= 2 * self.hosts
            if (before is not None and has_zygote and cpu - before < 0.05
                    and time.monotonic() - t0 >= min_wait):
                return
            if time.monotonic() - t0 > timeout:
                why = (f"{cpu - (before or 0):.2f} CPU s in the last second" if has_zygote else
                       "an agent has no child: its zygote did not start or died (a zygote's stderr goes to "
                       "/dev/null)")
                raise Failed(f"the pool's hosts did not go quiet within {timeout:.0f} s (agents {agents}, their "
                             f"processes {tree}: {why}):\n{self.logs()}")
            before = cpu
            time.sleep(1.0)

    def stop(self) -> None:
        """SIGTERM to the serve process (it tells its agents to leave), then SIGKILL to every agent's session."""
        agents = self.agents()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                kill([self.proc.pid], group=True)
                self.proc.wait()
        kill(agents, group=True)              # each agent leads its own session and process group
        kill(in_sessions(agents))             # a leased worker in a group of its own, if one was left


# -- one run -----------------------------------------------------------------------------------------------------

def one_run(base: pathlib.Path, name: str, cache: pathlib.Path, pool: Pool | None) -> dict:
    """One ``elastic run`` as a child process; answers its milestones (seconds after the Popen) and CPU."""
    env = base_env()
    args = [*RUN]
    if pool is not None:
        env["ELASTIC_POOL_TOKEN"] = pool.token
        args.append(f"elastic_pool={pool.address}")
    cache.mkdir(parents=True)
    cmd = elastic(*args, f"jax_cache_dir={cache}", f"base_output_directory={base}", f"run_name={name}", "--quiet")
    path = base / name / "events.jsonl"
    errlog = base / f"{name}.client.log"
    first_cpu = None
    offset = 0
    with open(errlog, "wb") as err:
        t0 = time.time()
        proc = subprocess.Popen(cmd, env=env, cwd=base, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=err, start_new_session=True)
    deadline = time.monotonic() + RUN_TIMEOUT
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        cpu = own_cpu(proc.pid)
        if first_cpu is None:
            events, offset = new_events(path, offset)
            if any(e["kind"] == "step_committed" for e in events):
                first_cpu = cpu
        if time.monotonic() > deadline:
            events = read_events(path)
            kill([proc.pid], group=True)
            kill(e["pid"] for e in events if e["kind"] == "worker_registered")
            proc.wait()
            raise Failed(f"{name}: no end within {RUN_TIMEOUT:.0f} s (its last events: "
                         f"{[e['kind'] for e in events[-8:]]}); stopped:\n{tail(errlog)}"
                         + (f"\n{pool.logs()}" if pool else ""))
        time.sleep(0.02)
    proc.returncode = os.waitstatus_to_exitcode(status)
    events = read_events(path)
    if proc.returncode != 0:
        report = base / name / "report.json"
        why = json.loads(report.read_text()).get("verdict_reasons") if report.exists() else None
        raise Failed(f"{name}: elastic {' '.join(args)} failed ({proc.returncode}): {why}\n{tail(errlog)}"
                     + (f"\n{pool.logs()}" if pool else ""))

    def at(kind: str) -> float:
        """Seconds from the Popen to the first ``kind`` event."""
        t = next((e["t"] for e in events if e["kind"] == kind), None)
        if t is None:
            raise Failed(f"{name}: no {kind} event in {path}")
        return t - t0

    leases = sum(e["kind"] == "lease_granted" for e in events)
    if leases != (HOSTS if pool is not None else 0):
        raise Failed(f"{name}: {leases} lease_granted events, expected {HOSTS if pool is not None else 0}")
    compiled = next(e["compile_seconds"] for e in events if e["kind"] == "programs_loaded")
    registered = [e["t"] for e in events if e["kind"] == "worker_registered"][:HOSTS]
    return {
        "first_step": at("step_committed"),
        "job_started": at("job_started"),
        "programs_built": at("programs_built"),
        "registered": max(registered) - t0,
        "programs_loaded": at("programs_loaded"),
        "compile_max": max(compiled.values()),
        "client_cpu_first": first_cpu if first_cpu is not None else float("nan"),
        "rusage_cpu": usage.ru_utime + usage.ru_stime,
    }


def read_events(path: pathlib.Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


# -- main --------------------------------------------------------------------------------------------------------

COLUMNS = (("first_step", "first step"), ("job_started", "job_started"), ("programs_built", "built"),
           ("registered", "registered"), ("programs_loaded", "loaded"), ("compile_max", "compile"),
           ("client_cpu_first", "client CPU"), ("rusage_cpu", "rusage CPU"))


def row(label: str, r: dict) -> str:
    return f"{label:24s}" + "".join(f"{r[k]:>12.2f}" for k, _ in COLUMNS)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3, help="pairs of runs, (a) and (b) alternated")
    ap.add_argument("--warm-seconds", type=float, default=10.0,
                    help="at least this long between the pool listing its hosts and the first run")
    ap.add_argument("--out", default="", help="keep the pool's and the runs' directories here (default: a "
                                              "temporary directory, removed at the end)")
    args = ap.parse_args()
    tmp = pathlib.Path(args.out).resolve() if args.out else pathlib.Path(tempfile.mkdtemp(prefix="pool-start-"))
    tmp.mkdir(parents=True, exist_ok=True)
    base, caches, pool_dir = tmp / "runs", tmp / "caches", tmp / "pool"
    base.mkdir(exist_ok=True)
    results: dict[str, list[dict]] = {"pool": [], "fresh": []}
    pool = None
    t_start = time.monotonic()
    try:
        pool = Pool(pool_dir, HOSTS)
        ready = pool.start(args.warm_seconds)
        print(f"elastic {' '.join(RUN)}, a fresh empty jax_cache_dir per run; pool {pool.address} with {HOSTS} "
              f"local hosts of 1 device, warm {ready:.1f} s after its start; {len(os.sched_getaffinity(0))} cores, "
              f"load average {os.getloadavg()[0]:.2f}", flush=True)
        print("seconds after Popen: first step (first step_committed), job_started (the client's Python and "
              "imports), built (programs traced and exported), registered (the last worker), loaded (programs "
              "compiled or read on the workers); compile: the slowest worker's; client CPU: the client's own "
              "threads up to the first step; rusage CPU: the command's, with what it reaped ((b): its zygote "
              "and workers)")
        print(f"{'run':24s}" + "".join(f"{h:>12s}" for _, h in COLUMNS), flush=True)
        for i in range(args.repeats):
            for kind in (("pool", "fresh") if i % 2 == 0 else ("fresh", "pool")):
                name = f"r{i}-{kind}"
                pool.wait_free()                # both: the previous run's leases wiped, its processes gone
                pool.wait_quiet(timeout=60)
                r = one_run(base, name, caches / name, pool if kind == "pool" else None)
                results[kind].append(r)
                print(row(f"{name} ({'a' if kind == 'pool' else 'b'})", r), flush=True)
    except Failed as e:
        print(f"FAILED: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        if pool is not None:
            pool.stop()
        if not args.out:
            shutil.rmtree(tmp, ignore_errors=True)
    med = {k: {f: statistics.median(r[f] for r in rs) for f, _ in COLUMNS} for k, rs in results.items()}
    print("medians:")
    print(row("(a) warm pool", med["pool"]))
    print(row("(b) fresh launch", med["fresh"]))
    per = {k: " ".join(f"{r['first_step']:.2f}" for r in rs) for k, rs in results.items()}
    print(f"per repeat, launch -> first committed step (s): (a) {per['pool']}; (b) {per['fresh']}; benchmark wall time "
          f"{time.monotonic() - t_start:.0f} s, load average {os.getloadavg()[0]:.2f}")
    a, b = med["pool"], med["fresh"]
    print(f"ratio warm pool / fresh launch, launch -> first committed step: {a['first_step'] / b['first_step']:.3f}x "
          f"({a['first_step']:.2f} s against {b['first_step']:.2f} s; workers registered {a['registered']:.2f} s "
          f"against {b['registered']:.2f} s; client CPU to the first step {a['client_cpu_first']:.2f} s against "
          f"{b['client_cpu_first']:.2f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
