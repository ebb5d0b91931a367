#!/usr/bin/env bash
# Regenerates the Python code for proto/radixmesh/v1/*.proto (the services' contracts) and
# proto/radixmesh/envoy/*.proto (the wire-compatible part of Envoy's ext_proc that the router's endpoint
# picker speaks) into services/radixmesh/protocol/ (imported as radixmesh.protocol): messages, gRPC stubs
# and mypy stubs.
#   bash scripts/gen_proto.sh            write into services/radixmesh/protocol/
#   bash scripts/gen_proto.sh OUT_DIR    write into OUT_DIR (the staleness test compares the two)
# Needs grpcio-tools and mypy-protobuf at the versions pinned in the `test` extra (their versions
# are written into the generated files).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-$root/services/radixmesh/protocol}"
py="${PYTHON:-$root/.venv/bin/python}"
[ -x "$py" ] || py=python3
plugin_dir="$(dirname "$(command -v "$py")")"
export PATH="$plugin_dir:$PATH"   # protoc-gen-mypy and protoc-gen-mypy_grpc live next to python

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
cd "$root/proto"
"$py" -m grpc_tools.protoc -I. \
  --python_out="$tmp" --grpc_python_out="$tmp" --mypy_out="$tmp" --mypy_grpc_out="$tmp" \
  radixmesh/v1/*.proto radixmesh/envoy/*.proto 2>"$tmp/protoc.log" || { cat "$tmp/protoc.log" >&2; exit 1; }
for proto in radixmesh/v1/*.proto radixmesh/envoy/*.proto; do   # no gRPC stubs for files without a service
  grep -q '^service ' "$proto" || rm -f "$tmp/${proto%.proto}_pb2_grpc.py" "$tmp/${proto%.proto}_pb2_grpc.pyi"
done

mkdir -p "$out"
rm -f "$out"/*_pb2.py "$out"/*_pb2.pyi "$out"/*_pb2_grpc.py "$out"/*_pb2_grpc.pyi
for f in "$tmp"/radixmesh/v1/* "$tmp"/radixmesh/envoy/*; do
  # protoc writes imports as `radixmesh.v1.X_pb2`; the package lives at radixmesh.protocol
  sed -e 's/^from radixmesh\.v1 import /from radixmesh.protocol import /' \
      -e 's/^import radixmesh\.v1\.\([a-z_0-9]*\)$/import radixmesh.protocol.\1/' \
      -e 's/radixmesh\.v1\.\([a-z_0-9]*_pb2\)\b/radixmesh.protocol.\1/g' \
      "$f" > "$out/$(basename "$f")"
done
