"""``python -m integrations.maxtext CONFIG.yml [key=value ...] [--reference]``: train a MaxText config elastically.

Sets this process's simulated CPU devices to a slice's (``ici_fsdp_parallelism``)
before JAX starts, loads the config (:func:`load_maxtext_config`), builds the
job (:func:`make_job`, or ``elastic_trainer``'s factory; see
:func:`integrations.maxtext.cli.build_job`) and runs it on local workers, or in this process with
``--reference``. Prints the run directory and the last loss. Exit status: 0
done, 2 bad input (one line naming the key), 1 the run failed.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

import elastic
from integrations.maxtext.config_files import devices_per_slice


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m integrations.maxtext", description=__doc__.splitlines()[0])
    parser.add_argument("config", help="a MaxText YAML file (base_config: base.yml for MaxText's defaults)")
    parser.add_argument("overrides", nargs="*", default=[], help="key=value: MaxText keys and jax-elastic keys alike")
    parser.add_argument("--reference", action="store_true", help="run the canonical math in this process")
    args = parser.parse_args(argv)
    try:
        _set_device_count(devices_per_slice(pathlib.Path(args.config), args.overrides))
        from integrations.maxtext.cli import build_job
        from runtime import ElasticError, ProgramExportError   # after XLA_FLAGS: runtime imports JAX

        job = build_job(args.config, args.overrides)   # MaxText's model, or elastic_trainer's factory
    except elastic.ConfigError as e:
        return _fail(f"error: {e}", 2)
    except ProgramExportError as e:
        return _fail(f"error: {e}", 2)
    try:
        report = job.fit(reference=args.reference)
    except elastic.ConfigError as e:
        return _fail(f"error: {e}", 2)
    except ElasticError as e:
        from elastic.options import in_config_terms
        return _fail(f"run failed: {type(e).__name__}: {in_config_terms(str(e))}; see {job.run_dir()}", 1)
    print(f"{report['steps_completed']}/{report['steps_requested']} steps, run directory {job.run_dir()}, "
          f"last loss {report['losses'][-1] if report.get('losses') else 'n/a'}")
    return 0


def _set_device_count(n: int) -> None:
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    os.environ["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={n}"])


def _fail(message: str, status: int) -> int:
    print(f"python -m integrations.maxtext: {message}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
