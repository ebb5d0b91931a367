"""The parts of the nixl transport around one READ: the staging buffer, the peers' agents, the read in flight.

`StagingBuffer`: one registered buffer per side, allocated once, handed out in regions per transfer (a
`SlotRing` of 4 KiB units). `RemoteAgents`: the prefill agents whose metadata this side loaded, the most
recent ones (a restarted worker is a new agent; an agent whose peer died is dropped). `PendingRead`: a READ
posted into the pool or into a staging region, polled by the reservation until the rows are in the pool.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from radixmesh.common.errors import ErrorCode, RadixMeshError
from radixmesh.engine.disagg.transport.base import PendingReceive
from radixmesh.engine.disagg.transport.slot_ring import SlotRing

logger = logging.getLogger(__name__)

STAGING_UNIT_BYTES = 4096
MAX_REMOTE_AGENTS = 32
"""Prefill agents whose metadata a decode side keeps loaded (the least recently used is dropped past this)."""


class StagingBuffer:
    """A registered byte buffer on the pool's device, handed out in regions keyed by transfer."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.num_units = max(nbytes // STAGING_UNIT_BYTES, 1)
        self.tensor = torch.empty(self.num_units * STAGING_UNIT_BYTES, dtype=torch.uint8, device=device)
        self.address = self.tensor.data_ptr()
        self._ring = SlotRing(self.num_units)

    @property
    def nbytes(self) -> int:
        return self.num_units * STAGING_UNIT_BYTES

    @property
    def num_regions(self) -> int:
        return len(self._ring)

    def allocate(self, key: str, nbytes: int) -> int | None:
        """Byte offset of a new region of at least `nbytes` for `key`; None when none is free."""
        units = max(-(-nbytes // STAGING_UNIT_BYTES), 1)
        offset = self._ring.allocate(key, units) if units <= self.num_units else None
        return None if offset is None else offset * STAGING_UNIT_BYTES

    def view(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = dtype.itemsize
        for size in shape:
            nbytes *= size
        return self.tensor[offset:offset + nbytes].view(dtype).view(shape)

    def free(self, key: str) -> None:
        self._ring.free(key)


class RemoteAgents:
    """The prefill agents this decode side can READ from, by name, most recently used last."""

    def __init__(self, agent: Any, max_agents: int = MAX_REMOTE_AGENTS) -> None:
        assert max_agents >= 1, f"max_agents must be at least 1, got {max_agents}"
        self.agent, self.max_agents = agent, max_agents
        self._names: OrderedDict[str, None] = OrderedDict()

    @property
    def names(self) -> list[str]:
        return list(self._names)

    def ensure(self, name: str, metadata: bytes) -> None:
        """Make `name` readable: load its metadata unless held; UNAVAILABLE when it is not held and none came."""
        if name in self._names:
            self._names.move_to_end(name)
            return
        if not metadata:
            raise RadixMeshError(ErrorCode.UNAVAILABLE, f"no NIXL metadata of {name} is held here and the chunk "
                                                        "carried none (the next transfer brings it)")
        try:
            loaded = self.agent.add_remote_agent(metadata)
        except Exception as exc:
            raise RadixMeshError(ErrorCode.UNAVAILABLE, f"NIXL could not load the metadata of {name}: {exc}") from exc
        loaded_name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if loaded_name != name:
            self._remove(loaded_name)
            raise RadixMeshError(ErrorCode.INVALID_ARGUMENT, f"the chunk names agent {name} but carries the metadata "
                                                             f"of {loaded_name}")
        self._names[name] = None
        while len(self._names) > self.max_agents:
            self._remove(next(iter(self._names)))

    def forget(self, name: str) -> None:
        """Drop an agent whose peer failed (a later chunk brings its metadata again if it still lives)."""
        if name in self._names:
            self._remove(name)

    def _remove(self, name: str) -> None:
        self._names.pop(name, None)
        try:
            self.agent.remove_remote_agent(name)
        except Exception as exc:  # already gone on NIXL's side: nothing left to drop
            logger.debug("NIXL: removing agent %s: %s", name, exc)


class PendingRead(PendingReceive):
    """One posted READ. Into the pool: done when NIXL says so. Into a staging region: then scattered into the
    slots (queued on the device; the region is freed once that ran, see `on_done`)."""

    def __init__(self, agent: Any, handle: Any, peer: str, lease_s: float | None,
                 on_done: Callable[[PendingRead], None], on_failed: Callable[[PendingRead, str], None]) -> None:
        self.agent, self.handle, self.peer, self.lease_s = agent, handle, peer, lease_s
        self._on_done, self._on_failed = on_done, on_failed
        self.state = "posted"
        """posted | done | failed | cancelled"""
        self.error = ""

    @property
    def is_open(self) -> bool:
        return self.state == "posted"

    def poll(self) -> bool:
        if self.state == "posted":
            self._check()
        if self.state == "failed":
            raise RadixMeshError(ErrorCode.UNAVAILABLE, self.error)
        return self.state == "done"

    def cancel(self) -> bool:
        if self.state != "posted":
            return True
        try:
            self.agent.release_xfer_handle(self.handle)
        except Exception as exc:  # still running and not abortable: the caller polls until it ends
            logger.debug("NIXL: a READ from %s could not be cancelled yet: %s", self.peer, exc)
            return False
        self.state = "cancelled"
        self._on_failed(self, "cancelled")
        return True

    def wait(self) -> None:
        """Block until it ends (benchmarks and `finish`); raises RadixMeshError when it failed."""
        while not self.poll():
            time.sleep(0)  # lets the other threads run (UCX's progress thread among them)

    def _check(self) -> None:
        try:
            status = self.agent.check_xfer_state(self.handle)
        except Exception as exc:  # the bindings raise on a disconnected peer (nixlRemoteDisconnectError, ...)
            status, detail = "ERR", f"{type(exc).__name__}: {exc}"
        else:
            detail = "the transfer failed"
        if status == "PROC":
            return
        if status == "DONE":
            self._release_handle()
            self.state = "done"
            self._on_done(self)
            return
        self._release_handle()
        self.state, self.error = "failed", f"the NIXL READ from {self.peer} failed ({detail})"
        self._on_failed(self, self.error)

    def _release_handle(self) -> None:
        try:
            self.agent.release_xfer_handle(self.handle)
        except Exception as exc:
            logger.debug("NIXL: releasing a finished READ's handle: %s", exc)
