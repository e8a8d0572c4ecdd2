"""Same config, 1-4 slices of real worker processes, and the reference: same bits."""

import pytest

from tests.conftest import run_cli

STEPS = "steps=6"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    _, report = run_cli(["run", "tiny", STEPS, "--reference"], tmp_path_factory.mktemp("ref"))
    assert report["mode"] == "reference" and report["steps_completed"] == 6
    return report


@pytest.mark.parametrize("slices", [1, 2, 3, 4])
def test_any_slice_count_matches_the_reference_bit_for_bit(reference, slices, tmp_path):
    _, report = run_cli(["run", "tiny", STEPS, f"dcn_data_parallelism={slices}"], tmp_path)
    assert report["mode"] == "distributed"
    assert report["slices"] == slices and report["devices_per_slice"] == 2
    assert report["steps_completed"] == 6
    assert report["losses"] == reference["losses"]
    assert report["final_state_sha256"] == reference["final_state_sha256"]
    assert set(report["replica_hashes"]) == {f"w{i}" for i in range(slices)}
    assert set(report["replica_hashes"].values()) == {report["final_state_sha256"]}


def test_the_loss_falls_over_thirty_steps_on_four_workers(tmp_path):
    _, report = run_cli(["run", "tiny", "steps=30"], tmp_path)
    assert report["steps_completed"] == 30 and report["slices"] == 4
    losses = report["losses"]
    assert losses[-1] < 0.85 * losses[0], losses
    for key in ("wall_seconds", "client_peak_rss_bytes", "state_bytes"):
        assert report[key] > 0
