#!/usr/bin/env bash
# Sets up .venv (and the Debian packages chromium and openssl) if needed,
# then runs the whole test suite in parallel (an idle pytest-xdist worker takes tests queued for a busy one,
# so the long tests at the end do not wait behind each other).
# Extra arguments go to pytest (e.g. scripts/test.sh tests/unit -q).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
bash scripts/system_packages.sh
export JAX_PLATFORMS=cpu
exec .venv/bin/python -m pytest -n auto --dist worksteal --timeout=600 "$@"
