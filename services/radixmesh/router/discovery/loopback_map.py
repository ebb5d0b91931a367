"""A test hook of Kubernetes discovery: pods whose IPs cannot be reached, dialled on loopback ports instead.

On kwok's fake nodes (tests/k8s) a pod's IP is only a name: no container runs behind it, and an
EndpointSlice may not hold a loopback address. The tests start a real worker process per pod on
127.0.0.1 and set RADIXMESH_TEST_POD_LOOPBACK_MAP to a JSON file

    {"pod_cidr": "10.244.0.0/24", "base_port": 41000}

so that the pod at the n-th address of pod_cidr is dialled at 127.0.0.1:(base_port + n), whatever its IP and
port annotation say. A pod outside pod_cidr is left out, never dialled. A rule rather than a list of IPs:
a pod's IP is known only once it exists, and the router must find its worker the moment it is Ready.
Off unless the variable is set (never in a real deployment).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from radixmesh.common.env import env_str
from radixmesh.common.errors import invalid_argument
from radixmesh.router.discovery.base import WorkerEndpoint

ENV_NAME = "TEST_POD_LOOPBACK_MAP"
"""RADIXMESH_TEST_POD_LOOPBACK_MAP: path of the JSON map; unset: the hook is off."""

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PodLoopbackMap:
    """Pod IPs in pod_cidr -> 127.0.0.1 ports from base_port on."""

    pod_cidr: str
    """Network of the pod IPs (IPv4), e.g. kwok's --cidr."""
    base_port: int
    """Port of the network's own address; the pod at offset n is at base_port + n."""

    def __post_init__(self) -> None:
        try:
            network = ipaddress.IPv4Network(self.pod_cidr)
        except ValueError as exc:
            raise invalid_argument(f"pod loopback map: pod_cidr {self.pod_cidr!r}: {exc}", "pod_cidr") from None
        if self.base_port < 1024 or self.base_port + network.num_addresses - 1 > 65535:
            raise invalid_argument(f"pod loopback map: ports {self.base_port}..+{network.num_addresses - 1} "
                                   f"must lie in [1024, 65535]", "base_port")

    def address_of(self, pod_ip: str) -> str | None:
        """127.0.0.1:port for a pod IP in pod_cidr, else None."""
        network = ipaddress.IPv4Network(self.pod_cidr)
        try:
            ip = ipaddress.ip_address(pod_ip)
        except ValueError:
            return None
        if ip.version != 4 or ip not in network:
            return None
        return f"127.0.0.1:{self.base_port + int(ip) - int(network.network_address)}"

    def apply(self, endpoint: WorkerEndpoint) -> WorkerEndpoint | None:
        """The endpoint dialled on loopback, or None (with a warning) when its IP is outside pod_cidr."""
        host = endpoint.address.rsplit(":", 1)[0].strip("[]")
        address = self.address_of(host)
        if address is None:
            logger.warning("pod %s: IP %s is outside the test loopback map's %s; left out", endpoint.worker_id,
                           host, self.pod_cidr)
            return None
        return dataclasses.replace(endpoint, address=address)


def load_pod_loopback_map(path: str) -> PodLoopbackMap:
    try:
        raw = json.loads(Path(path).read_text())
        return PodLoopbackMap(pod_cidr=str(raw["pod_cidr"]), base_port=int(raw["base_port"]))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise invalid_argument(f"RADIXMESH_{ENV_NAME}={path}: not a pod loopback map ({exc})") from None


def pod_loopback_map_from_env() -> PodLoopbackMap | None:
    """The map RADIXMESH_TEST_POD_LOOPBACK_MAP names, or None (the hook is off)."""
    path = env_str(ENV_NAME)
    if not path:
        return None
    loopback = load_pod_loopback_map(path)
    logger.warning("kubernetes discovery: TEST HOOK on (RADIXMESH_%s): pods in %s are dialled at 127.0.0.1 from "
                   "port %d", ENV_NAME, loopback.pod_cidr, loopback.base_port)
    return loopback
