"""LoRA adapters' descriptions between the engine's dicts (`LoraManager.info`, load results) and protobuf."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from radixmesh.protocol import common_pb2


def adapter_info_to_proto(info: Mapping[str, Any], worker_ids: list[str] | None = None) -> common_pb2.LoraAdapterInfo:
    """An adapter's dict (name, path, rank, targets) as a `LoraAdapterInfo`."""
    return common_pb2.LoraAdapterInfo(name=str(info["name"]), path=str(info.get("path") or ""),
                                      rank=int(info.get("rank", 0)), targets=list(info.get("targets") or ()),
                                      worker_ids=sorted(worker_ids or ()))


def adapter_info_from_proto(msg: common_pb2.LoraAdapterInfo) -> dict[str, Any]:
    """The dict shape of `/list_lora_adapters` (and of a single server's list), with `worker_ids` when known."""
    info: dict[str, Any] = {"name": msg.name, "path": msg.path, "rank": msg.rank, "targets": list(msg.targets)}
    if msg.worker_ids:
        info["worker_ids"] = list(msg.worker_ids)
    return info


def load_result_to_proto(name: str, info: Mapping[str, Any],
                         worker_ids: list[str] | None = None) -> common_pb2.LoadLoraAdapterResponse:
    return common_pb2.LoadLoraAdapterResponse(name=name, rank=int(info.get("rank", 0)),
                                              targets=list(info.get("targets") or ()),
                                              load_s=float(info.get("load_s", 0.0)),
                                              worker_ids=sorted(worker_ids or ()))


def load_result_from_proto(msg: common_pb2.LoadLoraAdapterResponse) -> dict[str, Any]:
    """The dict a load answers over HTTP (`/load_lora_adapter`), with `worker_ids` through a router."""
    info: dict[str, Any] = {"name": msg.name, "rank": msg.rank, "targets": list(msg.targets), "load_s": msg.load_s}
    if msg.worker_ids:
        info["worker_ids"] = list(msg.worker_ids)
    return info
