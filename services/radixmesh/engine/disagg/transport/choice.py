"""`--kv-transport auto`: which transport moves a prompt's KV between one prefill and one decode worker.

The choice is per pair of workers, made where the KV leaves: the receiving side (a decode worker, or a
worker fetching a prefix) describes itself in a `ReceiverInfo` (it rides in `PrefillStart.transport_params`,
put there by its scheduler when it granted the reservation), and the exporting side's scheduler compares it
with its own `LocalFacts`:

    cuda-ipc  both pools on CUDA, one host and IPC namespace, each process seeing the other's GPU;
    nixl      both have the NIXL library (any host; UCX picks NVLink, RDMA or TCP underneath);
    grpc      otherwise (the KV bytes in the gRPC call).

A worker started with a fixed transport uses that one whatever the peer asks. The chunks name the transport
they were exported with, and the receiving side lands each with that transport.
"""

from __future__ import annotations

import functools
import logging
import os
import socket

import msgspec

from radixmesh.engine.disagg.transport.registry import AUTO

logger = logging.getLogger(__name__)



class ReceiverInfo(msgspec.Struct, frozen=True):
    """What the receiving side of a transfer tells the exporting side (msgpack in `transport_params`)."""

    host_id: str = ""
    """The machine and IPC namespace (cuda-ipc works only within one)."""
    device_type: str = "cpu"
    """Where the receiving pool is: cpu | cuda."""
    gpu_uuids: list[str] = []
    """GPUs the receiving process sees, its own first (empty on CPU)."""
    has_nixl: bool = False
    """The NIXL library is installed there."""
    nixl_agents: list[str] = []
    """NIXL agents whose metadata the receiving side holds: an exporter among them sends none."""


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(ReceiverInfo)


def encode_receiver_info(info: ReceiverInfo) -> bytes:
    return _encoder.encode(info)


def decode_receiver_info(data: bytes) -> ReceiverInfo | None:
    """The peer's info; None when it sent none or something this version cannot read."""
    if not data:
        return None
    try:
        return _decoder.decode(data)
    except msgspec.DecodeError:  # ValidationError too: another version's fields
        logger.warning("ignoring unreadable transport_params (%d bytes) from a peer", len(data))
        return None


@functools.cache
def host_id() -> str:
    """This machine's boot id (hostname where unreadable) and this process's IPC namespace."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            machine = fh.read().strip()
    except OSError:
        machine = socket.gethostname()
    try:
        namespace = os.readlink("/proc/self/ns/ipc")
    except OSError:
        namespace = ""
    return f"{machine}/{namespace}"


def local_info(device_type: str, device_index: int | None = None, nixl_agents: list[str] | None = None
               ) -> ReceiverInfo:
    """This scheduler process described as a receiver (its pool on `device_type`, GPU `device_index`)."""
    from radixmesh.engine.disagg.transport.nixl_lib import nixl_available

    return ReceiverInfo(host_id(), device_type, _gpu_uuids(device_index) if device_type == "cuda" else [],
                        nixl_available(), list(nixl_agents or []))


def choose_transport(requested: str, receiver: ReceiverInfo | None, local: ReceiverInfo) -> tuple[str, str]:
    """(transport id, why) for an export asked for with `requested` (an id, or auto) to `receiver`."""
    if requested != AUTO:
        return requested, "asked for"
    if receiver is None:
        return "grpc", "the receiver did not describe itself"
    if (local.device_type == receiver.device_type == "cuda" and local.host_id == receiver.host_id
            and local.gpu_uuids and receiver.gpu_uuids and local.gpu_uuids[0] in receiver.gpu_uuids
            and receiver.gpu_uuids[0] in local.gpu_uuids):
        return "cuda-ipc", "one host, each side seeing the other's GPU"
    if local.has_nixl and receiver.has_nixl:
        why = "another host" if local.host_id != receiver.host_id else "GPUs not visible to each other"
        return "nixl", f"{why}; NIXL on both sides"
    missing = "here" if not local.has_nixl else "on the receiver"
    return "grpc", f"no cuda-ipc path and NIXL is not installed {missing}"


def _gpu_uuids(device_index: int | None) -> list[str]:
    import torch

    if not torch.cuda.is_available():
        return []
    own = torch.cuda.current_device() if device_index is None else device_index
    uuids = [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
    return [uuids[own], *(u for i, u in enumerate(uuids) if i != own)]
