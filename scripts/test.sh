#!/usr/bin/env bash
# Sets up .venv (and the Debian packages chromium and openssl) if needed,
# then runs the whole test suite in parallel.
# Extra arguments go to pytest (e.g. scripts/test.sh tests/unit -q).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
bash scripts/system_packages.sh
export JAX_PLATFORMS=cpu
exec .venv/bin/python -m pytest -n auto --timeout=600 "$@"
