"""Chaos scenario files: a named experiment in YAML (config, overrides, faults, seed).

Contract: :func:`load_scenario` reads one YAML file (format in
``docs/chaos-guide.md``) into a frozen :class:`Scenario`, with every fault
parsed and validated by the grammar (:mod:`chaos.spec`). Unknown keys, bad
types and bad faults raise :class:`~chaos.spec.FaultSpecError` naming the key
and the file. Reading the file is its only side effect.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from collections.abc import Mapping
from typing import Any

import yaml

from chaos.spec import Fault, FaultSpecError, parse_duration, parse_faults, split_faults, validate
from elastic.config_loading import yaml_problem

__all__ = ["Scenario", "load_scenario"]


@dataclasses.dataclass(frozen=True)
class Scenario:
    """A named chaos experiment: a config, overrides and the faults to inject.

    ``mtbf_seconds``/``duration_seconds`` ask the runner for extra random faults
    (``chaos.schedule.random_faults(seed, mtbf_seconds, duration_seconds)``).
    ``expect`` is the verdict the scenario should get: "pass" or "fail".
    """

    name: str
    config: str = "tiny"
    overrides: tuple[str, ...] = ()
    faults: tuple[Fault, ...] = ()
    seed: int = 0
    mtbf_seconds: float | None = None
    duration_seconds: float | None = None
    description: str = ""
    expect: str = "pass"


_SCENARIO_KEYS = ("name", "description", "config", "overrides", "seed", "faults", "mtbf_seconds",
                  "duration_seconds", "expect")
_FAULT_KEYS = ("kind", "target", "at", "options")


def load_scenario(path: str | os.PathLike) -> Scenario:
    """Read a scenario YAML file (format in ``docs/chaos-guide.md``) and validate its faults.

    ``name`` defaults to the file's stem. Raises FaultSpecError naming the file
    and the key for unknown keys, wrong types and bad faults.
    """
    path = pathlib.Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise FaultSpecError(f"cannot read scenario file {path}: {e.strerror}") from e
    except UnicodeDecodeError as e:
        raise FaultSpecError(f"scenario file {path} is not UTF-8 text: {e.reason} at byte {e.start}") from None
    except yaml.YAMLError as e:
        raise FaultSpecError(f"invalid YAML in scenario file {path}{yaml_problem(e)}") from None
    except ValueError as e:   # PyYAML raises ValueError for a date that cannot be (2001-02-30)
        raise FaultSpecError(f"invalid YAML in scenario file {path}: {e}") from None
    except RecursionError:
        raise FaultSpecError(f"invalid YAML in scenario file {path}: nested too deeply") from None
    if not isinstance(data, dict):
        raise FaultSpecError(f"{path}: a scenario must be a YAML mapping, got {type(data).__name__}")
    for key in data:
        if key not in _SCENARIO_KEYS:
            raise FaultSpecError(f"{path}: unknown scenario key {key!r} (keys: {_names(_SCENARIO_KEYS)})")

    def get(key: str, types: tuple[type, ...], default: Any) -> Any:
        value = data.get(key)
        if value is None:  # absent, or present and empty
            return default
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise FaultSpecError(f"{path}: scenario key {key!r} has the wrong type ({type(value).__name__})")
        return value

    faults_data = get("faults", (list,), [])
    faults = []
    for i, item in enumerate(faults_data, 1):
        try:
            text = item if isinstance(item, str) else _fault_text(item)
            if not text.strip() or len(split_faults(text)) != 1:
                raise FaultSpecError(f"expected exactly one fault, got {text!r}")
            faults.extend(parse_faults(text))
        except FaultSpecError as e:
            raise FaultSpecError(f"{path}: faults[{i}]: {e}") from None
    try:
        validate(faults)
    except FaultSpecError as e:
        raise FaultSpecError(f"{path}: {e}") from None
    mtbf = _seconds(path, "mtbf_seconds", data.get("mtbf_seconds"))
    duration = _seconds(path, "duration_seconds", data.get("duration_seconds"))
    if mtbf is not None and duration is None:
        raise FaultSpecError(f"{path}: mtbf_seconds needs duration_seconds (how long to draw random faults for)")
    expect = get("expect", (str,), "pass")
    if expect not in ("pass", "fail"):
        raise FaultSpecError(f"{path}: scenario key 'expect' must be 'pass' or 'fail', got {expect!r}")
    return Scenario(
        name=str(get("name", (str,), path.stem)),
        description=str(get("description", (str,), "")).strip(),
        config=str(get("config", (str,), "tiny")),
        overrides=_overrides(path, data.get("overrides") or {}),
        faults=tuple(faults),
        seed=get("seed", (int,), 0),
        mtbf_seconds=mtbf,
        duration_seconds=duration,
        expect=expect,
    )


def _fault_text(item: Any) -> str:
    """The grammar text of a fault written as a mapping {kind, target, at, options}."""
    if not isinstance(item, Mapping):
        raise FaultSpecError(f"a fault must be a string or a mapping, got {type(item).__name__}")
    for key in item:
        if key not in _FAULT_KEYS:
            raise FaultSpecError(f"unknown fault key {key!r} (keys: {_names(_FAULT_KEYS)})")
    if "kind" not in item or "at" not in item:
        raise FaultSpecError("a fault mapping needs 'kind' and 'at'")
    text = _scalar("kind", item["kind"])
    options = item.get("options") or {}
    if not isinstance(options, Mapping):
        raise FaultSpecError(f"fault 'options' must be a mapping, got {type(options).__name__}")
    if options:
        text += "(" + ",".join(f"{_scalar('options', k)}={_scalar('options', v)}" for k, v in options.items()) + ")"
    if "target" in item:
        text += ":" + _pair("target", item["target"])
    return f"{text}@{_pair('at', item['at'])}"


def _pair(key: str, value: Any) -> str:
    """``{slice: 2}`` -> ``slice=2``; ``{transfer: true}`` and strings pass through; a target may also be
    ``{stage: 1, replica: 0}`` -> ``stage=1,replica=0``."""
    if isinstance(value, str):
        return value
    if key == "target" and isinstance(value, Mapping) and set(value) == {"stage", "replica"}:
        return f"stage={_scalar(key, value['stage'])},replica={_scalar(key, value['replica'])}"
    if isinstance(value, Mapping) and len(value) == 1:
        (name, inner), = value.items()
        if inner is True or inner is None:
            return _scalar(key, name)
        return f"{_scalar(key, name)}={_scalar(key, inner)}"
    raise FaultSpecError(f"fault {key!r} must be a string or a one-key mapping, got {value!r}")


def _scalar(key: str, value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise FaultSpecError(f"fault {key!r} value must be a string or a number, got {value!r}")
    text = str(value)
    if any(ch in text for ch in ",()@:="):
        raise FaultSpecError(f"fault {key!r} value {text!r} may not contain , ( ) @ : =")
    return text


def _overrides(path: pathlib.Path, value: Any) -> tuple[str, ...]:
    if isinstance(value, Mapping):
        items = []
        for k, v in value.items():
            if isinstance(v, (Mapping, list)):
                raise FaultSpecError(f"{path}: override {k!r} must be a scalar, got {v!r}")
            items.append(f"{k}={'true' if v is True else 'false' if v is False else '' if v is None else v}")
        return tuple(items)
    if isinstance(value, list) and all(isinstance(v, str) and "=" in v for v in value):
        return tuple(value)
    raise FaultSpecError(f"{path}: scenario key 'overrides' must be a mapping (or a list of key=value), got {value!r}")


def _seconds(path: pathlib.Path, key: str, value: Any) -> float | None:
    if value is None:
        return None
    try:
        seconds = parse_duration(str(value)) if not isinstance(value, bool) else -1.0
    except FaultSpecError:
        seconds = -1.0
    if seconds <= 0:
        raise FaultSpecError(f"{path}: scenario key {key!r} must be a positive number of seconds, got {value!r}")
    return seconds


def _names(items) -> str:
    return ", ".join(items) if items else "none"
