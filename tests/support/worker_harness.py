"""One real worker process driven over real gRPC by a test that plays its controller.

The controller is the real registration service (``runtime.control.registry.Registry``) on a real server; the test
makes the controller's calls itself (``member(address)`` is a stub with the run secret), so it decides exactly who
talks to the worker and when. Used by the worker hardening tests and the RPC fuzz target
(``tests/integration/_rpc_fuzz_target.py``); ``tiny_programs`` also by the reference child's test.
"""

import os
import pathlib
import subprocess
import sys
import time

import cloudpickle
import jax
import jax.numpy as jnp
import numpy as np

from runtime.wire import rpc
from runtime._proto import elastic_pb2 as pb
from runtime._proto import elastic_pb2_grpc as pb_grpc
from runtime.core.events import EventLog
from runtime.control.registry import Registry
from tests.conftest import ROOT

RUN = "run-hardening"
SECRET = "s3cret-of-the-run"
FENCE = pb.Fence(run_id=RUN, epoch=1)


class Controller:
    """The controller's registration service on a real server; ``refuse(worker_id)`` answers rejoins."""

    def __init__(self, tmp_path, refuse=lambda worker_id: "", secret=SECRET, **server_options):
        self.events_path = pathlib.Path(tmp_path) / "events.jsonl"
        self.events = EventLog(self.events_path)
        self.registry = Registry(RUN, self.events, refuse)
        self.server, port = rpc.make_server(secret=secret, **server_options)
        pb_grpc.add_ControllerServicer_to_server(self.registry, self.server)
        self.server.start()
        self.address = f"127.0.0.1:{port}"

    def wait_for(self, worker_id: str, timeout: float = 120.0):
        deadline = time.monotonic() + timeout
        with self.registry.cond:
            while worker_id not in self.registry.workers:
                left = deadline - time.monotonic()
                assert left > 0, f"worker {worker_id} did not register within {timeout} s"
                self.registry.cond.wait(left)
            return self.registry.workers[worker_id]

    def close(self):
        self.server.stop(0)
        self.events.close()


def worker_command(controller: Controller, worker_id: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "runtime.worker.worker_process", "--controller", controller.address, "--run-id", RUN,
            "--worker-id", worker_id, *extra]


def worker_env(secret: str = SECRET) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), ELASTIC_RUN_SECRET=secret,
               OMP_NUM_THREADS="1", ELASTIC_CHAOS="0")
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    return env


def start_worker(controller: Controller, worker_id: str, log_path, *extra: str) -> subprocess.Popen:
    log = open(log_path, "ab")
    try:
        return subprocess.Popen(worker_command(controller, worker_id, *extra), env=worker_env(), stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    finally:
        log.close()


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(30)


def member(address: str) -> pb_grpc.WorkerStub:
    """A stub that carries the run secret (what the controller and peers use)."""
    return pb_grpc.WorkerStub(rpc.channel(address, SECRET))


def tiny_programs(num_microbatches: int = 2):
    """Init / grad / apply of a linear model on one device, built the way the client builds them."""
    from elastic._programs import build_programs

    def init_state(key):
        return {"w": jax.random.normal(key, (8,), jnp.float32)}

    def grad_fn(state, batch):
        def loss(w):
            return jnp.mean((batch["x"] @ w - batch["y"]) ** 2)
        value, g = jax.value_and_grad(loss)(state["w"])
        return value, {"w": g}

    def apply_fn(state, grads):
        return {"w": state["w"] - 0.1 * grads["w"]}

    return build_programs(init_state=init_state, grad_fn=grad_fn, apply_fn=apply_fn,
                          batch_spec={"x": ((4, 8), "float32"), "y": ((4,), "float32")}, devices_per_slice=1,
                          num_microbatches=num_microbatches)


def data_source() -> bytes:
    """A picklable data source (pickled by value: the worker needs none of this module)."""
    class Constant:
        def batch(self, step, microbatch):
            rng = np.random.default_rng(step * 1000 + microbatch)
            return {"x": rng.standard_normal((4, 8)).astype(np.float32),
                    "y": rng.standard_normal(4).astype(np.float32)}
    return cloudpickle.dumps(Constant())


def load_request(programs, *, lease: float = 0.0, fence: pb.Fence = FENCE) -> pb.LoadRequest:
    return pb.LoadRequest(fence=fence,
                          programs=[pb.Program(name=k, serialized=v) for k, v in programs.programs().items()],
                          data_source=data_source(), layout=programs.layout_json(), lease_seconds=lease)
