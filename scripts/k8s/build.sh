#!/usr/bin/env bash
# Builds the Kubernetes control plane of the k8s tests (tests/k8s) from the Go module proxy, once:
#   kube-apiserver, kube-controller-manager, kube-scheduler, kubectl   k8s.io/kubernetes v1.37.2 (this go.mod)
#   etcd                                                             go.etcd.io/etcd/server/v3 v3.7.0 (cmd/etcd)
#   kwok (fake nodes: moves pods to Running with IPs, no containers)  sigs.k8s.io/kwok v0.8.0
# into BIN (default: .venv/bin), and kwok's stage config (from the kwok module's kustomize/stage files) into
# BIN/../share/kwok/stages.yaml. A binary already there at the right version is kept.
#   scripts/k8s/build.sh [BIN]
# From empty Go caches this takes about 12-14 minutes on 2 cores (the module cache grows by ~1.8 GB and the
# build cache by ~5 GB); with warm caches it only links (about 5 minutes on a busy 2-core machine).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bin=$(realpath -m "${1:-$here/../../.venv/bin}")
share=$(realpath -m "$bin/../share/kwok")
K8S_VERSION=v1.37.2
ETCD_VERSION=3.7.0
KWOK_VERSION=v0.8.0
export GOFLAGS="-p=1 -buildvcs=false" GOTOOLCHAIN=local
mkdir -p "$bin" "$share"

# Versions as the binaries report them (k8s's own build stamps them with -X; without it the API server
# reports v0.0.0-master, which breaks charts' kubeVersion checks).
has_version() {  # NAME PATTERN ARGS...
  local name=$1 pattern=$2; shift 2
  [ -x "$bin/$name" ] && "$bin/$name" "$@" 2>/dev/null | grep -q -- "$pattern"
}

timed() {  # NAME COMMAND...: run a build step, say how long it took
  local name=$1 start=$SECONDS; shift
  echo "radixmesh: building $name (once)" >&2
  nice -n 10 "$@"
  echo "radixmesh: built $name in $((SECONDS - start)) s" >&2
}

ld="-s -w"
for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  minor=${K8S_VERSION#v1.}; minor=${minor%%.*}
  ld="$ld -X $p.gitVersion=$K8S_VERSION -X $p.gitMajor=1 -X $p.gitMinor=$minor -X $p.gitTreeState=clean"
done

cd "$here"
for t in kube-apiserver kube-controller-manager kube-scheduler; do
  has_version "$t" "Kubernetes $K8S_VERSION\$" --version && continue
  timed "$t $K8S_VERSION" go build -trimpath -ldflags="$ld" -o "$bin/.$t.part" "k8s.io/kubernetes/cmd/$t"
  mv "$bin/.$t.part" "$bin/$t"
done
if ! has_version kubectl "Client Version: $K8S_VERSION\$" version --client; then
  timed "kubectl $K8S_VERSION" go build -trimpath -ldflags="$ld" -o "$bin/.kubectl.part" k8s.io/kubernetes/cmd/kubectl
  mv "$bin/.kubectl.part" "$bin/kubectl"
fi
if ! has_version etcd "etcd Version: $ETCD_VERSION\$" --version; then
  timed "etcd $ETCD_VERSION" go build -trimpath -ldflags="-s -w" -o "$bin/.etcd.part" ./cmd/etcd
  mv "$bin/.etcd.part" "$bin/etcd"
fi
# kwok has its own dependency versions: built from its module alone (go install ignores this go.mod).
if ! { [ -x "$bin/kwok" ] && go version -m "$bin/kwok" | grep -Eq "^\s+mod\s+sigs.k8s.io/kwok\s+$KWOK_VERSION\s"; }; then
  tmp=$(mktemp -d)
  timed "kwok $KWOK_VERSION" env GOBIN="$tmp" go install -trimpath -ldflags="-s -w" "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"
  mv "$tmp/kwok" "$bin/kwok"
  rmdir "$tmp"
fi

# kwok's stages (what it does to nodes and pods): nodes become Ready at once and renew their lease; pods go
# Running and Ready with an IP at once, finish (Jobs) and are removed when deleted.
stages="$share/stages-$KWOK_VERSION.yaml"
if [ ! -s "$stages" ]; then
  dir=$(go mod download -json "sigs.k8s.io/kwok@$KWOK_VERSION" | sed -n 's/^\s*"Dir": "\(.*\)",$/\1/p')
  [ -d "$dir/kustomize/stage" ] || { echo "radixmesh: kwok $KWOK_VERSION module has no kustomize/stage" >&2; exit 1; }
  s=$dir/kustomize/stage
  : > "$stages.part"
  for f in node/fast/node-initialize.yaml node/heartbeat-with-lease/node-heartbeat-with-lease.yaml \
           pod/fast/pod-ready.yaml pod/fast/pod-complete.yaml pod/fast/pod-delete.yaml; do
    { echo "---"; cat "$s/$f"; } >> "$stages.part"
  done
  mv "$stages.part" "$stages"
fi
