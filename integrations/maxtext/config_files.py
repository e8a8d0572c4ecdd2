"""A MaxText config file as the user wrote it, read without MaxText or JAX: its chain, its keys, its overrides.

Contract:

* :func:`read_chain` follows a file's ``base_config`` chain as MaxText's own loader resolves it (relative to
  the file, else in MaxText's configs directory, :func:`maxtext_configs_dir`) and reads the user's files of
  it with jax-elastic's reader (:func:`elastic.config_loading.read_config_file`: one-line errors naming
  file, line and column); MaxText's own files hold its defaults and are not read here.
* :func:`claims` says, from that chain alone, whether a file is a MaxText config at all (MaxText's own
  files, files that inherit them, files with MaxText keys) or one of jax-elastic's.
* :func:`parse_overrides` reads ``key=value`` overrides as YAML values, keeping each one's text (for
  MaxText's own loader); :func:`devices_per_slice` is the user's ``ici_fsdp_parallelism``, which the
  client needs before JAX starts.
* Nothing here imports MaxText or JAX: :mod:`integrations.maxtext.config` does, to validate the config
  these files make.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import pathlib
from collections.abc import Iterable
from typing import Any

import yaml

import elastic
from elastic.config_loading import builtin_config_path, read_config_file

__all__ = ["Chain", "check_chain_ends", "claims", "devices_per_slice", "maxtext_configs_dir", "parse_overrides",
           "read_chain"]


def parse_overrides(overrides: Iterable[str]) -> dict[str, tuple[Any, str]]:
    """``{key: (YAML value, raw text)}``; later items win."""
    if isinstance(overrides, (str, bytes)):
        raise elastic.ConfigError(f"overrides must be a list of 'key=value' strings, got the string {overrides!r}")
    out = {}
    for item in overrides:
        key, sep, text = str(item).partition("=")
        key, text = key.strip(), text.strip()
        if not sep or not key:
            raise elastic.ConfigError(f"override {item!r} is not of the form key=value")
        if key == "base_config":
            raise elastic.ConfigError("config key 'base_config' (in overrides) is only allowed at the top of a "
                                      "YAML file")
        try:
            value = yaml.safe_load(text) if text else ""
        except yaml.YAMLError as e:
            problem = " ".join(str(getattr(e, "problem", None) or "syntax error").split())
            raise elastic.ConfigError(f"override {item!r}: value is not a YAML scalar ({problem})") from None
        except ValueError as e:   # PyYAML's constructors: a date that cannot be (2001-02-30)
            raise elastic.ConfigError(f"override {item!r}: value is not a valid YAML scalar "
                                      f"({' '.join(str(e).split())})") from None
        except RecursionError:
            raise elastic.ConfigError(f"override {item!r}: value is not a YAML scalar (nested too deeply)") from None
        out[key] = (value, text)
    return out


@dataclasses.dataclass(frozen=True)
class Chain:
    """A config file's ``base_config`` chain, resolved as MaxText resolves it, read as far as the user's files go.

    ``keys``: ``{key: (value, file)}`` the user's files set (a file overrides its base). ``maxtext_file``: the
    first of MaxText's own files the chain reaches (they hold MaxText's defaults and are not read here), if any.
    ``ambiguous``: the ``base_config`` name that led there is also one of jax-elastic's bundled configs
    (``base.yml``). ``unresolved``: ``(name, file)`` when the chain stops at a ``base_config`` MaxText cannot
    find (``bundled`` tells whether jax-elastic bundles that name, as ``tiny``).
    """

    keys: dict[str, tuple[Any, str]]
    maxtext_file: pathlib.Path | None = None
    ambiguous: bool = False
    unresolved: tuple[str, str] | None = None
    bundled: bool = False


def maxtext_configs_dir() -> pathlib.Path | None:
    """MaxText's configs directory (``MAXTEXT_CONFIGS_DIR``, else the package's ``configs``), None without MaxText.

    Found without importing MaxText: its ``__init__`` lowers the C++ log level of the whole process
    (``TF_CPP_MIN_LOG_LEVEL=0``), which a jax-elastic config must not pay for being asked about.
    """
    spec = importlib.util.find_spec("maxtext")
    if spec is None or not spec.submodule_search_locations:
        return None
    package = pathlib.Path(next(iter(spec.submodule_search_locations)))
    return pathlib.Path(os.environ.get("MAXTEXT_CONFIGS_DIR") or package / "configs").resolve()


def read_chain(path: pathlib.Path) -> Chain:
    """``path``'s chain (see :class:`Chain`). ConfigError (one line) for a user's file that cannot be read, is not
    YAML or not a mapping, and for a cycle; a ``base_config`` that cannot be found is recorded, not raised."""
    own = maxtext_configs_dir()
    layers, seen, referrer = [], [], None
    maxtext_file, ambiguous, unresolved, bundled = None, False, None, False
    while True:
        real = path.resolve()
        if real in seen:
            raise elastic.ConfigError(f"base_config cycle: {' -> '.join(map(str, (*seen, real)))}")
        seen.append(real)
        if own is not None and own in real.parents:
            maxtext_file = real
            break
        layer = read_config_file(path, referrer)
        base = layer.pop("base_config", None)
        layers.append({k: (v, str(path)) for k, v in layer.items()})
        if base is None:
            break
        if not isinstance(base, str) or not base or "\x00" in base:
            raise elastic.ConfigError(f"base_config in {path} must be a file name, got {base!r}")
        beside = path.parent / base
        referrer, path = path, beside
        if pathlib.Path(base).is_absolute() or beside.is_file():
            continue
        is_bundled = _bundled(base)
        if own is not None and (own / base).is_file():
            path, ambiguous = own / base, is_bundled   # MaxText's own file of that name, as MaxText's loader finds it
            continue
        unresolved, bundled = (base, str(referrer)), is_bundled
        break
    keys: dict[str, tuple[Any, str]] = {}
    for layer in reversed(layers):
        keys.update(layer)
    return Chain(keys, maxtext_file, ambiguous, unresolved, bundled)


def _bundled(name: str) -> bool:
    """Whether jax-elastic's own loader would read ``base_config: name`` as one of its bundled configs."""
    try:
        builtin_config_path(name)
    except elastic.ConfigError:
        return False
    return True


