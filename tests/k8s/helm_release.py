"""helm against the test control plane: install, upgrade, rollback and uninstall of the chart, timed."""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.helm.chart import CHART

WAIT_TIMEOUT = "120s"
"""helm --wait's limit: kwok runs pods at once, so a release that is not ready by then never will be."""


@dataclass
class Helm:
    """The helm binary with a kubeconfig; every call is timed into `timings_s` (command -> seconds)."""

    binary: str
    kubeconfig: Path
    kubectl: str = ""
    """kubectl, to show the namespace's workloads and events when a command fails ("": not shown)."""
    timings_s: dict[str, float] = field(default_factory=dict)
    api_warnings: list[str] = field(default_factory=list)
    """Warnings the API server sent back (deprecated APIs, unknown or duplicate fields), as helm printed them."""

    def run(self, *args: str, timeout_s: float = 180.0) -> str:
        started = time.monotonic()
        proc = subprocess.run([self.binary, f"--kubeconfig={self.kubeconfig}", *args], capture_output=True,
                              text=True, timeout=timeout_s, check=False)
        self.timings_s[" ".join(args[:2])] = time.monotonic() - started
        self.api_warnings += [line for line in proc.stderr.splitlines()
                              if "warnings.go" in line or line.startswith("Warning:")]
        if proc.returncode != 0:
            namespace = args[args.index("-n") + 1] if "-n" in args else "default"
            raise AssertionError(f"helm {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}\n"
                                 f"{self._describe(namespace)}")
        return proc.stdout

    def _describe(self, namespace: str) -> str:
        if not self.kubectl:
            return ""
        base = [self.kubectl, f"--kubeconfig={self.kubeconfig}", "-n", namespace]
        shown = []
        for what in (["get", "deployments,replicasets,pods", "-o", "wide"],
                     ["get", "events", "--sort-by=.lastTimestamp"]):
            proc = subprocess.run([*base, *what], capture_output=True, text=True, timeout=30, check=False)
            shown.append(f"$ kubectl {' '.join(what)}\n{proc.stdout[-6000:]}{proc.stderr[-1000:]}")
        return "\n".join(shown)

    def install(self, release: str, namespace: str, values: list[Path] | None = None,
                sets: list[str] | None = None) -> str:
        """`helm install --wait`: returns once every Deployment is available (kwok runs the pods)."""
        return self.run("install", release, str(CHART), "-n", namespace, "--wait", "--timeout", WAIT_TIMEOUT,
                        *_values_args(values, sets))

    def upgrade(self, release: str, namespace: str, values: list[Path] | None = None,
                sets: list[str] | None = None) -> str:
        return self.run("upgrade", release, str(CHART), "-n", namespace, "--wait", "--timeout", WAIT_TIMEOUT,
                        *_values_args(values, sets))

    def rollback(self, release: str, namespace: str, revision: int) -> str:
        return self.run("rollback", release, str(revision), "-n", namespace, "--wait", "--timeout", WAIT_TIMEOUT)

    def uninstall(self, release: str, namespace: str) -> str:
        return self.run("uninstall", release, "-n", namespace, "--wait", "--timeout", WAIT_TIMEOUT)

    def history(self, release: str, namespace: str) -> list[dict[str, Any]]:
        return list(json.loads(self.run("history", release, "-n", namespace, "-o", "json")))

    def manifest(self, release: str, namespace: str) -> str:
        return self.run("get", "manifest", release, "-n", namespace)


def _values_args(values: list[Path] | None, sets: list[str] | None) -> list[str]:
    args: list[str] = []
    for path in values or []:
        args += ["-f", str(path)]
    for item in sets or []:
        args += ["--set", item]
    return args
