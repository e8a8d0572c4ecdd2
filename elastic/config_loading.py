"""Loading a config: YAML files with ``base_config`` inheritance, bundled configs, ``key=value`` overrides.

Contract:

* A config file is a YAML mapping of flat ``key: value`` pairs. ``base_config:
  other.yml`` (a path relative to the file that names it; where no such file
  is, a bundled config's name, ``base``, ``tiny``, ``base.yml``...) is loaded
  first and the file overrides it; chains are allowed, a cycle is an error.
* ``key=value`` overrides (the command line) are applied last. A value is read as a
  YAML scalar and then checked against the type of its key, so ``steps=30`` is an
  int and ``learning_rate=1e-3`` is a float.
* The result is the schema's validated :class:`elastic.config.Config`. Every problem (missing file, bad
  YAML, and whatever the schema refuses) raises :class:`elastic.config.ConfigError` with a one-line
  message naming the key or the file (with the line and column), and the file or ``overrides`` a key
  came from. Nothing is read from the environment.
* :func:`read_config_file` and :func:`yaml_problem` serve other readers too: the MaxText integration
  reads the user's files with the first, the chaos scenarios put PyYAML's errors in one line with the
  second.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterable
from typing import Any

import yaml

from elastic.config import Config, ConfigError, coerce, config_from_entries, key_field

__all__ = ["builtin_config_path", "bundled_configs", "load_config", "parse_overrides", "read_config_file", "yaml_problem"]

_CONFIG_DIR = pathlib.Path(__file__).resolve().parent / "configs"


def bundled_configs() -> list[str]:
    """The names of the bundled configs (``elastic/configs/*.yml``), sorted: what every listing of them shows."""
    return sorted(p.stem for p in _CONFIG_DIR.glob("*.yml"))


def load_config(path: str | pathlib.Path, overrides: Iterable[str] = ()) -> Config:
    """Load ``path`` (a YAML file, or the name of a builtin config such as ``"tiny"``
    when no such file exists), its ``base_config`` chain, then ``overrides``."""
    entries: dict[str, tuple[Any, str]] = {}
    for source, layer in _read_chain(_locate(path)):
        for key, value in layer.items():
            entries[key] = (coerce(key, value, source), source)
    for key, value in parse_overrides(overrides).items():
        entries[key] = (value, "overrides")
    return config_from_entries(entries)


def parse_overrides(items: Iterable[str]) -> dict[str, Any]:
    """Parse ``key=value`` strings into ``{key: typed value}``; later items win.

    Values of string keys are taken verbatim (so ``run_name=007`` stays ``"007"``);
    other values are read as YAML scalars and checked against the key's type.
    """
    if isinstance(items, (str, bytes)):
        raise ConfigError(f"overrides must be a list of 'key=value' strings, got the string {items!r}")
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = str(item).partition("=")
        key, text = key.strip(), text.strip()
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        if key_field(key, "overrides").type == "str":
            out[key] = text
            continue
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: value is not a YAML scalar") from e
        except ValueError as e:   # PyYAML's constructors: a date that cannot be (2001-02-30)
            raise ConfigError(f"override {item!r}: value is not a valid YAML scalar ({e})") from None
        except RecursionError:
            raise ConfigError(f"override {item!r}: value is not a YAML scalar (nested too deeply)") from None
        out[key] = coerce(key, value, "overrides")
    return out


def builtin_config_path(name: str) -> pathlib.Path:
    """Path of the config shipped as ``elastic/configs/<name>.yml``."""
    path = _CONFIG_DIR / (name if name.endswith(".yml") else f"{name}.yml")
    if "/" in name or not path.is_file():
        known = ", ".join(bundled_configs())
        raise ConfigError(f"no builtin config {name!r}; builtin configs: {known}")
    return path


def _locate(path: str | pathlib.Path) -> pathlib.Path:
    p = pathlib.Path(path)
    if p.is_file() or len(p.parts) != 1 or (p.exists() and not p.is_dir()):
        return p   # a directory named like a builtin (a run directory "tiny" in the cwd) is not a config
    try:
        return builtin_config_path(str(path))
    except ConfigError:
        raise ConfigError(f"config file not found: {path} (not a file, nor a builtin config name)") from None


def _read_chain(path: pathlib.Path, chain: tuple[pathlib.Path, ...] = ()) -> list[tuple[str, dict[str, Any]]]:
    """``[(source, layer), ...]`` for ``path`` and its base_config chain, base first."""
    if "\x00" in str(path):   # the OS refuses the name (ValueError: embedded null byte)
        raise ConfigError(f"config file name {str(path)!r} contains a NUL character")
    real = path.resolve()
    if real in chain:
        raise ConfigError(f"base_config cycle: {' -> '.join(str(p) for p in (*chain, real))}")
    layer = read_config_file(path, referrer=chain[-1] if chain else None)
    base = layer.pop("base_config", None)
    if base is None:
        return [(str(path), layer)]
    if not isinstance(base, str) or not base or "\x00" in base:
        raise ConfigError(f"base_config in {path} must be a file name, got {base!r}")
    return [*_read_chain(_base_path(path, base), (*chain, real)), (str(path), layer)]


def _base_path(path: pathlib.Path, base: str) -> pathlib.Path:
    """The file ``base_config: base`` of ``path`` names: beside ``path``, else the bundled config of that name."""
    beside = path.parent / base
    if beside.exists():
        return beside
    try:
        return builtin_config_path(base)
    except ConfigError:
        bundled = ", ".join(bundled_configs())
        raise ConfigError(f"config file not found: {beside} (base_config of {path}); not beside it, nor a bundled "
                          f"config ({bundled})") from None


def read_config_file(path: str | pathlib.Path, referrer: str | pathlib.Path | None = None) -> dict[str, Any]:
    """The top-level mapping of one YAML config file (``base_config`` not followed), as ``{key: value}``.

    Every problem is a one-line :class:`ConfigError` naming the file (and
    ``referrer``, the file whose ``base_config`` names it): not found,
    unreadable, not UTF-8, invalid YAML (with the line and column), or not a
    mapping. Used for jax-elastic's files and, by other config formats (the
    MaxText integration), for the user's files.
    """
    path = pathlib.Path(path)
    named_by = f" (base_config of {referrer})" if referrer else ""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as e:
        raise ConfigError(f"config file not found: {path}{named_by}") from e
    except IsADirectoryError:
        raise ConfigError(f"config file {path}{named_by} is a directory, not a YAML file") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}{named_by}: {e.strerror}") from e
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path}{named_by} is not UTF-8 text: {e.reason} at byte {e.start}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"invalid YAML in {path}{named_by}{yaml_problem(e)}") from None
    except ValueError as e:   # PyYAML's constructors: a date that cannot be (2001-02-30)
        raise ConfigError(f"invalid YAML in {path}{named_by}: {' '.join(str(e).split())}") from None
    except RecursionError:
        raise ConfigError(f"invalid YAML in {path}{named_by}: nested too deeply") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of config keys, got {type(data).__name__}")
    return {str(k): v for k, v in data.items()}


def yaml_problem(e: yaml.YAMLError) -> str:
    """`` line L, column C: problem (while parsing ... at line L', column C')``: PyYAML's error in one line."""
    mark = getattr(e, "problem_mark", None)
    where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    problem = " ".join(str(getattr(e, "problem", None) or "syntax error").split())
    context, context_mark = getattr(e, "context", None), getattr(e, "context_mark", None)
    if context and context_mark and (context_mark.line, context_mark.column) != (mark and (mark.line, mark.column)):
        problem += f" ({' '.join(context.split())} at line {context_mark.line + 1}, column {context_mark.column + 1})"
    return f"{where}: {problem}"
