#!/usr/bin/env bash
# Sets up .venv (and the Debian packages chromium and openssl) if needed,
# then runs the whole test suite in parallel.
# Extra arguments go to pytest (e.g. scripts/test.sh tests/unit -q).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
bash scripts/system_packages.sh
export JAX_PLATFORMS=cpu
# worksteal: a worker that runs out of tests takes queued ones from the other (the real-process tests vary
# from 1 to 40 s, so a fixed split leaves one worker idle at the end).
exec .venv/bin/python -m pytest -n auto --dist worksteal --timeout=600 "$@"
