"""Property-based fuzzing of the config parser (pure, bounded, deterministic).

Contract under test (``elastic/config.py``): overrides, dicts, YAML files and
``base_config`` chains give a valid :class:`elastic.Config` or an
:class:`elastic.ConfigError` naming the key or the file, never another
exception. A valid Config survives ``config_from_dict(cfg.to_dict())``.

``test_inputs_the_fuzzers_found_are_a_config_error`` keeps the exact inputs the
fuzzers once found raising something else.
"""

import pathlib
import re
import tempfile

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir

from elastic import Config, ConfigError, load_config
from elastic.config import config_from_dict

# Hypothesis caches what it learns about the code under .hypothesis/ in the working directory; keep the
# checkout clean (the examples are derandomized and no database is kept, so nothing is lost).
set_hypothesis_home_dir(pathlib.Path(tempfile.gettempdir()) / "jax-elastic-hypothesis")
FUZZ = settings(deadline=None, derandomize=True, database=None, max_examples=80,
                suppress_health_check=[HealthCheck.too_slow])

KEYS = sorted(Config().to_dict())


def config_or_config_error(make):
    """Calls ``make()``; returns the Config, or None for a ConfigError; anything else fails the test."""
    try:
        cfg = make()
    except ConfigError as e:
        assert str(e)
        return None
    assert isinstance(cfg, Config)
    assert config_from_dict(cfg.to_dict()) == cfg
    return cfg


# Values as a person types them after '=' (or in YAML), including near misses.
SCALAR_TEXT = st.one_of(
    st.sampled_from(["0", "1", "-1", "3", "30", "1e-3", "1.0e-3", "0.5", ".inf", "-.inf", ".nan", "nan", "inf",
                     "true", "false", "yes", "no", "on", "null", "~", "", "0x10", "0o17", "1_000", "2001-02-03",
                     "2001-02-03T04:05:06Z", "'quoted'", "[1]", "{a: 1}", "!!binary aGk=", "&a 1", "*a", "#",
                     "4096", "33554432", "a/b", "../x", "/abs", "runs"]),
    st.sampled_from(["1e400", "1" + "0" * 400, "-1" + "0" * 400, "2001-02-30", "0000-00-00", "2001-13-01",
                     "\x00", "\udcff"]),
    st.integers().map(str),
    st.floats().map(repr),
    st.text(max_size=8),
)
NUMBER_KEYS = [k for k, v in Config().to_dict().items() if type(v) in (int, float)]
OVERRIDE = st.one_of(
    st.builds(lambda k, v: f"{k}={v}", st.sampled_from(KEYS), SCALAR_TEXT),
    st.builds(lambda k, v: f"{k}={v}", st.sampled_from(NUMBER_KEYS), SCALAR_TEXT),
    st.builds(lambda k, v: f"{k}={v}", st.one_of(st.sampled_from(["base_config", "stpes", " steps ", ""]),
                                                 st.text(max_size=6)), SCALAR_TEXT),
    st.text(max_size=12),
)


@FUZZ
@given(st.lists(OVERRIDE, max_size=5))
def test_overrides_give_a_config_or_a_config_error(overrides):
    cfg = config_or_config_error(lambda: load_config("tiny", overrides))
    steps = [text.strip() for key, _, text in (o.partition("=") for o in overrides) if key.strip() == "steps"]
    if cfg is not None and steps and re.fullmatch(r"[0-9]+", steps[-1]):
        assert cfg.steps == int(steps[-1])   # the last override of a key wins


ANY = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.sampled_from([2**63, -(10**400), 10**400]), st.floats(),
              st.text(max_size=6)),
    lambda inner: st.one_of(st.lists(inner, max_size=2), st.dictionaries(st.text(max_size=3), inner, max_size=2)),
    max_leaves=4,
)


@FUZZ
@given(st.dictionaries(st.one_of(st.sampled_from(KEYS), st.text(max_size=6)), ANY, max_size=5))
def test_dicts_and_replace_give_a_config_or_a_config_error(values):
    config_or_config_error(lambda: config_from_dict(values))
    config_or_config_error(lambda: Config().replace(**{k: v for k, v in values.items() if k.isidentifier()}))


