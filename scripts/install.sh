#!/usr/bin/env bash
# Installs radixmesh into ./.venv on a fresh Debian machine (Python 3.11+). Idempotent.
#   scripts/install.sh          runtime only
#   scripts/install.sh test     plus test tools, the nixl extra (its CPU tests run the real library) and the
#                               system packages the tests start
set -euo pipefail
cd "$(dirname "$0")/.."
want=${1:-run}

apt_install() {
  local missing=()
  for pkg in "$@"; do dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  local sudo=""; [ "$(id -u)" -ne 0 ] && sudo="sudo"
  echo "radixmesh: installing system packages: ${missing[*]}" >&2
  $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
}

python3 -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
  || { echo "radixmesh: needs Python >= 3.10 (found $(python3 --version))" >&2; exit 1; }
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv 2>/dev/null || { rm -rf .venv; apt_install python3-venv; python3 -m venv .venv; }
fi
py=.venv/bin/python
if [ "$want" = test ]; then
  apt_install redis-server  # the integration tests start a real Redis on 127.0.0.1
  spec=".[test,nixl]"
else
  spec="."
fi
stamp=".venv/.radixmesh-$want-$(cat pyproject.toml | sha256sum | cut -c1-16)"
free_gib() { df -Pk "$1" 2>/dev/null | awk 'NR==2 {print int($4 / 1048576)}'; }
if [ ! -f "$stamp" ]; then
  echo "radixmesh: installing Python packages into .venv (first time: torch is large, several minutes)" >&2
  # torch and its CUDA libraries: ~6.5 GB installed plus ~3.2 GB of downloaded wheels unpacked in the temporary
  # folder until pip finishes (measured: 9.3 GB at the peak). Unpack beside .venv when the temporary folder's disk
  # has under 4 GiB free and the checkout's more; say what is missing before pip runs out of room halfway.
  tmp=${TMPDIR:-/tmp}
  here=$(free_gib .); there=$(free_gib "$tmp")
  if [ -n "$here" ] && [ -n "$there" ] && [ "$there" -lt 4 ] && [ "$here" -gt "$there" ]; then
    mkdir -p .venv/.pip-tmp && tmp="$PWD/.venv/.pip-tmp"
    echo "radixmesh: ${TMPDIR:-/tmp} has ${there} GiB free: pip unpacks into $tmp" >&2
  fi
  need=7; [ "$(stat -c %d "$tmp")" = "$(stat -c %d .)" ] && need=10
  if [ -n "$here" ] && [ "$here" -lt "$need" ]; then
    echo "radixmesh: warning: $(df -Ph . | awk 'NR==2 {print $4}') free on the disk of $PWD; installing torch" \
      "with its CUDA libraries needs ~${need} GiB (pip stops with 'No space left on device' when it runs out)" >&2
  fi
  TMPDIR="$tmp" $py -m pip install -q --no-cache-dir --upgrade pip
  TMPDIR="$tmp" $py -m pip install -q --no-cache-dir -e "$spec"
  rm -rf .venv/.pip-tmp
  touch "$stamp"
fi

# The chart tests run a real helm. There is no Debian package: build it from the Go module proxy
# into .venv/bin once (a few minutes on 2 cores; the Go build cache makes rebuilds seconds).
# The ldflags are those of helm's own Makefile: version string and default Kubernetes version.
HELM_VERSION=v3.22.0
HELM_KUBE_MINOR=37
if [ "$want" = test ]; then
  if .venv/bin/helm version --short 2>/dev/null | grep -q "^$HELM_VERSION"; then
    :
  elif command -v go >/dev/null 2>&1; then
    echo "radixmesh: building helm $HELM_VERSION with go install (once, a few minutes)" >&2
    p=helm.sh/helm/v3
    GOBIN="$PWD/.venv/bin" GOFLAGS=-buildvcs=false go install -ldflags "-s -w \
      -X $p/internal/version.version=$HELM_VERSION \
      -X $p/pkg/chartutil.k8sVersionMajor=1 -X $p/pkg/chartutil.k8sVersionMinor=$HELM_KUBE_MINOR \
      -X $p/pkg/lint/rules.k8sVersionMajor=1 -X $p/pkg/lint/rules.k8sVersionMinor=$HELM_KUBE_MINOR" \
      "$p/cmd/helm@$HELM_VERSION"
  else
    echo "radixmesh: Go is not installed: cannot build helm $HELM_VERSION; the chart tests (tests/helm) will fail" >&2
  fi
  # The Gateway API Inference Extension at the version the chart's InferencePool follows: its CRDs (the chart
  # tests check the rendered pool against the CRD's schema). The Go module proxy serves exact versions only.
  if command -v go >/dev/null 2>&1; then
    GOFLAGS=-mod=mod go mod download sigs.k8s.io/gateway-api-inference-extension@v1.0.0 >/dev/null \
      || echo "radixmesh: could not download the inference extension's CRDs; one chart test will skip" >&2
  fi
  # The k8s tests (tests/k8s) start a real control plane: etcd, kube-apiserver, kube-controller-manager,
  # kube-scheduler and kwok (fake nodes), built from the Go module proxy into .venv/bin once (12-14 minutes
  # on 2 cores from empty Go caches; seconds when they are already there).
  if command -v go >/dev/null 2>&1; then
    bash scripts/k8s/build.sh "$PWD/.venv/bin"
  else
    echo "radixmesh: Go is not installed: cannot build the Kubernetes control plane; the k8s tests will fail" >&2
  fi
fi
