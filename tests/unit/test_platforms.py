"""Platforms: the config key ``hardware``, its JAX platform, the workers' environment, and the refusal of
programs for a platform a worker lacks (pure checks, the executor, and a real in-process worker's Load)."""

import hashlib
import os

import cloudpickle
import grpc
import pytest

from elastic import options
from elastic.cli_support import bundled_trainer, set_platform
from elastic.config import Config, ConfigError
from elastic.config_checks import HARDWARE
from elastic.config_loading import load_config
from runtime import PlatformMismatchError, ProtocolError, program_platforms
from runtime.wire import rpc
from runtime._proto import elastic_pb2 as pb
from runtime._proto import elastic_pb2_grpc as pb_grpc
from runtime.worker.executor import SliceExecutor
from runtime.core.child_env import jax_child_env
from runtime.launch.launcher import LocalLauncher
from runtime.core.platforms import canonical_platform, check_runnable, default_worker_platform, local_platform
from runtime.worker.worker import WorkerService


# --------------------------------------------------------------------------- the config key


@pytest.mark.parametrize("value", ["", "cpu", "gpu", "tpu"])
def test_hardware_takes_maxtexts_names_or_empty(value):
    assert load_config("tiny", [f"hardware={value}"]).hardware == value


@pytest.mark.parametrize("value", ["cuda", "GPU", "rocm", "tpu7x"])
def test_any_other_hardware_is_an_error_naming_the_key(value):
    with pytest.raises(ConfigError, match=r"config key 'hardware' \('.*', in overrides\) must be cpu, gpu or tpu"):
        load_config("tiny", [f"hardware={value}"])


def test_gpu_multiprocess_is_refused_saying_what_to_use_instead():
    with pytest.raises(ConfigError) as info:
        Config(hardware="gpu_multiprocess")
    assert "'hardware'" in str(info.value) and "jax.distributed" in str(info.value)
    assert str(info.value).endswith("so use gpu")


def test_hardware_maps_to_jax_export_platform_names():
    assert set(options.PLATFORM_OF_HARDWARE) == set(HARDWARE)
    assert {h: options.export_platform(Config(hardware=h), {}) for h in HARDWARE} == {
        "cpu": "cpu", "gpu": "cuda", "tpu": "tpu"}
    assert options.run_settings(Config(hardware="gpu")).platform == "cuda"


@pytest.mark.parametrize("environ, platform", [
    ({}, "cpu"),                               # the launcher's default: simulated CPU devices
    ({"JAX_PLATFORMS": "cpu"}, "cpu"),
    ({"JAX_PLATFORMS": "cuda,cpu"}, "cuda"),   # the first one is the workers' default backend
    ({"JAX_PLATFORMS": "gpu"}, "cuda"),
    ({"JAX_PLATFORMS": ""}, ""),               # JAX chooses when the worker starts: the trainer asks its own JAX
])
def test_empty_hardware_is_the_platform_the_workers_get_from_the_environment(environ, platform):
    assert options.export_platform(Config(), environ) == platform
    assert default_worker_platform(environ) == platform


def test_an_unknown_jax_platforms_with_empty_hardware_is_a_config_error():
    with pytest.raises(ConfigError, match=r"'hardware' is empty.*JAX_PLATFORMS='metal' does not name.*set hardware to "
                                          r"cpu, gpu or tpu"):
        options.export_platform(Config(), {"JAX_PLATFORMS": "metal"})


def test_hardware_given_wins_over_jax_platforms():
    assert options.export_platform(Config(hardware="gpu"), {"JAX_PLATFORMS": "cpu"}) == "cuda"


def test_another_platform_rebuilds_the_programs_of_a_job():
    job = bundled_trainer(load_config("tiny", ["ici_fsdp_parallelism=1"]))
    job._programs = "built"
    assert job.with_config(job.config.replace(steps=3))._programs == "built"
    assert job.with_config(job.config.replace(hardware="gpu"))._programs is None


# --------------------------------------------------------------------------- platform names


def test_canonical_platform_names():
    assert [canonical_platform(p) for p in ("cpu", "gpu", "CUDA", "rocm", "tpu")] == ["cpu", "cuda", "cuda", "rocm",
                                                                                      "tpu"]
    with pytest.raises(ValueError, match="unknown JAX platform 'metal'"):
        canonical_platform("metal")


def test_this_test_process_runs_on_the_cpu():
    assert local_platform() == "cpu"
    import jax

    assert local_platform(jax.devices()) == "cpu"


# --------------------------------------------------------------------------- the refusal, pure


def test_programs_for_the_local_platform_are_runnable():
    check_runnable(("cpu",), "cpu")
    check_runnable(("cpu", "cuda"), "cuda")


def test_the_refusal_names_both_platforms_the_key_and_what_to_set():
    with pytest.raises(PlatformMismatchError) as info:
        check_runnable(("cuda",), "cpu", "the 'init' program")
    text = str(info.value)
    assert text.startswith("the 'init' program: exported for cuda (config key hardware: gpu), but this worker's JAX "
                           "runs on cpu. Set the config key 'hardware' to cpu")
    assert "where JAX finds a cuda device" in text
    assert isinstance(info.value, ProtocolError)   # a worker answers INVALID_ARGUMENT, like any Load it cannot take
    assert rpc.status_of(info.value) == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(PlatformMismatchError, match=r"exported for tpu \(config key hardware: tpu\).*runs on cuda\. "
                                                    r"Set the config key 'hardware' to gpu"):
        check_runnable(("tpu",), "cuda")


