"""The examples in ``examples/``: an existing JAX loop made elastic in a few lines.

For each example: the elastic version run without the runtime (``--plain``)
is the original loop (the same losses, bit for bit); the elastic version
survives a worker kill and trains the original loop's model (its losses are
the plain loop's up to summation order); and the two files differ by a few
lines, as examples/README.md says, which shows the current diff.
"""

import difflib
import importlib
import runpy
import sys

import numpy as np
import pytest

import elastic
from tests.conftest import ROOT
from tests.support.example_diff import changed_lines, split_factory, unified_diff

EXAMPLES = ["optax_loop", "nnx_loop", "grad_accumulation"]
# Lines that differ between original.py and elastic_version.py, blank lines aside, outside the
# make_job factory and the __main__ block (7 in each example today: two imports, the mark, and a
# 4-line get_microbatch), and the factory's own lines (6 to 11 today; Flax NNX needs a 4-line
# functional adapter). examples/README.md states these bounds.
MAX_CHANGED_LINES = 8
MAX_FACTORY_LINES = 12


def _module(example, kind):
    return importlib.import_module(f"examples.{example}.{kind}")


@pytest.mark.parametrize("example", EXAMPLES)
def test_the_elastic_version_without_the_runtime_is_the_original_loop(example, monkeypatch, capsys):
    original = _module(example, "original")
    want = original.main(steps=4)
    printed = capsys.readouterr().out
    assert _module(example, "elastic_version").main(steps=4) == want   # bit for bit: the mark is the identity
    capsys.readouterr()
    # The command line: `python -m examples.<example>.elastic_version --plain` (run in this process, as __main__).
    monkeypatch.setattr(sys, "argv", ["elastic_version.py", "--plain", "--steps", "4"])
    runpy.run_path(str(ROOT / "examples" / example / "elastic_version.py"), run_name="__main__")
    assert capsys.readouterr().out == printed


@pytest.mark.parametrize("example", EXAMPLES)
def test_the_elastic_version_survives_a_worker_kill(example, elastic_chaos):
    """2 slices of 1 device and a spare, 6 steps, one worker SIGKILLed at step 3: the verdict passes.

    ``elastic_chaos`` is jax-elastic's pytest fixture (``chaos.run_job`` with the runs under the test session's
    temporary directory), the way a user tests their own loop.
    """
    original = _module(example, "original")
    cfg = elastic.load_config("tiny", [
        "steps=6", "dcn_data_parallelism=2", "ici_fsdp_parallelism=1", "elastic_microbatches=2",
        f"per_device_batch_size={original.BATCH_SIZE // 2}",   # the global batch of the original loop
        "elastic_spares=1", "elastic_standby_workers=0", "elastic_relaunch=false"])   # nothing replaces the spare
    result = elastic_chaos(_module(example, "elastic_version").make_job(cfg), faults="kill@step=3", seed=0)
    result.assert_passed()
    report = result.report
    assert report["steps_completed"] == 6 and report["steps_lost"] == 0
    assert [f["path"] for f in report["failures"]] == ["replace"]
    # The elastic run trains the original loop's model on its data: only the order of the sums differs.
    np.testing.assert_allclose(report["losses"], original.main(steps=6), rtol=1e-5)


@pytest.mark.parametrize("example", EXAMPLES)
def test_the_elastic_version_changes_a_few_lines(example):
    d = ROOT / "examples" / example
    original, no_factory = split_factory(d / "original.py")
    elastic_body, factory = split_factory(d / "elastic_version.py")
    assert no_factory == []
    changed = changed_lines(original, elastic_body)
    assert 0 < changed <= MAX_CHANGED_LINES, "\n".join(difflib.unified_diff(original, elastic_body, lineterm=""))
    assert sum("elastic.cross_slice_mean(grads)" in line for line in elastic_body) == 1
    assert sum(1 for line in factory if "elastic.wrap(" in line or "elastic.Trainer(" in line) == 1
    assert len(factory) <= MAX_FACTORY_LINES, factory
    # examples/README.md shows the current diff.
    assert f"```diff\n{unified_diff(example)}\n```" in (ROOT / "examples" / "README.md").read_text(), (
        f"examples/README.md shows an outdated diff of {example}; replace it with the block that "
        f"`python -m tests.examples.test_examples` prints")


if __name__ == "__main__":   # prints the README's diff blocks
    for name in EXAMPLES:
        print(f"### {name}\n\n```diff\n{unified_diff(name)}\n```\n")
