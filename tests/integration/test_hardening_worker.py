"""Worker hardening on real worker processes over real gRPC: the lease, prompt exits, security events.

The controller is the real registration service (``runtime.control.registry.Registry``) on a real server, and
the test drives the worker with the controller's calls itself, so each test decides exactly who talks to the
worker and when (``tests/support/worker_harness.py``). Each worker's log is kept in the test's ``tmp_path``.
"""

import dataclasses
import os
import pathlib
import queue
import signal
import subprocess
import sys
import threading
import time

import grpc
import jax
import jax.numpy as jnp
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from runtime.wire import auth, rpc
from runtime._proto import elastic_pb2 as pb
from runtime._proto import elastic_pb2_grpc as pb_grpc
from runtime.core.events import EventLog, read_events
from tests.support.worker_harness import (FENCE, RUN, SECRET, Controller, data_source, load_request, member,
                                          start_worker, stop, tiny_programs, worker_command, worker_env)

HEALTH = health_pb2.HealthCheckRequest(service="")


# -- helpers --------------------------------------------------------------------


def member_health(address: str) -> health_pb2_grpc.HealthStub:
    return health_pb2_grpc.HealthStub(rpc.channel(address, SECRET))


def slow_to_compile(programs):
    """``programs`` with an init program that takes XLA a long time to compile (tens of seconds on CPU)."""
    def init(x):
        for i in range(400):   # a reversed cumsum chain that XLA's CPU pipeline handles slowly
            x = jnp.tanh(x * (1.0 + i * 1e-3)) + jnp.cumsum(x)[::-1] * 1e-3
        return x
    blob = jax.export.export(jax.jit(init), platforms=["cpu"])(jax.ShapeDtypeStruct((64,), jnp.float32)).serialize()
    (stage,) = programs.by_stage
    return dataclasses.replace(programs, by_stage=(dataclasses.replace(stage, blobs={**stage.blobs, "init": bytes(blob)}),))


