"""A data source of the user's own module reaches workers that cannot import that module (a shared pool's hosts)
when shipped by value, and only then; jax-elastic's and installed modules still travel by reference."""

import subprocess
import sys
import textwrap

import pytest

from elastic.shipping import ship, user_modules


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    package = tmp_path / "somewhere" / "userdata"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "source.py").write_text(textwrap.dedent("""
        import numpy as np

        class Ramp:
            def __init__(self, n):
                self.n = n

            def batch(self, step, microbatch):
                return np.arange(self.n) + 10 * step + microbatch
    """))
    monkeypatch.syspath_prepend(str(tmp_path / "somewhere"))
    import importlib

    module = importlib.import_module("userdata.source")
    yield module
    for name in ("userdata.source", "userdata"):
        sys.modules.pop(name, None)


def _unpickle_elsewhere(blob: bytes) -> subprocess.CompletedProcess:
    """Unpickles ``blob`` in a fresh interpreter whose import path lacks the user's module."""
    code = "import sys, cloudpickle; s = cloudpickle.loads(sys.stdin.buffer.read()); print(s.batch(2, 1).tolist())"
    return subprocess.run([sys.executable, "-c", code], input=blob, capture_output=True, timeout=60)


def test_a_users_data_source_unpickles_where_its_module_is_not_importable_only_when_shipped_by_value(user_module):
    source = user_module.Ramp(3)
    assert user_module in user_modules()
    import numpy
    import elastic.data

    assert numpy not in user_modules() and elastic.data not in user_modules()   # installed, and ours
    by_reference = _unpickle_elsewhere(ship(source, by_value=False))
    assert by_reference.returncode != 0 and b"No module named 'userdata'" in by_reference.stderr
    by_value = _unpickle_elsewhere(ship(source, by_value=True))
    assert by_value.returncode == 0, by_value.stderr.decode()[-2000:]
    assert by_value.stdout.decode().strip() == "[21, 22, 23]"
    import cloudpickle

    assert b"userdata.source" in cloudpickle.dumps(source)   # nothing stays registered after ship
