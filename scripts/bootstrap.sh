#!/usr/bin/env bash
# Creates .venv (Python 3.12) and installs jax-elastic with its dev extras.
# Idempotent: re-installs only when pyproject.toml changed. Usage: scripts/bootstrap.sh
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

stamp=.venv/.jax-elastic-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ -x .venv/bin/python ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
py=$(find_python)
[ -x .venv/bin/python ] || "$py" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e '.[dev]'
echo "$want" > "$stamp"