def wait_for_log(path, text: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in pathlib.Path(path).read_text(errors="replace"):
        assert time.monotonic() < deadline, f"{text!r} not in the log within {timeout} s"
        time.sleep(0.1)


def wait_exit(proc: subprocess.Popen, timeout: float) -> int | None:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        return None


class Stranger:
    """A caller without the run secret hammering a worker's health Check (and a control RPC) from a thread."""

    def __init__(self, address: str, secret: str | None = None):
        channel = grpc.insecure_channel(address)
        if secret is not None:
            channel = auth.secure_channel(channel, secret)
        self.health = health_pb2_grpc.HealthStub(channel)
        self.worker = pb_grpc.WorkerStub(channel)
        self.codes: list = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            for call in (lambda: self.health.Check(HEALTH, timeout=0.5),
                         lambda: self.worker.Progress(pb.ProgressRequest(fence=FENCE), timeout=0.5)):
                try:
                    call()
                    self.codes.append(grpc.StatusCode.OK)
                except grpc.RpcError as e:
                    self.codes.append(e.code())
            self._stop.wait(0.02)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(10)


# -- A: only authenticated controller calls renew the lease ----------------------


def test_a_zombie_worker_fences_itself_although_a_stranger_keeps_calling_it(tmp_path):
    """Stopped and resumed while a caller without the secret hammers its health Check, the worker fences.

    Nothing with the run secret calls the worker after its Load, so only the stranger's calls could renew the
    lease: the worker must go NOT_SERVING once the lease lapsed, ask to rejoin, and exit with status 3 when
    refused.
    """
    health_when_rejoining = []

    def refuse(worker_id):   # the fenced worker's rejoin: look at its health while it waits for the answer
        health_when_rejoining.append(member_health(info.address).Check(HEALTH, timeout=10).status)
        return "fenced: the run moved on without it"

    controller = Controller(tmp_path, refuse)
    proc = start_worker(controller, "w0", tmp_path / "worker-w0.log")
    try:
        info = controller.wait_for("w0")
        member(info.address).Load(load_request(tiny_programs(), lease=3.0), timeout=120)
        with Stranger(info.address) as stranger:
            os.kill(proc.pid, signal.SIGSTOP)      # a pause shorter than the lease: the stranger's calls queue up
            time.sleep(1.0)
            os.kill(proc.pid, signal.SIGCONT)
            status = wait_exit(proc, 60)
        assert status == 3, f"the worker did not fence itself and exit with 3 (status {status}); see {tmp_path}"
        assert health_when_rejoining == [health_pb2.HealthCheckResponse.NOT_SERVING]
        assert grpc.StatusCode.UNAUTHENTICATED in stranger.codes and grpc.StatusCode.OK not in stranger.codes
        refused = [e for e in read_events(controller.events_path) if e["kind"] == "register_refused"]
        assert [(e["worker"], e["rejoin"]) for e in refused] == [("w0", True)]
    finally:
        stop(proc)
        controller.close()


# -- B: a worker that must go goes at once, whatever it is doing -------------------


def test_a_fenced_worker_refused_on_rejoin_exits_with_3_while_a_step_waits(tmp_path):
    """A step that waits for its turn (dispatched ahead) and a peer still pushing do not keep it alive."""
    controller = Controller(tmp_path, refuse=lambda worker_id: "fenced")
    log = tmp_path / "worker-w0.log"
    proc = start_worker(controller, "w0", log)
    try:
        info = controller.wait_for("w0")
        stub = member(info.address)
        stub.Load(load_request(tiny_programs(), lease=2.0), timeout=120)
        stub.Init(pb.InitRequest(fence=FENCE, seed=0), timeout=60)
        plan = dict(rank=0, peers=[pb.Peer(rank=0, address=info.address)], nodes=[pb.Node(level=1, index=0)],
                    all_nodes=[pb.Node(level=1, index=0)], node_owner=[0])
        early = stub.Step.future(pb.StepRequest(fence=FENCE, step=3, **plan), timeout=120)   # waits for 0, 1, 2
        stop_pushing = threading.Event()

        def peer():   # a peer of the old epoch keeps pushing; its calls never renew the lease
            while not stop_pushing.is_set():
                try:
                    stub.Push(iter([pb.TensorChunk(fence=FENCE, step=3, phase=1, src_rank=1,
                                                   node=pb.Node(level=1, index=0))]), timeout=1)
                except grpc.RpcError:
                    pass
                stop_pushing.wait(0.05)

        pusher = threading.Thread(target=peer, daemon=True)
        pusher.start()
        try:
            status = wait_exit(proc, 30)
        finally:
            stop_pushing.set()
            pusher.join(10)
        assert status == 3, f"the refused worker is still alive or exited with {status}; see {log}"
        with pytest.raises(grpc.RpcError):
            early.result(timeout=30)
        text = log.read_text()
        assert "asked to rejoin" in text and "cannot schedule new futures" not in text, text[-3000:]
    finally:
        stop(proc)
        controller.close()


REAPER = """
import ctypes, os, subprocess, sys
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)   # PR_SET_CHILD_SUBREAPER: orphans come to us
parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                           "p = subprocess.Popen(sys.argv[1:]); print('worker', p.pid, flush=True); time.sleep(600)",
                           *sys.argv[1:]])
print("parent", parent.pid, flush=True)
while True:
    try:
        pid, status = os.wait()
    except ChildProcessError:
        break
    print("exit", pid, os.waitstatus_to_exitcode(status), flush=True)
"""


def test_a_worker_whose_parent_dies_during_a_long_compile_exits_at_once(tmp_path):
    """The launching process dies while the worker compiles: the worker exits long before the compile would end.

    The worker runs under a parent (``--exit-with-parent``) that runs under a reaper, which adopts the orphaned
    worker and reports its exit status. The compile takes tens of seconds; the worker must be gone within a
    few, with a non-zero status, and the Load it was compiling for never answered.
    """
    controller = Controller(tmp_path)
    log = tmp_path / "worker-w0.log"
    slow = slow_to_compile(tiny_programs())
    with open(log, "ab") as out:
        reaper = subprocess.Popen([sys.executable, "-c", REAPER,
                                   *worker_command(controller, "w0", "--exit-with-parent")],
                                  env=worker_env(), stdout=subprocess.PIPE, stderr=out, stdin=subprocess.DEVNULL,
                                  text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line.split()) for line in reaper.stdout], daemon=True).start()
    pids = {}
    try:
        while len(pids) < 2:
            kind, pid = lines.get(timeout=60)
            pids[kind] = int(pid)
        info = controller.wait_for("w0")
        assert info.pid == pids["worker"]
        loading = member(info.address).Load.future(load_request(slow), timeout=300)
        wait_for_log(log, "loading 3 programs")
        time.sleep(1.0)   # well into the compile (the device probe before it takes a fraction of this)
        assert not loading.done()
        os.kill(pids["parent"], signal.SIGKILL)
        exits = {}
        deadline = time.monotonic() + 10.0   # generous: the worker notices within 0.2 s
        while pids["worker"] not in exits and time.monotonic() < deadline:
            try:
                kind, pid, code = lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                break
            exits[int(pid)] = int(code)
        assert pids["worker"] in exits, f"the worker outlived its parent by 10 s (compiling); see {log}"
        assert exits[pids["worker"]] == 4
        with pytest.raises(grpc.RpcError):
            loading.result(timeout=30)
        assert "owner (process" in log.read_text()
    finally:
        for pid in pids.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        reaper.kill()
        reaper.wait(30)
        controller.close()


