"""The one-launch attention half of a decode token (`radixmesh.kernels.attn_block`) for one model's layers: whether
it runs (RADIXMESH_ATTN_BLOCK) and the workspace its layers share (they run one after another on one stream, and
every launch leaves the workspace's counters at 0). The workspace is made at the first call: the graph runner's
uncaptured warm-up passes, before any capture."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from radixmesh.common.env import attn_block_mode

if TYPE_CHECKING:
    from radixmesh.kernels.attn_block import AttnBlockConfig, AttnBlockWorkspace


class AttnBlockRuntime:
    def __init__(self) -> None:
        from radixmesh.kernels.attn_block import AttnBlockConfig

        self.config: AttnBlockConfig = AttnBlockConfig()
        self._workspaces: dict[tuple[object, ...], AttnBlockWorkspace] = {}

    @classmethod
    def from_env(cls) -> AttnBlockRuntime | None:
        """A runtime when RADIXMESH_ATTN_BLOCK=on, else None."""
        return cls() if attn_block_mode() == "on" else None

    def workspace(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                  device: torch.device) -> AttnBlockWorkspace:
        from radixmesh.kernels.attn_block import AttnBlockWorkspace

        key = (num_heads, num_kv_heads, head_dim, dtype, device)
        ws = self._workspaces.get(key)
        if ws is None:
            ws = AttnBlockWorkspace.allocate(num_heads, num_kv_heads, head_dim, self.config.num_splits, dtype, device)
            self._workspaces[key] = ws
        return ws
