"""examples/pipeline_loop: a plain JAX loop whose forward pass is cut into two pipeline stages by one mark.

Outside the runtime the mark is the identity (the same losses bit for bit);
the pipelined run trains the loop's model on its data (its losses are the
plain loop's up to the order of the sums); the diff is a few lines, as
examples/README.md shows it.
"""

import numpy as np

from examples.pipeline_loop import elastic_version, original
from tests.conftest import ROOT
from tests.support.example_diff import changed_lines, split_factory, unified_diff


def test_without_the_runtime_the_pipelined_file_is_the_original_loop():
    assert elastic_version.main(steps=3) == original.main(steps=3)


def test_the_pipelined_run_trains_the_original_model(tmp_path):
    """The command make_job's docstring gives, as written (3 steps of the loop's batch)."""
    import json
    import re
    import shlex

    from elastic.cli import main

    command = " ".join(re.search(r"``(elastic run .*?)``", elastic_version.make_job.__doc__, re.S).group(1).split())
    words = shlex.split(command)[2:] + ["steps=3", "dcn_data_parallelism=1", "ici_fsdp_parallelism=1",
                                        "per_device_batch_size=4", "elastic_microbatches=4",
                                        f"base_output_directory={tmp_path}", "run_name=pipelined", "--quiet"]
    assert main(["run", *words]) == 0, command
    report = json.loads((tmp_path / "pipelined" / "report.json").read_text())
    assert report["mode"] == "reference" and report["config"]["dcn_pipeline_parallelism"] == 2
    np.testing.assert_allclose(report["losses"], original.main(steps=3), rtol=1e-5)


def test_the_pipelined_version_changes_a_few_lines():
    d = ROOT / "examples" / "pipeline_loop"
    body, _ = split_factory(d / "original.py")
    elastic_body, factory = split_factory(d / "elastic_version.py")
    assert 0 < changed_lines(body, elastic_body) <= 8
    assert sum("elastic.pipeline_stage(" in line for line in elastic_body) == 1
    assert sum("elastic.Trainer(" in line for line in factory) == 1
    assert f"```diff\n{unified_diff('pipeline_loop')}\n```" in (ROOT / "examples" / "README.md").read_text()


if __name__ == "__main__":   # prints the README's diff block
    print(f"```diff\n{unified_diff('pipeline_loop')}\n```")
