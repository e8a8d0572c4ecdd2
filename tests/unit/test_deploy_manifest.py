"""docs/deploy/kubernetes.yaml and kubernetes-multi-host.yaml: the examples a user applies as is must describe runs
that can work.

No cluster here (and no kubectl): the checks are on the structure, with the project's own parsers. The client's
arguments must form a valid config with workers joining by themselves, the workers' a valid ``elastic worker``
command, and the address, port, run id, secret and worker count must agree across the Services, the Jobs and (with
slices of several hosts) the StatefulSets, one per slice, whose pods are that slice's hosts.
"""

import pathlib
import re

import pytest
import yaml

from elastic import cli
from elastic.config_loading import load_config
from elastic.options import SECRET_ENV, controller_options
from runtime import slice_flags_problem

ROOT = pathlib.Path(__file__).resolve().parents[2]
MANIFEST = ROOT / "docs" / "deploy" / "kubernetes.yaml"
MULTI_HOST = ROOT / "docs" / "deploy" / "kubernetes-multi-host.yaml"


def _objects(path: pathlib.Path) -> dict:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    for d in docs:
        assert {"apiVersion", "kind", "metadata", "spec"} <= set(d) and d["metadata"].get("name"), d
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


@pytest.fixture(scope="module")
def objects():
    return _objects(MANIFEST)


def _container(job) -> dict:
    (container,) = job["spec"]["template"]["spec"]["containers"]
    return container


def _env_from(container, name: str) -> dict:
    (env,) = [e for e in container["env"] if e["name"] == name]
    return env["valueFrom"]


def _client(controller, service, tmp_path, monkeypatch):
    """The controller Job's run (its ``ControllerOptions``), checked to be one whose workers join by themselves at
    the address the Service forwards; and that Service's ``name:port``."""
    ctl = _container(controller)
    assert ctl["args"][:2] == ["elastic", "run"]
    monkeypatch.setenv(SECRET_ENV, "s3cret")
    opts = controller_options(load_config(ctl["args"][2], ctl["args"][3:]), tmp_path)
    assert opts.launcher == "none" and opts.host == "0.0.0.0" and opts.secret == "s3cret"
    labels = controller["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] == opts.port and opts.port in [p["containerPort"] for p in ctl["ports"]]
    return opts, f"{service['metadata']['name']}:{port['port']}"


def test_the_example_is_a_service_and_two_jobs_that_agree(objects, tmp_path, monkeypatch):
    assert set(objects) == {("Service", "jax-elastic-controller"), ("Job", "jax-elastic-controller"),
                            ("Job", "jax-elastic-workers")}
    service = objects["Service", "jax-elastic-controller"]
    controller = objects["Job", "jax-elastic-controller"]
    workers = objects["Job", "jax-elastic-workers"]
    ctl, wrk = _container(controller), _container(workers)
    assert {j["spec"]["template"]["spec"]["restartPolicy"] for j in (controller, workers)} <= {"OnFailure", "Never"}
    # The client's arguments form a valid config whose workers join by themselves, at the Service's address.
    opts, address = _client(controller, service, tmp_path, monkeypatch)

    # The workers' arguments: a valid `elastic worker` command that reaches that Service, for this run.
    assert wrk["args"][0] == "elastic"
    args = cli.parser().parse_args(wrk["args"][1:])
    assert args.command == "worker" and args.controller == address
    assert args.run_id == opts.run_id and args.host == "$(POD_IP)"
    assert _env_from(wrk, "POD_IP")["fieldRef"]["fieldPath"] == "status.podIP"
    assert args.devices == opts.devices_per_slice

    # Both read the same secret; as many workers as slices and spares, each replaced when it dies.
    assert _env_from(ctl, SECRET_ENV) == _env_from(wrk, SECRET_ENV)
    spec = workers["spec"]
    assert spec["parallelism"] == spec["completions"] == opts.slices + opts.spares
    assert spec["backoffLimit"] >= opts.slices + opts.spares
    assert not workers["spec"]["template"]["metadata"]["labels"].items() >= service["spec"]["selector"].items()


def test_the_multi_host_example_is_a_statefulset_of_a_slices_hosts_per_slice_that_agree(tmp_path, monkeypatch):
    objects = _objects(MULTI_HOST)
    opts, address = _client(objects["Job", "jax-elastic-controller"], objects["Service", "jax-elastic-controller"],
                            tmp_path, monkeypatch)
    hosts = objects["Service", "jax-elastic-hosts"]
    assert hosts["spec"]["clusterIP"] == "None"   # headless: each pod of a slice has a stable name
    (coordinator_port,) = hosts["spec"]["ports"]
    slices = [o for (kind, _), o in objects.items() if kind == "StatefulSet"]
    assert opts.hosts_per_slice == 2 and len(slices) == opts.slices + opts.spares
    secret = _env_from(_container(objects["Job", "jax-elastic-controller"]), SECRET_ENV)
    coordinators = set()
    for sts in slices:
        spec, name = sts["spec"], sts["metadata"]["name"]
        assert spec["replicas"] == opts.hosts_per_slice and spec["serviceName"] == hosts["metadata"]["name"]
        labels = spec["template"]["metadata"]["labels"]
        assert spec["selector"]["matchLabels"].items() <= labels.items()
        assert hosts["spec"]["selector"].items() <= labels.items()
        wrk = _container(sts)
        assert _env_from(wrk, SECRET_ENV) == secret
        assert _env_from(wrk, "SLICE_HOST")["fieldRef"]["fieldPath"] == \
            "metadata.labels['apps.kubernetes.io/pod-index']"
        assert _env_from(wrk, "POD_IP")["fieldRef"]["fieldPath"] == "status.podIP"
        assert coordinator_port["port"] in [p["containerPort"] for p in wrk["ports"]]
        for k in range(spec["replicas"]):   # pod k as Kubernetes starts it: $(SLICE_HOST) is its index
            argv = [re.sub(r"\$\(SLICE_HOST\)", str(k), a) for a in wrk["args"]]
            assert argv[0] == "elastic"
            args = cli.parser().parse_args(argv[1:])
            assert args.command == "worker" and args.controller == address and args.run_id == opts.run_id
            assert (args.slice_hosts, args.slice_host, args.host) == (opts.hosts_per_slice, k, "$(POD_IP)")
            assert args.devices * args.slice_hosts == opts.devices_per_slice
            assert not slice_flags_problem(args.slice_hosts, args.slice_host, args.slice_coordinator)
            # Pod 0's stable name in the headless Service, on the port it publishes.
            assert args.slice_coordinator == f"{name}-0.{hosts['metadata']['name']}:{coordinator_port['port']}"
            coordinators.add(args.slice_coordinator)
    assert len(coordinators) == len(slices)   # each slice its own coordinator
