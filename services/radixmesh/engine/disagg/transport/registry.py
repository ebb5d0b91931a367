"""KV transports by kebab-case id (`radixmesh worker --kv-transport ID`); implementations import lazily.

`grpc` works anywhere (the KV bytes ride the workers' gRPC stream); `cuda-ipc` moves KV GPU to
GPU between processes of one host; `nixl` READs it over NIXL/UCX (NVLink, RDMA or TCP; needs the
`radixmesh[nixl]` extra). `auto` is no transport of its own: each transfer picks one of these for
its pair of workers (`transport.choice`). See docs/disaggregation.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from radixmesh.common.errors import unsupported
from radixmesh.common.registry import LazyRegistry

if TYPE_CHECKING:
    from radixmesh.engine.disagg.transport.base import BaseKVTransport
    from radixmesh.engine.memory import TokenToKVPool

KV_TRANSPORTS: LazyRegistry[type[BaseKVTransport]] = LazyRegistry("KV transport", {
    "grpc": "radixmesh.engine.disagg.transport.inline:GrpcKVTransport",
    "cuda-ipc": "radixmesh.engine.disagg.transport.cuda_ipc:CudaIpcKVTransport",
    "nixl": "radixmesh.engine.disagg.transport.nixl:NixlKVTransport",
}, param="kv_transport")
KV_TRANSPORT_IDS = KV_TRANSPORTS.ids
AUTO = "auto"
KV_TRANSPORT_CHOICES = (AUTO, *KV_TRANSPORT_IDS)
"""What `--kv-transport` takes: a transport id, or auto (cuda-ipc on one host seeing both GPUs, else nixl when
installed, else grpc; chosen per pair of workers)."""
CUDA_IPC_MODES = ("direct", "staging")
"""How cuda-ipc exports move KV (its `mode` option; `radixmesh bench kv-transfer --mode`): the decode GPU pulls
the rows out of the prefill pool, or copies a gathered staging buffer (see `transport.cuda_ipc`)."""


def check_transport_id(transport_id: str, allow_auto: bool = True) -> None:
    """INVALID_ARGUMENT for an unknown id (auto passes when `allow_auto`)."""
    if not (allow_auto and transport_id == AUTO):
        KV_TRANSPORTS.check(transport_id)


def check_transport_device(transport_id: str, device_type: str) -> None:
    """UNSUPPORTED when the transport cannot move KV of a pool on `device_type` (cpu | cuda), or its library is
    missing (nixl: the error names the extra). auto always passes: it picks among what works."""
    check_transport_id(transport_id)
    if transport_id == AUTO:
        return
    supported = KV_TRANSPORTS.load(transport_id).device_types
    if device_type not in supported:
        raise unsupported(f"the {transport_id} KV transport needs the KV pool on {' or '.join(supported)}, "
                          f"not {device_type}", "kv_transport")
    if transport_id == "nixl":
        from radixmesh.engine.disagg.transport.nixl_lib import load_nixl

        load_nixl()


def describe_auto() -> str:
    """What auto resolves to on this machine, for the worker's log and server info."""
    from radixmesh.engine.disagg.transport.nixl_lib import nixl_available

    nixl = "nixl (installed)" if nixl_available() else "grpc (nixl is not installed: pip install 'radixmesh[nixl]')"
    return f"cuda-ipc with a worker on this host seeing each other's GPUs, else {nixl}"


def create_transport(transport_id: str, pool: TokenToKVPool, **options: Any) -> BaseKVTransport:
    """The transport `transport_id` over `pool`; INVALID_ARGUMENT/UNSUPPORTED when it cannot run here.
    `options` go to its constructor (e.g. cuda-ipc's `mode`)."""
    check_transport_id(transport_id, allow_auto=False)
    transport: BaseKVTransport = KV_TRANSPORTS.create(transport_id, pool, **options)
    return transport
