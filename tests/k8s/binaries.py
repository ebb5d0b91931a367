"""Where the control plane's binaries are: next to this Python (scripts/install.sh test builds them into
.venv/bin with scripts/k8s/build.sh), else on PATH. A missing one is an error naming the install step."""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

KWOK_VERSION = "v0.8.0"
"""The kwok whose stage config scripts/k8s/build.sh writes (BIN/../share/kwok/stages-<version>.yaml)."""
NAMES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl", "kwok")


class MissingBinary(RuntimeError):
    """A control-plane binary or kwok's stage config is not installed."""


@dataclass(frozen=True)
class Binaries:
    """Paths of the control plane's executables and of kwok's stage config."""

    etcd: str
    kube_apiserver: str
    kube_controller_manager: str
    kube_scheduler: str
    kubectl: str
    kwok: str
    kwok_stages: str


def find_binary(name: str) -> str | None:
    """`name` next to this Python, else on PATH."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.is_file() else shutil.which(name)


def find_binaries() -> Binaries:
    """Every binary of the control plane, or MissingBinary naming what is missing and how to build it."""
    found = {name: find_binary(name) for name in NAMES}
    missing = [name for name, path in found.items() if path is None]
    hint = ("run `scripts/install.sh test` (it builds them from the Go module proxy into .venv/bin with "
            "scripts/k8s/build.sh, 12-14 minutes once)")
    if missing:
        raise MissingBinary(f"Kubernetes control plane binaries not found next to {sys.executable} or on PATH: "
                            f"{', '.join(missing)}: {hint}")
    kwok = Path(str(found["kwok"])).resolve()
    stages = kwok.parent.parent / "share" / "kwok" / f"stages-{KWOK_VERSION}.yaml"
    if not stages.is_file():
        raise MissingBinary(f"kwok's stage config {stages} not found: {hint}")
    return Binaries(etcd=str(found["etcd"]), kube_apiserver=str(found["kube-apiserver"]),
                    kube_controller_manager=str(found["kube-controller-manager"]),
                    kube_scheduler=str(found["kube-scheduler"]), kubectl=str(found["kubectl"]), kwok=str(kwok),
                    kwok_stages=str(stages))
