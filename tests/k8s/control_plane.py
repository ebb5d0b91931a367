"""A real Kubernetes control plane on 127.0.0.1 for the k8s tests.

`ControlPlane.start()` makes a CA, a serving certificate, a service-account key and an admin token, then
starts etcd, kube-apiserver (RBAC on), kube-controller-manager, kube-scheduler and kwok on free ports of
127.0.0.1, writes an admin kubeconfig, waits for /readyz and creates kwok's fake Node. kwok stands in for the
kubelet: pods bound to its nodes go Running and Ready at once with an IP from POD_CIDR; no container runs and
no image is pulled. `stop()` ends every process it started, by PID, and removes the working directory.

    python -m tests.k8s.control_plane [--hold]      start one, print the times and the kubeconfig, stop
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import ssl
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.k8s import nodes
from tests.k8s.binaries import Binaries, find_binaries
from tests.k8s.pki import SERVICE_CIDR, Pki, kubeconfig_text, make_pki
from tests.k8s.processes import Child, start
from tests.ports import free_port

POD_CIDR = "10.244.0.0/24"
"""Pod IPs kwok hands out. They are names only: nothing in the tests sends a packet to them."""
READY_TIMEOUT_S = 60.0


class ControlPlaneError(RuntimeError):
    """A process of the control plane failed to start or exited."""


@dataclass
class ControlPlane:
    """A running control plane: where its API server is and how to reach it as admin."""

    binaries: Binaries
    workdir: Path
    pki: Pki | None = None
    server: str = ""
    """https://127.0.0.1:<port> of the API server."""
    kubeconfig: Path = Path()
    """Admin kubeconfig (user admin, group system:masters)."""
    children: list[Child] = field(default_factory=list)
    timings_s: dict[str, float] = field(default_factory=dict)
    """Seconds of each start-up phase (pki, ready, node) and in all (total)."""

    @classmethod
    def start(cls, binaries: Binaries | None = None, workdir: Path | None = None) -> ControlPlane:
        """Start everything; on any failure, stop what was started and raise."""
        plane = cls(binaries or find_binaries(),
                    workdir or Path(tempfile.mkdtemp(prefix="radixmesh-k8s-")))
        try:
            plane._start()
        except BaseException:
            plane.stop()
            raise
        return plane

    @property
    def admin_token(self) -> str:
        assert self.pki is not None, "control plane not started"
        return self.pki.admin_token

    @property
    def ca_file(self) -> str:
        assert self.pki is not None, "control plane not started"
        return self.pki.ca_cert

    def api_client(self, token: str | None = None) -> Any:
        """A `kubernetes.client.ApiClient` for the API server, as admin or with `token`."""
        from kubernetes import client

        configuration = client.Configuration()
        configuration.host = self.server
        configuration.ssl_ca_cert = self.ca_file
        configuration.api_key = {"authorization": f"Bearer {token or self.admin_token}"}
        return client.ApiClient(configuration)

    def write_kubeconfig(self, path: Path, token: str, namespace: str = "default") -> Path:
        """A kubeconfig for this API server with `token` (e.g. a service account's)."""
        path.write_text(kubeconfig_text(self.server, self.ca_file, token, namespace))
        path.chmod(0o600)
        return path

    def stop(self) -> None:
        """Stop every started process by PID (last started first), then remove the working directory."""
        for child in reversed(self.children):
            child.stop()
        self.children.clear()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def check_running(self) -> None:
        """Raise with the log of any process that exited."""
        for child in self.children:
            if not child.running():
                raise ControlPlaneError(f"{child.name} (pid {child.pid}) exited with {child.proc.returncode}:\n"
                                        f"{child.log_tail()}")

    def _start(self) -> None:
        started = time.monotonic()
        self.pki = make_pki(self.workdir / "pki")
        self.timings_s["pki"] = time.monotonic() - started
        etcd_url = self._start_etcd()
        api_port = free_port()
        self.server = f"https://127.0.0.1:{api_port}"
        self.kubeconfig = self.write_kubeconfig(self.workdir / "admin.kubeconfig", self.admin_token)
        self._start_apiserver(api_port, etcd_url)
        self._wait_ready()
        self.timings_s["ready"] = time.monotonic() - started
        self._start_controllers()
        nodes.create_kwok_node(self.api_client(), nodes.DEFAULT_NODE)
        nodes.wait_nodes_ready(self.api_client(), [nodes.DEFAULT_NODE.name], self.check_running)
        self.timings_s["total"] = time.monotonic() - started

    def _spawn(self, name: str, argv: list[str]) -> None:
        self.children.append(start(name, argv, self.workdir / "logs", cwd=self.workdir))

    def _start_etcd(self) -> str:
        client, peer, metrics = free_port(), free_port(), free_port()
        url = f"http://127.0.0.1:{client}"
        self._spawn("etcd", [
            self.binaries.etcd, "--name=test", f"--data-dir={self.workdir / 'etcd'}",
            f"--listen-client-urls={url}", f"--advertise-client-urls={url}",
            f"--listen-peer-urls=http://127.0.0.1:{peer}", f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-cluster=test=http://127.0.0.1:{peer}", f"--listen-metrics-urls=http://127.0.0.1:{metrics}",
            "--unsafe-no-fsync", "--log-level=warn"])
        return url

    def _start_apiserver(self, port: int, etcd_url: str) -> None:
        pki = self.pki
        assert pki is not None
        self._spawn("kube-apiserver", [
            self.binaries.kube_apiserver, f"--etcd-servers={etcd_url}", "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1", f"--secure-port={port}",
            # the endpoint reconciler refuses a loopback advertise address: the kubernetes Service gets none
            "--endpoint-reconciler-type=none",
            f"--tls-cert-file={pki.apiserver_cert}", f"--tls-private-key-file={pki.apiserver_key}",
            f"--client-ca-file={pki.ca_cert}", f"--token-auth-file={pki.tokens_csv}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={pki.sa_pub}", f"--service-account-signing-key-file={pki.sa_key}",
            "--authorization-mode=Node,RBAC", f"--service-cluster-ip-range={SERVICE_CIDR}",
            f"--cert-dir={self.workdir / 'apiserver-certs'}", "--profiling=false", "--v=1"])

    def _start_controllers(self) -> None:
        pki = self.pki
        assert pki is not None
        kc = str(self.kubeconfig)
        auth = [f"--kubeconfig={kc}", f"--authentication-kubeconfig={kc}", f"--authorization-kubeconfig={kc}",
                "--bind-address=127.0.0.1", "--leader-elect=false", "--profiling=false"]
        self._spawn("kube-controller-manager", [
            self.binaries.kube_controller_manager, *auth, f"--secure-port={free_port()}",
            f"--service-account-private-key-file={pki.sa_key}", f"--root-ca-file={pki.ca_cert}",
            f"--cluster-signing-cert-file={pki.ca_cert}", f"--cluster-signing-key-file={pki.ca_key}",
            "--controllers=*", f"--service-cluster-ip-range={SERVICE_CIDR}", "--v=1"])
        self._spawn("kube-scheduler", [self.binaries.kube_scheduler, *auth, f"--secure-port={free_port()}", "--v=1"])
        self._spawn("kwok", [
            self.binaries.kwok, f"--kubeconfig={kc}", f"--config={self.binaries.kwok_stages}",
            "--manage-all-nodes=false", f"--manage-nodes-with-annotation-selector={nodes.KWOK_ANNOTATION}=fake",
            # nodes renew a Lease, as kubelets do: without it (kwok's default here) only the rare status
            # heartbeats keep a node Ready, it turns Unknown now and then and its pods not-Ready
            "--node-lease-duration-seconds=40", f"--cidr={POD_CIDR}", "--node-ip=10.244.255.1"])

    def _wait_ready(self) -> None:
        """Poll /readyz until 200, failing early if a process exits."""
        assert self.pki is not None
        context = ssl.create_default_context(cafile=self.pki.ca_cert)
        request = urllib.request.Request(f"{self.server}/readyz",
                                         headers={"Authorization": f"Bearer {self.admin_token}"})
        deadline = time.monotonic() + READY_TIMEOUT_S
        last = ""
        while time.monotonic() < deadline:
            self.check_running()
            try:
                with urllib.request.urlopen(request, timeout=2, context=context) as response:
                    if response.status == 200:
                        return
            except OSError as exc:  # refused while starting, 500 while post-start hooks run
                last = str(exc)
            time.sleep(0.1)
        logs = "\n".join(f"--- {c.name}\n{c.log_tail(1500)}" for c in self.children)
        raise ControlPlaneError(f"kube-apiserver not ready after {READY_TIMEOUT_S:.0f} s ({last}):\n{logs}")


def main() -> int:
    parser = argparse.ArgumentParser(description="Start the k8s tests' control plane, print its start-up times.")
    parser.add_argument("--hold", action="store_true", help="keep it running until Enter (or Ctrl-C)")
    args = parser.parse_args()
    plane = ControlPlane.start()
    try:
        print(" ".join(f"{k}={v:.2f}s" for k, v in plane.timings_s.items()))
        print(f"KUBECONFIG={plane.kubeconfig}")
        if args.hold:
            with contextlib.suppress(KeyboardInterrupt, EOFError):
                input("running; Enter stops it\n")
    finally:
        plane.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
