"""Checkpoints that cannot serve a run say so: a local checkpoint directory the workers could not write is
refused before anything starts, and saves that failed anyway are counted in the report and its summary."""

import json

import jsonschema
import pytest

from elastic.config import ConfigError
from elastic.preflight import check_checkpoint_directory
from elastic.report import build_report, summary_text
from tests.conftest import ROOT


@pytest.mark.parametrize("case", ["file in the way", "under /proc"])
def test_a_local_checkpoint_directory_that_cannot_be_written_is_one_line_naming_the_key(tmp_path, case):
    if case == "file in the way":
        (tmp_path / "ck").write_text("not a directory")
        directory = str(tmp_path / "ck" / "run")
    else:
        directory = "/proc/nope/ck"
    with pytest.raises(ConfigError) as refused:
        check_checkpoint_directory(directory)
    message = str(refused.value)
    assert "\n" not in message and "elastic_checkpoint_directory" in message and directory in message, message


def test_a_writable_checkpoint_directory_is_created_and_left_empty(tmp_path):
    check_checkpoint_directory(str(tmp_path / "a" / "b"))
    assert (tmp_path / "a" / "b").is_dir() and not any((tmp_path / "a" / "b").iterdir())
    check_checkpoint_directory("gs://bucket/ck")   # the workers reach a bucket: nothing to check here


def test_failed_saves_are_counted_with_their_errors_in_the_report_and_the_summary():
    t = 1_700_000_000.0
    events = [{"t": t, "kind": "run_started", "run_id": "r", "slices": 1, "devices_per_slice": 1, "steps": 10},
              *[{"t": t + s, "kind": "checkpoint_failed", "worker": "w0",
                 "error": "FileNotFoundError: [Errno 2] No such file or directory: '/nope'"} for s in (1, 2)],
              {"t": t + 3, "kind": "checkpoint_failed", "worker": "w0", "error": "OSError: disk full"}]
    report = build_report(events)
    assert report["checkpoints_failed"] == 3
    assert report["checkpoint_errors"] == [events[1]["error"], "OSError: disk full"]
    jsonschema.validate(report, json.loads((ROOT / "docs" / "report.schema.json").read_text()))
    text = summary_text(report, width=300)
    assert "checkpoints failed" in text and "3 saves (FileNotFoundError" in text, text
    assert "checkpoints failed" not in summary_text(build_report(events[:1]), width=300)
