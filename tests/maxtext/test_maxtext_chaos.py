"""A tiny MaxText model on 2 slices + 1 spare survives a worker kill: ``elastic chaos`` on MaxText's config file.

The CLI finds the MaxText config through the ``elastic.configs`` entry point
(``integrations.maxtext.cli``), loads it with MaxText's own config code,
runs the fault-free reference and the faulted run, and judges it.
"""

import pathlib

import pytest

pytest.importorskip("maxtext")   # the MaxText integration's requirements (integrations/maxtext/requirements.txt)

from tests.conftest import run_cli  # noqa: E402

TINY = pathlib.Path(__file__).resolve().parents[2] / "integrations" / "maxtext" / "configs" / "tiny.yml"


def test_worker_kill_on_two_slices_and_a_spare_passes(tmp_path):
    # No relaunch and no standby process: the spare alone takes the dead slice (fewer processes on CI).
    _, report = run_cli(["chaos", str(TINY), "steps=5", "dcn_data_parallelism=2", "elastic_spares=1",
                         "elastic_relaunch=false", "elastic_standby_workers=0", "run_name=kill",
                         "--faults", "kill@step=3"], tmp_path)
    assert report["verdict"] == "pass", report.get("verdict_reasons")
    assert (report["steps_completed"], report["steps_lost"], report["checkpoint_restores"]) == (5, 0, 0)
    assert report["trajectory"] == "identical" and report["exactly_once"]
    assert [f["path"] for f in report["faults"]] == ["replace"]
    assert report["config"]["dcn_data_parallelism"] == 2 and "elastic_spares" in report["config"]
