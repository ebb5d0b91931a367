"""Small helpers of the k8s tests: waiting on the API server, kubectl, and what a release left behind."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
INSTANCE_LABEL = "app.kubernetes.io/instance"


def wait_for(probe: Callable[[], T | None], timeout_s: float, what: str, poll_s: float = 0.05) -> T:
    """Poll `probe` until it returns something truthy; AssertionError naming `what` after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(poll_s)


def kubectl(binary: str, kubeconfig: Path, *args: str, timeout_s: float = 60.0) -> str:
    """kubectl's stdout; AssertionError with its stderr when it fails."""
    proc = subprocess.run([binary, f"--kubeconfig={kubeconfig}", *args], capture_output=True, text=True,
                          timeout=timeout_s, check=False)
    assert proc.returncode == 0, f"kubectl {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}"
    return proc.stdout


def is_running_ready(pod: Any) -> bool:
    """Phase Running, condition Ready=True and an IP (what kwok's pod-ready stage sets)."""
    status = pod.status
    if status is None or status.phase != "Running" or not status.pod_ip:
        return False
    return any(c.type == "Ready" and c.status == "True" for c in status.conditions or [])


def running_pods(core: Any, namespace: str, selector: str) -> list[Any]:
    """Pods matching `selector` that are Running and Ready, not being deleted."""
    pods = core.list_namespaced_pod(namespace, label_selector=selector).items
    return [p for p in pods if is_running_ready(p) and p.metadata.deletion_timestamp is None]


def wait_running(core: Any, namespace: str, selector: str, count: int, timeout_s: float = 60.0) -> list[Any]:
    """Exactly `count` pods of `selector` Running and Ready (and no others left over)."""
    def probe() -> list[Any] | None:
        pods = core.list_namespaced_pod(namespace, label_selector=selector).items
        ready = [p for p in pods if is_running_ready(p) and p.metadata.deletion_timestamp is None]
        return ready if len(ready) == count == len(pods) else None

    return wait_for(probe, timeout_s, f"{count} running pods {selector} in {namespace}")


def listable_kinds(binary: str, kubeconfig: Path) -> list[str]:
    """Every resource type the API server can list (built-in, aggregated and CRDs), events left out."""
    names = kubectl(binary, kubeconfig, "api-resources", "--verbs=list", "-o", "name").split()
    return [n for n in names if n not in ("events", "events.events.k8s.io")]


def release_leftovers(binary: str, kubeconfig: Path, release: str) -> list[str]:
    """kind/name (with namespace) of every object, in any namespace, labelled with the release's instance, plus
    helm's own release records (Secrets owner=helm,name=<release>)."""
    kinds = ",".join(listable_kinds(binary, kubeconfig))
    found = kubectl(binary, kubeconfig, "get", kinds, "-A", "-l", f"{INSTANCE_LABEL}={release}",
                    "-o", "custom-columns=KIND:.kind,NS:.metadata.namespace,NAME:.metadata.name", "--no-headers")
    records = kubectl(binary, kubeconfig, "get", "secrets", "-A", "-l", f"owner=helm,name={release}", "-o", "name")
    return [line for line in (found + records).splitlines() if line.strip()]
