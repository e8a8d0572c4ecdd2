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
    assert report["final_state_digest"] == reference["final_state_digest"]
    assert set(report["replica_hashes"]) == {f"w{i}" for i in range(slices)}
    assert set(report["replica_hashes"].values()) == {report["final_state_digest"]}


def test_the_loss_falls_over_thirty_steps_on_four_workers(tmp_path):
    _, report = run_cli(["run", "tiny", "steps=30"], tmp_path)
    assert report["steps_completed"] == 30 and report["slices"] == 4
    losses = report["losses"]
    assert losses[-1] < 0.85 * losses[0], losses
    for key in ("wall_seconds", "client_peak_rss_bytes", "state_bytes"):
        assert report[key] > 0


def test_every_run_writes_a_report_that_validates_and_can_be_re_rendered(tmp_path, reference):
    """A fault-free run's report.json matches docs/report.schema.json; `elastic report` rebuilds it."""
    import json

    import jsonschema

    from tests.conftest import ROOT

    schema = json.loads((ROOT / "docs" / "report.schema.json").read_text())
    _, report = run_cli(["run", "tiny", STEPS, "run_name=plain"], tmp_path)
    jsonschema.validate(report, schema)
    jsonschema.validate(reference, schema)
    assert report["verdict"] is None and report["faults"] == [] and report["goodput"]["wall_seconds"] > 0
    html = tmp_path / "plain" / "report.html"
    assert "id='timeline'" in html.read_text() or 'id="timeline"' in html.read_text()
    (tmp_path / "plain" / "report.json").unlink()
    html.unlink()
    proc, _ = run_cli(["report", str(tmp_path / "plain")], tmp_path)
    rebuilt = json.loads((tmp_path / "plain" / "report.json").read_text())
    assert rebuilt == report and html.exists()
    proc, _ = run_cli(["report", str(tmp_path / "nowhere")], tmp_path, check=False)
    assert proc.returncode == 2 and "events.jsonl" in proc.stderr
