"""KV transports by kebab-case id (`radixmesh worker --kv-transport ID`); implementations import lazily.

`grpc` works anywhere (the KV bytes ride the workers' gRPC stream); `cuda-ipc` moves KV GPU to
GPU between processes of one host. An RDMA transport (NIXL, Mooncake) plugs in here: see
docs/disaggregation.md.
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
}, param="kv_transport")
KV_TRANSPORT_IDS = KV_TRANSPORTS.ids
CUDA_IPC_MODES = ("direct", "staging")
"""How cuda-ipc exports move KV (its `mode` option; `radixmesh bench kv-transfer --mode`): the decode GPU pulls
the rows out of the prefill pool, or copies a gathered staging buffer (see `transport.cuda_ipc`)."""


def check_transport_id(transport_id: str) -> None:
    KV_TRANSPORTS.check(transport_id)


def check_transport_device(transport_id: str, device_type: str) -> None:
    """UNSUPPORTED when the transport cannot move KV of a pool on `device_type` (cpu | cuda)."""
    check_transport_id(transport_id)
    supported = KV_TRANSPORTS.load(transport_id).device_types
    if device_type not in supported:
        raise unsupported(f"the {transport_id} KV transport needs the KV pool on {' or '.join(supported)}, "
                          f"not {device_type}", "kv_transport")


def create_transport(transport_id: str, pool: TokenToKVPool, **options: Any) -> BaseKVTransport:
    """The transport `transport_id` over `pool`; INVALID_ARGUMENT/UNSUPPORTED when it cannot run here.
    `options` go to its constructor (e.g. cuda-ipc's `mode`)."""
    check_transport_id(transport_id)
    transport: BaseKVTransport = KV_TRANSPORTS.create(transport_id, pool, **options)
    return transport
