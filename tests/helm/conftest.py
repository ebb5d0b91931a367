"""The helm binary the chart tests run (a missing helm is a failure, not a skip)."""

from __future__ import annotations

import pytest

from .chart import find_helm, run_helm


@pytest.fixture(scope="session")
def helm() -> str:
    path = find_helm()
    if path is None:
        pytest.fail("helm not found (next to python or on PATH): run `scripts/install.sh test`, which builds it "
                    "with `go install helm.sh/helm/v3/cmd/helm@...` into .venv/bin")
    version = run_helm(path, "version", "--short")
    assert version.returncode == 0 and version.stdout.startswith("v3."), version
    return path
