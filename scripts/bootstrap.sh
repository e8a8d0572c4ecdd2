#!/usr/bin/env bash
# Creates .venv (Python 3.12) and installs jax-elastic with its dev extras and the MaxText integration's
# requirements.
# Idempotent: re-installs only when pyproject.toml or those requirements changed. Usage: scripts/bootstrap.sh
set -euo pipefail
cd "$(dirname "$0")/.."

find_python() {
  if python3.12 -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
    echo python3.12; return
  fi
  # pyenv installs a 3.12 that its shim hides unless selected.
  if command -v pyenv >/dev/null 2>&1; then
    local v
    v=$(pyenv versions --bare 2>/dev/null | grep -E '^3\.12(\.|$)' | tail -n 1 || true)
    if [ -n "$v" ]; then echo "$(pyenv root)/versions/$v/bin/python3.12"; return; fi
  fi
  echo "bootstrap: no Python 3.12 found (install python3.12 and retry)" >&2
  exit 1
}

# This checkout's own modules, compiled once: every process of a run (client, zygote, workers) imports them, and
# where PYTHONDONTWRITEBYTECODE is set (or the checkout is read-only to the user) each would compile them again
# (about 1 s of CPU a process here). compileall writes only what changed since.
compile_checkout() {
  .venv/bin/python -m compileall -q -j 0 elastic runtime chaos integrations tests >/dev/null
}

stamp=.venv/.jax-elastic-installed
want=$(cat pyproject.toml integrations/maxtext/requirements.txt | sha256sum | cut -d' ' -f1)
if [ -x .venv/bin/python ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  compile_checkout
  exit 0
fi
py=$(find_python)
[ -x .venv/bin/python ] || "$py" -m venv .venv
# The packages are installed by uv (about 45 s here with their bytecode compiled, against about 110 s for pip,
# which unpacks the ~1.5 GB of wheels one file at a time); pip does it when uv cannot be had or fails. Both
# resolve the same versions. Compiled bytecode as pip leaves it: without it every process compiles what it
# imports where PYTHONDONTWRITEBYTECODE is set (importing JAX: 8 s of CPU instead of 3).
install() {
  if .venv/bin/python -m pip install --quiet uv 2>/dev/null && .venv/bin/python -m uv --version >/dev/null 2>&1; then
    if .venv/bin/python -m uv pip install --python .venv/bin/python --quiet --compile-bytecode "$@"; then
      return 0
    fi
    echo "bootstrap: uv could not install $*; trying pip" >&2
  fi
  .venv/bin/python -m pip install --quiet "$@"
}
install -e '.[dev]'
# MaxText 0.2.5 and exactly what it imports on CPU (docs/maxtext.md; its wheel declares no dependencies).
install --no-deps -r integrations/maxtext/requirements.txt
compile_checkout
echo "$want" > "$stamp"
