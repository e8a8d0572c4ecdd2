#!/usr/bin/env bash
# Regenerates runtime/_proto/*_pb2*.py from runtime/protos/*.proto with the
# grpcio-tools of the current environment (pinned in pyproject's dev extra).
# Usage: scripts/gen_protos.sh [OUT_DIR]   (default: runtime/_proto)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-runtime/_proto}"
mkdir -p "$out"
python -m grpc_tools.protoc -I runtime/protos --python_out="$out" --grpc_python_out="$out" runtime/protos/elastic.proto
# grpc_tools emits an absolute import of the sibling module; make it package-relative.
sed -i 's/^import elastic_pb2 as elastic__pb2$/from . import elastic_pb2 as elastic__pb2/' "$out/elastic_pb2_grpc.py"
