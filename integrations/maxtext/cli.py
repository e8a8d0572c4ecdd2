"""MaxText config files under ``elastic run`` and ``elastic chaos`` (the ``elastic.configs`` entry point).

``pyproject.toml`` declares ``maxtext = "integrations.maxtext.cli:LOADER"``
in the group ``elastic.configs``; :mod:`elastic.cli_support` asks every such
loader whether it claims a config file (see its contract there). This one
claims a YAML file whose ``base_config`` chain (resolved as MaxText does)
sets a key jax-elastic's own schema does not define, when MaxText is
installed. It then loads the file with MaxText's own config code
(:func:`integrations.maxtext.load_maxtext_config`) and builds the job
(:func:`integrations.maxtext.make_job`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib

import elastic

__all__ = ["LOADER", "MaxTextConfigs"]


class MaxTextConfigs:
    """The ``elastic.configs`` loader of MaxText config files."""

    name = "maxtext"

    def claims(self, path: str) -> bool:
        """True for a YAML file that sets a key jax-elastic does not define, with MaxText installed. No JAX."""
        p = pathlib.Path(path)
        if p.suffix not in (".yml", ".yaml") or not p.is_file() or importlib.util.find_spec("maxtext") is None:
            return False
        from integrations.maxtext.config import _user_keys

        try:
            keys = _user_keys(p)
        except elastic.ConfigError:
            return True   # MaxText's reader has the clearer error for it
        own = {f.name for f in dataclasses.fields(elastic.Config)}
        return any(k not in own for k in keys)

    def devices_per_slice(self, path: str, overrides: list[str]) -> int:
        """The slice's device count as the user set it, read without starting JAX."""
        from integrations.maxtext.__main__ import _devices_per_slice

        return _devices_per_slice(pathlib.Path(path), list(overrides))

    def make_job(self, path: str, overrides: list[str]):
        """The elastic job of the MaxText config (starts JAX: set the device count first)."""
        from integrations.maxtext import load_maxtext_config, make_job

        return make_job(*load_maxtext_config(path, list(overrides)))


LOADER = MaxTextConfigs()
