#!/usr/bin/env bash
# Sets up .venv if needed, then runs the chaos demo: the bundled small model
# on 4 local workers x 2 simulated devices plus 1 spare; three workers are
# killed (one while it sends state to the spare). Prints the verdict and the
# path of the HTML report. Extra arguments go to `elastic chaos`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
export JAX_PLATFORMS=cpu
exec .venv/bin/elastic chaos --scenario chaos/scenarios/kill-three.yml "$@"
