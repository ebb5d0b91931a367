#!/usr/bin/env bash
# Install radixmesh with its test tools and run lint, type checks and the test suite.
#   scripts/test.sh                 everything that runs here (GPU tests skip without CUDA)
#   scripts/test.sh -m "not slow"   extra arguments go to pytest
#   scripts/test.sh -n 0            in one process (default: RADIXMESH_TEST_WORKERS pytest-xdist workers, one per
#                                   core up to 4; tests/xdist_scheduling.py says how they share the suite)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test
export PATH="$PWD/.venv/bin:$PATH"
echo "== ruff"; ruff check services kernels tests loadtests
echo "== mypy"; mypy services kernels loadtests
echo "== pytest"
# the pytest process runs models in-process too: the CPU malloc settings the engine gives its own processes
eval "$(python -c 'from radixmesh.engine.malloc_env import CPU_MALLOC_ENV as e; print(" ".join(f"export {k}={v}" for k, v in e.items()))')"
set +e
cores=$(nproc)
workers=${RADIXMESH_TEST_WORKERS:-$(( cores < 4 ? cores : 4 ))}
python -m pytest -q -n "$workers" "$@"
rc=$?
set -e
if [ $rc -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi
exit $rc
