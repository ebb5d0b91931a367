"""`radixmesh bench kv-transfer --transport nixl`: the library's own ceiling on the link, beside the transport.

A bare NIXL READ moves the same number of bytes as one contiguous registered block from the sender's device to
the receiver's, with the same UCX settings (the processes' UCX_* environment) and no radixmesh code in the
way: two agents, one registration each, one descriptor, `initialize_xfer` + `transfer` + polling to DONE (what
a caller of NIXL's combined API pays per transfer). The transport's GB/s over this one's is how close the KV
transfer (descriptors of scattered rows, or gather + READ + scatter through staging) comes to the link.
"""

from __future__ import annotations

import os
import time
from typing import Any

import msgspec
import torch

from radixmesh.engine.disagg.transport.nixl_lib import load_nixl


class BareReadMsg(msgspec.Struct, tag="bare_read", frozen=True):
    """Sender -> receiver: READ `num_bytes` at `address` of agent `metadata`'s memory, `warmup + repeats` times."""

    metadata: bytes
    address: int
    num_bytes: int
    mem_type: str
    device_id: int
    warmup: int
    repeats: int


def _mem(device: torch.device) -> tuple[str, int]:
    return ("VRAM", device.index or 0) if device.type == "cuda" else ("DRAM", 0)


class BareSender:
    """The sender's block: registered once per size with its own agent."""

    def __init__(self, device: str) -> None:
        nixl = load_nixl()
        self.device = torch.device(device)
        self.agent = nixl.nixl_agent(f"bench-bare-sender-{os.getpid()}", nixl.nixl_agent_config(backends=["UCX"]))
        self._blocks: dict[int, tuple[torch.Tensor, Any]] = {}

    def message(self, num_bytes: int, warmup: int, repeats: int) -> BareReadMsg:
        if num_bytes not in self._blocks:
            block = torch.ones(num_bytes, dtype=torch.uint8, device=self.device)
            self._blocks[num_bytes] = (block, self.agent.register_memory([block]))
        block = self._blocks[num_bytes][0]
        mem_type, device_id = _mem(self.device)
        return BareReadMsg(self.agent.get_agent_metadata(), block.data_ptr(), num_bytes, mem_type, device_id,
                           max(warmup, 1), repeats)


class BareReceiver:
    """The receiver's side: its own agent, a block per size, the sender's agent loaded once."""

    def __init__(self, device: torch.device) -> None:
        nixl = load_nixl()
        self.device = device
        self.agent = nixl.nixl_agent(f"bench-bare-receiver-{os.getpid()}", nixl.nixl_agent_config(backends=["UCX"]))
        self._blocks: dict[int, torch.Tensor] = {}
        self._peers: dict[bytes, str] = {}

    def read(self, msg: BareReadMsg) -> list[float]:
        """Seconds of each timed READ (post to DONE)."""
        if msg.num_bytes not in self._blocks:
            self._blocks[msg.num_bytes] = torch.zeros(msg.num_bytes, dtype=torch.uint8, device=self.device)
            self.agent.register_memory([self._blocks[msg.num_bytes]])
        peer = self._peers.get(msg.metadata)
        if peer is None:
            loaded = self.agent.add_remote_agent(msg.metadata)
            peer = self._peers[msg.metadata] = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        block = self._blocks[msg.num_bytes]
        mem_type, device_id = _mem(self.device)
        local = self.agent.get_xfer_descs([(block.data_ptr(), msg.num_bytes, device_id)], mem_type)
        remote = self.agent.get_xfer_descs([(msg.address, msg.num_bytes, msg.device_id)], msg.mem_type)
        seconds = []
        for i in range(msg.warmup + msg.repeats):
            start = time.perf_counter()
            handle = self.agent.initialize_xfer("READ", local, remote, peer)
            status = self.agent.transfer(handle)
            while status == "PROC":
                status = self.agent.check_xfer_state(handle)
            elapsed = time.perf_counter() - start
            self.agent.release_xfer_handle(handle)
            if status != "DONE":
                raise RuntimeError(f"the bare NIXL READ of {msg.num_bytes} bytes failed ({status})")
            if i >= msg.warmup:
                seconds.append(elapsed)
        if not bool((block[:: max(msg.num_bytes // 4096, 1)] == 1).all()):
            raise RuntimeError("the bare NIXL READ did not bring the sender's bytes")
        return seconds