def _user_keys(path: pathlib.Path) -> dict[str, tuple[Any, str]]:
    """``{key: (value, file)}`` set by the user's files of ``path``'s base_config chain (MaxText's own files,
    under its configs directory, hold its defaults and are not read here). Resolves ``base_config`` as
    MaxText does: relative to the file, else in MaxText's configs directory."""
    return read_chain(path).keys


def check_chain_ends(chain: Chain) -> None:
    """ConfigError when the chain names a ``base_config`` MaxText's loader cannot find."""
    if chain.unresolved is None:
        return
    name, referrer = chain.unresolved
    if chain.bundled:
        raise elastic.ConfigError(
            f"base_config {name!r} (in {referrer}) is jax-elastic's bundled config, which MaxText cannot read: a "
            "MaxText config inherits MaxText's base.yml or a file of yours (a file of jax-elastic's keys only is "
            "read by jax-elastic, with its bundled configs)")
    raise elastic.ConfigError(f"config file not found: {name} (base_config of {referrer}; not beside it, nor in "
                              f"MaxText's configs directory {maxtext_configs_dir()})")


def claims(path: pathlib.Path, overrides: Iterable[str] = ()) -> bool:
    """Whether ``path`` (with ``overrides``) is a MaxText config rather than a jax-elastic one; no JAX, no MaxText.

    It is when it is one of MaxText's own files (its ``base.yml``, its model files...), when its chain reaches
    one of MaxText's files by a path or by a name jax-elastic does not bundle, or when a file of the chain sets
    a key jax-elastic does not define. ``base_config: base.yml`` with no such file beside names both MaxText's
    and jax-elastic's bundled ``base.yml``: there the keys decide, and so does an override of a key MaxText's
    ``base.yml`` sets (``model_name=``). A file that cannot be read is not claimed: jax-elastic's reader names
    the problem.
    """
    try:
        chain = read_chain(path)
    except elastic.ConfigError:
        return False
    if chain.maxtext_file is not None and not chain.ambiguous:
        return True
    own = {f.name for f in dataclasses.fields(elastic.Config)}
    if any(k not in own for k in chain.keys):
        return True
    if chain.ambiguous:   # an override of a MaxText key (model_name=...); a typo is left to jax-elastic's reader
        maxtext = set(read_config_file(chain.maxtext_file))
        return any(k in maxtext and k not in own for k in (str(o).partition("=")[0].strip() for o in overrides))
    return False


def devices_per_slice(path: pathlib.Path, overrides: list[str]) -> int:
    """``ici_fsdp_parallelism`` as the user set it, read without starting JAX (-1 or unset: 1)."""
    if not path.is_file():
        raise elastic.ConfigError(f"MaxText config file not found: {path}")
    user = {**_user_keys(path), **{k: v for k, (v, _) in parse_overrides(overrides).items()}}
    value = user.get("ici_fsdp_parallelism", -1)
    value = value[0] if isinstance(value, tuple) else value
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else 1