# -- C: refused calls reach the controller's event log --------------------------


def test_refused_calls_are_counted_by_the_worker_and_reach_the_event_log(tmp_path):
    """Callers without (or with a wrong) secret are counted per method, peer host and reason, not per call."""
    from runtime.control.controller_options import ControllerOptions
    from runtime.control.run_state import RunLedger
    from runtime.control.worker_group import WorkerGroup

    programs = tiny_programs()
    events = EventLog(tmp_path / "events.jsonl")
    opts = ControllerOptions(slices=1, devices_per_slice=1, run_dir=str(tmp_path), heartbeat_seconds=0.25,
                             lease_seconds=30.0, worker_lease_seconds=0.0, standby_workers=0)
    group = WorkerGroup(RUN, SECRET, programs, data_source(), opts, events, RunLedger(events))
    group.monitor.refusals_seconds = 0.5
    group.start()
    try:
        group.launch()
        [info] = group.wait_for_workers(1, timeout=120)
        for secret in (None, "not-the-secret"):
            with Stranger(info.address, secret) as stranger:
                while len(stranger.codes) < 20:
                    time.sleep(0.05)
        deadline = time.monotonic() + 30
        while True:   # the health monitor's own reports (every 0.5 s here)
            got = [e for e in read_events(tmp_path / "events.jsonl") if e["kind"] == "security_refused"]
            if sum(e["count"] for e in got) >= 40 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        got += group.collect_security_events(timeout=5.0)   # anything left since the last report
        totals = {}
        for e in got:
            assert e["worker"] == info.worker_id and e["peer"] == "ipv4:127.0.0.1"
            key = (e["method"], e["reason"])
            totals[key] = totals.get(key, 0) + e["count"]
        assert set(totals) == {("/grpc.health.v1.Health/Check", "missing run secret"),
                               ("/jax_elastic.Worker/Progress", "missing run secret"),
                               ("/grpc.health.v1.Health/Check", "wrong run secret"),
                               ("/jax_elastic.Worker/Progress", "wrong run secret")}
        assert sum(totals.values()) >= 40
        assert len(got) < sum(totals.values())   # counts, not one event per call
        assert group.collect_security_events(timeout=5.0) == []   # drained
    finally:
        group.close()
        events.close()