# --------------------------------------------------------------------------- the workers' environment


def test_cpu_workers_get_the_cpu_and_simulated_devices(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")   # an explicit platform wins over the inherited one
    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
    env = jax_child_env(4, "cpu")
    assert env["JAX_PLATFORMS"] == "cpu"
    assert "--xla_force_host_platform_device_count=4" in env["XLA_FLAGS"].split()
    assert "XLA_PYTHON_CLIENT_PREALLOCATE" not in env


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_accelerator_workers_let_jax_choose_and_allocate_on_demand(monkeypatch, platform):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    for k in ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_ALLOCATOR"):
        monkeypatch.delenv(k, raising=False)
    env = jax_child_env(1, platform)
    assert "JAX_PLATFORMS" not in env   # JAX takes the host's accelerator; without one the worker refuses at Load
    assert env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"   # several workers share one GPU


def test_a_memory_setting_of_the_user_is_kept(monkeypatch):
    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.2")
    env = jax_child_env(1, "cuda")
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.2" and "XLA_PYTHON_CLIENT_PREALLOCATE" not in env


def test_without_a_platform_workers_get_jax_platforms_as_this_process_has_it(monkeypatch):
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
    assert jax_child_env(2)["JAX_PLATFORMS"] == "cpu"
    monkeypatch.setenv("JAX_PLATFORMS", "")
    env = jax_child_env(2)
    assert env["JAX_PLATFORMS"] == "" and env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"


def test_the_launcher_passes_its_platform_on(tmp_path):
    assert LocalLauncher("run", "127.0.0.1:1", 1, str(tmp_path), platform="cuda").platform == "cuda"
    with pytest.raises(ValueError, match="unknown JAX platform"):
        jax_child_env(1, "metal")


@pytest.mark.parametrize("hardware, jax_platforms", [("", "cpu"), ("cpu", "cpu"), ("gpu", ""), ("tpu", "")])
def test_the_command_line_client_takes_the_hardwares_platform(monkeypatch, hardware, jax_platforms):
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
    set_platform(hardware)
    assert os.environ["JAX_PLATFORMS"] == jax_platforms
    assert ("XLA_PYTHON_CLIENT_PREALLOCATE" in os.environ) == (hardware in ("gpu", "tpu"))


def test_the_command_line_keeps_a_jax_platforms_the_user_set(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    set_platform("gpu")
    assert os.environ["JAX_PLATFORMS"] == "cpu"   # the workers then refuse the GPU programs, by name


# --------------------------------------------------------------------------- export, and refusal at load


@pytest.fixture(scope="module")
def gpu_job():
    """The bundled model's job for hardware=gpu on one device (exported here, on a CPU-only client)."""
    job = bundled_trainer(load_config("tiny", ["hardware=gpu", "ici_fsdp_parallelism=1", "dcn_data_parallelism=1",
                                               "elastic_microbatches=1"]))
    job.programs()
    return job


@pytest.mark.parametrize("hardware, platform", [("cpu", "cpu"), ("gpu", "cuda"), ("tpu", "tpu")])
def test_a_cpu_only_client_exports_for_every_platform(hardware, platform):
    job = bundled_trainer(load_config("tiny", [f"hardware={hardware}", "ici_fsdp_parallelism=2"]))
    programs = job.programs()
    assert {name: program_platforms(blob) for name, blob in programs.programs().items()} == {
        "init": (platform,), "grad": (platform,), "apply": (platform,)}


def test_the_executor_refuses_gpu_programs_before_compiling(gpu_job):
    ex = SliceExecutor(gpu_job.programs().by_stage[0], gpu_job.data)
    with pytest.raises(PlatformMismatchError, match=r"exported for cuda \(config key hardware: gpu\).*runs on cpu"):
        ex.load()
    assert not ex._fns


def test_a_worker_refuses_gpu_programs_at_load_with_invalid_argument(gpu_job):
    programs = gpu_job.programs()
    service = WorkerService("run", "w")
    server, port = rpc.make_server()
    pb_grpc.add_WorkerServicer_to_server(service, server)
    server.start()
    try:
        stub = pb_grpc.WorkerStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        request = pb.LoadRequest(
            fence=pb.Fence(run_id="run", epoch=0), data_source=cloudpickle.dumps(gpu_job.data),
            programs=[pb.Program(name=k, serialized=v, sha256=hashlib.sha256(v).hexdigest())
                      for k, v in programs.programs().items()],
            layout=programs.layout_json(), lease_seconds=5.0)
        with pytest.raises(grpc.RpcError) as info:
            stub.Load(request, timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = info.value.details()
        assert "exported for cuda (config key hardware: gpu)" in details and "runs on cpu" in details
        assert "Traceback" not in details
        assert service.replica.executor is None
    finally:
        server.stop(0)
        service.close()


def test_a_slices_coordinator_is_served_on_its_own_ip_address_and_a_loopback_one_stays_on_loopback():
    from runtime.core.platforms import _bind_address

    assert _bind_address("127.0.0.1:8476") == "127.0.0.1:8476" and _bind_address("[::1]:8476") == "[::1]:8476"
    assert _bind_address("10.0.0.7:8476") == "10.0.0.7:8476"
    assert _bind_address("jax-elastic-slice-1-0.jax-elastic-hosts:8476") is None   # a name: every interface
