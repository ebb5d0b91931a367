"""What the MoE layers of one model share: kernel workspaces, the expert-load counter and the dispatch settings.

Workspaces: one for batches up to the largest CUDA-graph batch, allocated at its first use (the graph runner's
warm-up passes, before any capture) and never replaced, since captured graphs keep its addresses; and one for
larger eager passes (prefill chunks), grown to the next power of two when a pass needs more. Layers run one after
the other on one stream, so they share both.

Expert load: an int64 counter per expert, on the device, that the routing adds every layer's assignments to
(inside its own launch on CUDA). Under expert parallelism every rank routes the same tokens (all-reduce dispatch)
or gathers every rank's counts (all-to-all), so rank 0's counter holds the whole model's load; each rank's share
is the sum over its experts. Read without stopping the device: `snapshot` copies it out asynchronously and returns
the copy started at the call before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from radixmesh.common.env import moe_path

if TYPE_CHECKING:
    from radixmesh.engine.models.moe_spec import ExpertLayout
    from radixmesh.kernels.moe import MoeWorkspace
    from radixmesh.kernels.moe_block import MoeBlockWorkspace

MOE_DISPATCHES = ("all-reduce", "all-to-all", "auto")
BLOCK_BY_DEFAULT = False
"""Whether `RADIXMESH_MOE_PATH=auto` (the default) runs one-token passes through the whole-block kernel too."""


class MoeRuntime:
    """Shared state of a model's MoE layers (see the module docstring)."""

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts
        self.dispatch = "all-reduce"
        """all-reduce | all-to-all | auto (all-to-all from `a2a_min_tokens` tokens up); graphs use all-reduce."""
        self.a2a_min_tokens = 1024
        self.graph_max_tokens = 512
        """Batches up to this many tokens use the workspace graphs may capture."""
        path = moe_path()
        self.block_kernel = path == "block" or (path == "auto" and BLOCK_BY_DEFAULT)
        """A one-token pass runs its whole MoE block (post-attention norm, router, top-k, experts) in one persistent
        kernel where it can (`kernels.moe_block`; RADIXMESH_MOE_PATH=block)."""
        self.path = "auto" if path == "block" else path
        """How `fused_moe` runs the experts (`kernels.moe.MOE_PATHS`): auto | small | sorted (RADIXMESH_MOE_PATH)."""
        self.use_kernels: bool | None = None
        """None: the Triton kernels on CUDA, the PyTorch reference elsewhere; True: the kernels everywhere (on the
        CPU under TRITON_INTERPRET=1: tests); False: the reference everywhere."""
        self.expert_load: torch.Tensor | None = None  # [E] int64 on the model's device
        self._workspaces: dict[tuple[object, ...], MoeWorkspace] = {}
        self._block_workspaces: dict[tuple[object, ...], MoeBlockWorkspace] = {}
        self._pending: tuple[torch.Tensor, torch.cuda.Event | None] | None = None
        self._last: list[int] = [0] * num_experts

    def configure(self, dispatch: str, a2a_min_tokens: int, graph_max_tokens: int) -> None:
        assert dispatch in MOE_DISPATCHES, f"dispatch must be one of {MOE_DISPATCHES}, got {dispatch!r}"
        self.dispatch, self.a2a_min_tokens = dispatch, a2a_min_tokens
        self.graph_max_tokens = max(graph_max_tokens, 1)

    def use_all_to_all(self, layout: ExpertLayout, x: torch.Tensor, num_tokens: int | None = None) -> bool:
        """Whether this pass dispatches by all-to-all: expert-parallel, asked for (or auto at this size: `num_tokens`,
        else the rows of `x`), and not inside a CUDA-graph capture (its split sizes come from the host)."""
        if not layout.expert_parallel or self.dispatch == "all-reduce":
            return False
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return False
        return self.dispatch == "all-to-all" or (x.shape[0] if num_tokens is None else num_tokens) >= \
            self.a2a_min_tokens

    def kernels_for(self, x: torch.Tensor) -> bool:
        """Whether the layers run the Triton kernels on `x` (see `use_kernels`)."""
        return x.is_cuda if self.use_kernels is None else self.use_kernels

    # ---- workspaces ----------------------------------------------------------------------------
    def workspace(self, num_tokens: int, top_k: int, layout: ExpertLayout, hidden: int, dtype: torch.dtype,
                  fp8_dtype: torch.dtype | None, device: torch.device) -> MoeWorkspace:
        """A workspace for `num_tokens` tokens of a layer of this shape (see the module docstring)."""
        from radixmesh.kernels.moe import MoeWorkspace
        from radixmesh.kernels.moe_config import TUNED

        small = num_tokens <= self.graph_max_tokens
        key = (small, top_k, layout.num_local, layout.inter_local, hidden, dtype, fp8_dtype, device)
        ws = self._workspaces.get(key)
        if ws is not None and ws.y.shape[0] >= num_tokens * top_k:
            return ws
        rows = self.graph_max_tokens if small else 1 << (num_tokens - 1).bit_length()
        max_block_m = max([128, *(cfg.block_m for cfg in TUNED.values())])
        ws = MoeWorkspace.allocate(rows, top_k, layout.num_experts, layout.num_local, hidden, layout.inter_local,
                                   dtype, device, max_block_m, fp8_dtype)
        self._workspaces[key] = ws
        return ws

    def block_workspace(self, top_k: int, layout: ExpertLayout, hidden: int, dtype: torch.dtype,
                        device: torch.device) -> MoeBlockWorkspace:
        """The whole-block kernel's buffers (its barrier counters start at 0 and every launch leaves them at 0, so
        the layers share one), made at the first call: before any capture (`SparseMoeBlock.prepare_runtime`)."""
        from radixmesh.kernels.moe_block import MoeBlockWorkspace

        key = (top_k, layout.num_experts, layout.inter_local, hidden, dtype, device)
        ws = self._block_workspaces.get(key)
        if ws is None:
            ws = MoeBlockWorkspace.allocate(layout.num_experts, top_k, layout.inter_local, hidden, dtype, device)
            self._block_workspaces[key] = ws
        return ws

    # ---- expert load ---------------------------------------------------------------------------
    def load_counter(self, device: torch.device) -> torch.Tensor:
        """The per-expert assignment counter `[E]` int64 on `device` (made at the first call)."""
        if self.expert_load is None:
            self.expert_load = torch.zeros(self.num_experts, dtype=torch.int64, device=device)
        return self.expert_load

    def count(self, topk_ids: torch.Tensor) -> None:
        """Add the assignments `topk_ids` `[tokens, top_k]` to the counter (the PyTorch path)."""
        counter = self.load_counter(topk_ids.device)
        ids = topk_ids.reshape(-1).long()
        counter.index_add_(0, ids, torch.ones_like(ids))

    def add_counts(self, counts: torch.Tensor) -> None:
        """Add per-expert counts `[E]` (all-to-all dispatch: every rank's, gathered)."""
        self.load_counter(counts.device).add_(counts.to(torch.int64))

    def snapshot(self) -> list[int]:
        """Assignments per expert so far (as of the previous call on CUDA: the copy is not waited for)."""
        counter = self.expert_load
        if counter is None:
            return list(self._last)
        if not counter.is_cuda:
            return [int(v) for v in counter.tolist()]
        if self._pending is not None and self._pending[1] is not None and self._pending[1].query():
            self._last = [int(v) for v in self._pending[0].tolist()]
            self._pending = None
        if self._pending is None:
            host = torch.empty(counter.shape, dtype=counter.dtype, pin_memory=True)
            host.copy_(counter, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._pending = (host, event)
        return list(self._last)
