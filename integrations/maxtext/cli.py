"""MaxText config files under ``elastic run`` and ``elastic chaos`` (the ``elastic.configs`` entry point).

``pyproject.toml`` declares ``maxtext = "integrations.maxtext.cli:LOADER"``
in the group ``elastic.configs``; :mod:`elastic.cli_support` asks every such
loader whether it claims a config file (see its contract there). This one
claims, when MaxText is installed, every YAML file MaxText's own loader takes
for its own (:func:`integrations.maxtext.config_files.claims`): MaxText's
``base.yml`` and model files, files that inherit them, and files that set a
key jax-elastic's schema does not define. It then loads the file with
MaxText's own config code (:func:`integrations.maxtext.load_maxtext_config`)
and builds the job (:func:`integrations.maxtext.make_job`), or, with
``elastic_trainer`` set, the job of that factory, given both configs.

What MaxText and its libraries print while the client loads the config and
traces the programs (stub notices, transformers' and absl's warnings) goes to
``<run dir>/logs/client.log``, not the terminal; the C++ log level stays
JAX's default (MaxText's package would lower it to print XLA's INFO lines).
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import sys

import elastic

__all__ = ["LOADER", "MaxTextConfigs", "build_job"]


class MaxTextConfigs:
    """The ``elastic.configs`` loader of MaxText config files."""

    name = "maxtext"

    def claims(self, path: str, overrides: list[str] = ()) -> bool:
        """True for a MaxText config file (see :func:`integrations.maxtext.config_files.claims`), with MaxText
        installed. Imports neither JAX nor MaxText."""
        p = pathlib.Path(path)
        if p.suffix not in (".yml", ".yaml") or not p.is_file() or importlib.util.find_spec("maxtext") is None:
            return False
        from integrations.maxtext.config_files import claims

        return claims(p, overrides)

    def devices_per_slice(self, path: str, overrides: list[str]) -> int:
        """The slice's device count as the user set it, read without starting JAX."""
        from integrations.maxtext.config_files import devices_per_slice

        return devices_per_slice(pathlib.Path(path), list(overrides))

    def make_job(self, path: str, overrides: list[str]):
        """The elastic job of the MaxText config (starts JAX: set the device count first)."""
        return build_job(path, list(overrides))


def build_job(path, overrides: list[str]):
    """The job of a MaxText config for the command line: MaxText's model, or ``elastic_trainer``'s factory.

    The factory is called as ``factory(elastic_config, maxtext_config)`` (the
    signature of :func:`integrations.maxtext.make_job`, so it can wrap it, with
    its own ``data=`` for instance), or ``factory(elastic_config)`` when it
    takes one argument. Before tracing, the run directory is checked as for
    every run (usable, not held by another run), and ``metrics_file`` too. What the libraries print
    meanwhile is written to the run directory's ``logs/client.log``.
    Raises ``elastic.ConfigError`` for bad input.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")   # JAX's own default; MaxText's package would set 0
    from elastic.cli_support import factory_job, kept_library_output
    from elastic.preflight import check_metrics_file, check_output_directory

    with kept_library_output() as kept:
        from integrations.maxtext import load_maxtext_config, make_job
        from integrations.maxtext.model import import_maxtext

        ec, mt = load_maxtext_config(path, overrides)
        check_output_directory(ec.base_output_directory, ec.run_name)
        check_metrics_file(ec.metrics_file)   # before the programs are traced (fit checks again)
        if ec.elastic_trainer:
            import_maxtext()   # what MaxText prints as it imports is kept here, not in the factory's output
            job = None
        elif ec.rl_samplers:   # RL post-training of MaxText's model (docs/rl.md)
            from integrations.maxtext.rl import make_rl_job

            job = make_rl_job(ec, mt)
        else:
            job = make_job(ec, mt)
    if job is None:   # the user's code: what it prints is theirs to see
        job = factory_job(ec, mt)
    _write_client_log(job, kept)
    for split, source in (("train", getattr(job, "data", None)), ("eval", getattr(job, "eval_data", None))):
        if getattr(source, "index_origin", ""):   # real data's packing index: built now, or a cached one's file
            print(f"elastic: the {split} data's packing index: {source.index_origin}", file=sys.stderr)
    return job


def _write_client_log(job, kept: list[str]) -> None:
    """``<run dir>/logs/client.log``: what the libraries printed while the job was built (nothing if nothing)."""
    text = "".join(kept)
    if not text:
        return
    logs = job.run_dir() / "logs"
    try:
        logs.mkdir(parents=True, exist_ok=True)
        with open(logs / "client.log", "a", encoding="utf-8") as log:   # an earlier run's is never overwritten
            log.write(text)
    except OSError as e:   # the run's own check of its directory comes next and names the problem
        raise elastic.ConfigError(f"cannot write run files to {logs}: {e.strerror or e}; choose a writable "
                                  "directory (config key 'base_output_directory')") from None


LOADER = MaxTextConfigs()
