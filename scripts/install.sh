#!/usr/bin/env bash
# Installs radixmesh into ./.venv on a fresh Debian machine (Python 3.11+). Idempotent.
#   scripts/install.sh          runtime only
#   scripts/install.sh test     plus test tools and the system packages the tests start
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
  spec=".[test]"
else
  spec="."
fi
stamp=".venv/.radixmesh-$want-$(cat pyproject.toml | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  echo "radixmesh: installing Python packages into .venv (first time: torch is large, several minutes)" >&2
  $py -m pip install -q --upgrade pip
  $py -m pip install -q -e "$spec"
  touch "$stamp"
fi
