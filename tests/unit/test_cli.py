"""Bad input to the CLI gives one clear line and exit status 2."""

import pytest


@pytest.mark.parametrize("args, needle", [
    (["run", "tiny", "stpes=3"], "unknown config key 'stpes'"),
    (["run", "tiny", "steps=abc"], "'steps' must be an integer"),
    (["run", "tiny", "steps"], "steps"),
    (["run", "no-such-config.yml"], "no-such-config"),
    (["run", "tiny", "elastic_microbatches=3"], "elastic_microbatches"),
    (["run", "tiny", "dcn_data_parallelism=8"], "elastic_microbatches"),
    (["frobnicate"], "invalid choice"),
])
def test_bad_input_is_one_line_naming_the_problem(cli, args, needle):
    proc, _ = cli(*args, check=False)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("elastic: error:") and needle in lines[0], lines[0]
