#!/usr/bin/env bash
# Installs the Debian packages the test suite needs when they are missing:
# chromium (renders the HTML report headless) and openssl (makes a TLS test
# certificate). Needs root (or sudo) only when something is missing.
set -euo pipefail
missing=()
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v openssl >/dev/null 2>&1 || missing+=(openssl)
((${#missing[@]})) || exit 0
echo "installing Debian packages: ${missing[*]}" >&2
as_root=()
if [[ $(id -u) -ne 0 ]]; then
  command -v sudo >/dev/null 2>&1 || { echo "need root to install ${missing[*]} (apt-get)" >&2; exit 1; }
  as_root=(sudo)
fi
"${as_root[@]}" apt-get update -qq
DEBIAN_FRONTEND=noninteractive "${as_root[@]}" apt-get install -y -qq "${missing[@]}" >/dev/null
