"""docs/deploy/kubernetes.yaml: the example a user applies as is must describe a run that can work.

No cluster here (and no kubectl): the checks are on the structure, with the project's own parsers. The client's
arguments must form a valid config with workers joining by themselves, the workers' a valid ``elastic worker``
command, and the address, port, run id, secret and worker count must agree across the Service and both Jobs.
"""

import pathlib

import pytest
import yaml

from elastic import cli
from elastic.config_loading import load_config
from elastic.options import SECRET_ENV, controller_options

ROOT = pathlib.Path(__file__).resolve().parents[2]
MANIFEST = ROOT / "docs" / "deploy" / "kubernetes.yaml"


@pytest.fixture(scope="module")
def objects():
    docs = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d is not None]
    for d in docs:
        assert {"apiVersion", "kind", "metadata", "spec"} <= set(d) and d["metadata"].get("name"), d
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def _container(job) -> dict:
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert job["spec"]["template"]["spec"]["restartPolicy"] in ("OnFailure", "Never")
    return container


def _secret_ref(container) -> dict:
    (env,) = [e for e in container["env"] if e["name"] == SECRET_ENV]
    return env["valueFrom"]["secretKeyRef"]


def test_the_example_is_a_service_and_two_jobs_that_agree(objects, tmp_path, monkeypatch):
    assert set(objects) == {("Service", "jax-elastic-controller"), ("Job", "jax-elastic-controller"),
                            ("Job", "jax-elastic-workers")}
    service = objects["Service", "jax-elastic-controller"]
    controller = objects["Job", "jax-elastic-controller"]
    workers = objects["Job", "jax-elastic-workers"]
    ctl, wrk = _container(controller), _container(workers)

    # The client's arguments: `elastic run CONFIG key=value...`, a valid config whose workers join by themselves.
    assert ctl["args"][:2] == ["elastic", "run"]
    config, overrides = ctl["args"][2], ctl["args"][3:]
    monkeypatch.setenv(SECRET_ENV, "s3cret")
    cfg = load_config(config, overrides)
    opts = controller_options(cfg, tmp_path)
    assert opts.launcher == "none" and opts.host == "0.0.0.0" and opts.secret == "s3cret"

    # The Service selects the controller's pod and forwards the port it listens on.
    labels = controller["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] == opts.port and opts.port in [p["containerPort"] for p in ctl["ports"]]

    # The workers' arguments: a valid `elastic worker` command that reaches that Service, for this run.
    assert wrk["args"][0] == "elastic"
    args = cli.parser().parse_args(wrk["args"][1:])
    assert args.command == "worker" and args.controller == f"{service['metadata']['name']}:{port['port']}"
    assert args.run_id == opts.run_id and args.host == "$(POD_IP)"
    (pod_ip,) = [e for e in wrk["env"] if e["name"] == "POD_IP"]
    assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert args.devices == opts.devices_per_slice

    # Both read the same secret; as many workers as slices and spares, each replaced when it dies.
    assert _secret_ref(ctl) == _secret_ref(wrk)
    spec = workers["spec"]
    assert spec["parallelism"] == spec["completions"] == opts.slices + opts.spares
    assert spec["backoffLimit"] >= opts.slices + opts.spares
    assert not workers["spec"]["template"]["metadata"]["labels"].items() >= service["spec"]["selector"].items()
