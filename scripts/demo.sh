#!/usr/bin/env bash
# Sets up .venv if needed, then trains the bundled model on 4 local workers
# x 2 simulated devices and prints the run summary.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
export JAX_PLATFORMS=cpu
exec .venv/bin/elastic run tiny "$@"