# --------------------------------------------------------------------------- YAML files and base_config chains

@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """One directory for every example of a test (hypothesis runs examples inside one test call)."""
    return tmp_path_factory.mktemp("fuzz-config")
FILES = ("a.yml", "b.yml", "c.yml")
LAYER = st.dictionaries(st.one_of(st.sampled_from(KEYS), st.text(max_size=5)),
                        st.one_of(ANY, SCALAR_TEXT), max_size=4)
BASE = st.one_of(st.sampled_from([*FILES, "missing.yml", "", ".", "..", "a.yml/x", "\x00", "x" * 300]),
                 st.text(max_size=8), ANY)
RAW_LINES = ["steps: 2001-02-30", "learning_rate: 1" + "0" * 400, "steps: [1, 2]", "? [1, 2]\n: 3", "- 1",
             "steps: &a 3\nwarmup_steps: *a", "steps: !!python/int 3", "%YAML 9", "\t", "steps: 1\nsteps: 2",
             "base_config: a.yml", "base_config: b.yml", "base_config: [a.yml]", "base_config:", "x: " + "[" * 800]


@st.composite
def config_files(draw):
    """Up to three YAML files, each maybe naming another as its base_config (chains and cycles)."""
    files = {}
    for name in FILES[:draw(st.integers(1, 3))]:
        kind = draw(st.integers(0, 9))
        if kind == 0:
            files[name] = draw(st.binary(max_size=40))
        elif kind == 1:
            files[name] = "\n".join(draw(st.lists(st.sampled_from(RAW_LINES), min_size=1, max_size=3))).encode()
        elif kind == 2:
            files[name] = draw(st.text(max_size=40)).encode()
        else:
            layer = draw(LAYER)
            if draw(st.booleans()):
                layer["base_config"] = draw(BASE)
            files[name] = yaml.safe_dump(layer, allow_unicode=True).encode()
    return files


@settings(FUZZ, max_examples=100)
@given(config_files())
def test_yaml_files_and_base_config_chains_give_a_config_or_a_config_error(scratch, files):
    for old in scratch.glob("*.yml"):
        old.unlink()
    for name, data in files.items():
        (scratch / name).write_bytes(data)
    config_or_config_error(lambda: load_config(scratch / "a.yml"))


@pytest.mark.parametrize("source,overrides,message", [
    pytest.param(None, ["learning_rate=1" + "0" * 400], r"'learning_rate' must be a finite number",
                 id="override-int-too-large-for-a-float-key"),
    pytest.param("learning_rate: 1" + "0" * 400 + "\n", [], r"'learning_rate' must be a finite number.*c\.yml",
                 id="yaml-int-too-large-for-a-float-key"),
    pytest.param(None, ["steps=2001-02-30"], r"override 'steps=2001-02-30'", id="override-impossible-date"),
    pytest.param("steps: 2001-02-30\n", [], r"invalid YAML in .*c\.yml", id="yaml-impossible-date"),
    pytest.param('base_config: "x\\0y"\n', [], r"base_config in .*c\.yml must be a file name",
                 id="base-config-with-nul"),
    pytest.param(b"\xff\xfe", [], r"c\.yml is not UTF-8", id="config-file-not-utf8"),
    pytest.param("x: " + "[" * 800 + "]" * 800 + "\n", [], r"invalid YAML in .*c\.yml: nested too deeply",
                 id="yaml-nested-too-deeply"),
])
def test_inputs_the_fuzzers_found_are_a_config_error(tmp_path, source, overrides, message):
    """Exact inputs the fuzzers found raising something other than ConfigError (OverflowError, PyYAML's
    ValueError for an impossible date, ValueError('embedded null byte'), UnicodeDecodeError, RecursionError):
    each is a ConfigError naming the key or the file."""
    path = "tiny"
    if source is not None:
        path = tmp_path / "c.yml"
        path.write_bytes(source if isinstance(source, bytes) else source.encode())
    with pytest.raises(ConfigError, match=message):
        load_config(path, overrides)
