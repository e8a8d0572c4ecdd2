"""runtime.core.compile_cache: a program compiled by one process is loaded, not compiled, by the next."""

import json
import os
import subprocess
import sys

from tests.conftest import ROOT

_PROBE = r"""
import json, sys
import jax, jax.numpy as jnp
from jax import monitoring
from runtime.core.compile_cache import enable

hits = []
monitoring.register_event_listener(lambda name, **kw: hits.append(name) if name.endswith("cache_hits") else None)
print(json.dumps({"path": enable(sys.argv[1])}))
jax.jit(lambda x: jnp.tanh(x) * 3.0 + x.sum())(jnp.arange(8.0)).block_until_ready()
print(json.dumps({"hits": len(hits)}))
"""


def _run(cache: str) -> list[dict]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    out = subprocess.run([sys.executable, "-c", _PROBE, cache], capture_output=True, text=True, env=env,
                         timeout=120, check=True)
    return [json.loads(line) for line in out.stdout.splitlines()]


def test_the_second_process_loads_what_the_first_compiled(tmp_path):
    cache = tmp_path / "cache"
    first = _run(str(cache))
    assert first == [{"path": str(cache.resolve())}, {"hits": 0}]
    assert any(p.name.endswith("-cache") for p in cache.iterdir())   # even a tiny, fast program is kept
    assert oct(cache.stat().st_mode & 0o777) == oct(0o700)            # the cache is code: private to its user
    assert _run(str(cache))[1]["hits"] >= 1


def test_an_empty_path_turns_the_cache_off(tmp_path):
    assert _run("") == [{"path": ""}, {"hits": 0}]


def test_a_program_set_is_known_as_held_only_once_marked_and_only_for_the_same_programs_and_devices(tmp_path):
    from runtime.core.compile_cache import holds, mark_held

    programs = {"grad": b"g", "apply": b"a"}
    assert not holds(str(tmp_path), programs, 2)
    mark_held(str(tmp_path), programs, 2)
    assert holds(str(tmp_path), programs, 2)
    assert not holds(str(tmp_path), {**programs, "apply": b"b"}, 2)
    assert not holds(str(tmp_path), programs, 4)
    assert not holds("", programs, 2)   # no cache: nothing held
    mark_held("", programs, 2)          # and nothing to mark
