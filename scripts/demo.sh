#!/usr/bin/env bash
# Sets up .venv if needed, then runs the chaos demo: the bundled small model
# on 4 local workers x 2 simulated devices plus 1 spare; three workers are
# killed (one while it sends state to the spare), the run shrinks to 2 slices
# and grows back to 4 as the relaunched workers rejoin. Prints the verdict and
# the HTML report as a file:// link. Extra arguments go to `elastic chaos`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
export JAX_PLATFORMS=cpu
exec .venv/bin/elastic chaos --scenario chaos/scenarios/kill-three.yml "$@"
