"""A pytest plugin: chaos tests of your own model inside your own test suite.

Registered through the ``pytest11`` entry point (``elastic_chaos =
"chaos.pytest_plugin"`` in ``pyproject.toml``), so installing jax-elastic
makes the fixture available in any test suite::

    def test_my_model_survives_a_kill(elastic_chaos):
        job = elastic.wrap(train_step, init_state=init, data=data, config=cfg)
        result = elastic_chaos(job, faults="kill@step=3")
        result.assert_passed()            # or: assert result.verdict == "pass", result.reasons

``elastic_chaos(job, faults=..., scenario=..., seed=..., mtbf=..., duration=...,
overrides=[...])`` calls :func:`chaos.harness.run_job` and returns its
:class:`chaos.harness.ChaosResult`. Runs go to a directory of the test
session (``base_output_directory``), each named after its test, so fault-free
references and compiled programs are reused across the session's tests.
Importing this module imports neither JAX nor the runtime.
"""

from __future__ import annotations

import re

import pytest

__all__ = ["elastic_chaos"]


@pytest.fixture(scope="session")
def _elastic_chaos_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("elastic-chaos")


@pytest.fixture
def elastic_chaos(request, _elastic_chaos_dir):
    """``run(job, faults=None, **options) -> ChaosResult``: ``job`` under faults, judged against a fault-free run."""
    counter = iter(range(1, 1 << 30))

    def run(job, faults=None, **options):
        from chaos.harness import run_job

        name = re.sub(r"[^A-Za-z0-9_.-]+", "-", request.node.name).strip("-.") or "test"
        overrides = [f"base_output_directory={_elastic_chaos_dir}", f"run_name={name}-{next(counter)}",
                     *options.pop("overrides", ())]
        return run_job(job, faults=faults, overrides=overrides, **options)
    return run
