#!/usr/bin/env bash
# The GPU check (scripts/gpu_check.py) on a host with a GPU, python3 and JAX but without this
# project's other dependencies and without a network: installs the wheels carried in .whl/ into
# /tmp/site (no venv), then runs the check with python3.
#
#   .whl/*.whl           pure-Python packages the host lacks (tenacity, grpcio-health-checking,
#                        filelock, flatbuffers): always installed.
#   .whl/ifneeded/*.whl  grpcio and protobuf: installed only when the host's are older than the
#                        generated code in runtime/_proto needs (grpcio >= 1.85.1, protobuf >= 7.35.1).
#
# Usage: bash scripts/gpu_check.sh [scripts/gpu_check.py arguments, e.g. --steps 10 --slices 2]
# Exit status: the check's (0 PASS, 1 FAIL, 2 NO GPU), or 3 when the setup failed.
set -uo pipefail
cd "$(dirname "$0")/.."
SITE=/tmp/site
rm -rf "$SITE"
install() {   # wheels into $SITE; without pip, unpacked (a wheel is a zip of what goes into site-packages)
    if python3 -m pip --version >/dev/null 2>&1; then
        PIP_ROOT_USER_ACTION=ignore python3 -m pip install -q --disable-pip-version-check --no-index --no-deps \
            --no-compile --target "$SITE" --upgrade "$@"
    else
        for w in "$@"; do python3 -m zipfile -e "$w" "$SITE" || return 1; done
    fi
}
if ! compgen -G '.whl/*.whl' >/dev/null; then
    echo "gpu_check.sh: no wheels in .whl/: fill it first (docs/development.md, GPU check), or run .venv/bin/python scripts/gpu_check.py where this project's .venv is" >&2
    exit 3
fi
install .whl/*.whl || exit 3
needed=$(python3 - <<'EOF'
import importlib.metadata as md
import re
import sys

MINIMUM = {"grpcio": (1, 85, 1), "protobuf": (7, 35, 1)}
for name, minimum in MINIMUM.items():
    try:
        version = md.version(name)
    except md.PackageNotFoundError:
        version = None
    parts = tuple(int(x) for x in re.findall(r"\d+", version or "")[:3])
    ok = version is not None and parts >= minimum
    print(f"gpu_check.sh: {name} {version or 'missing'} on this host: "
          f"{'kept' if ok else 'installing the carried wheel'}", file=sys.stderr)
    if not ok:
        print(name)
EOF
) || exit 3
for name in $needed; do
    wheel=$(ls .whl/ifneeded/"$name"-*.whl 2>/dev/null | head -1)
    if [ -z "$wheel" ]; then
        echo "gpu_check.sh: no wheel for $name in .whl/ifneeded/" >&2
        exit 3
    fi
    install "$wheel" || exit 3
done
export PYTHONPATH="$SITE:$PWD"
python3 -c "import elastic.cli, runtime.worker.worker_process" || { echo "gpu_check.sh: this project does not import" >&2; exit 3; }
python3 scripts/gpu_check.py "$@"
