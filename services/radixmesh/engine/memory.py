"""KV memory: request rows, per-layer K/V buffers and the slot allocator (page size 1).

A KV *slot* is one token's K and V in every layer. Slots 1..size are handed out by
`KVSlotAllocator`; slot 0 is a dummy write target (padded batch entries write there)
and is never handed out. `ReqToTokenPool.req_to_token[row, pos]` is the slot that
holds position `pos` of the request that owns `row`.
"""

from __future__ import annotations

import torch


class ReqToTokenPool:
    """Rows of `req_to_token`, one per running request."""

    def __init__(self, size: int, max_context_len: int, device: str | torch.device) -> None:
        assert size > 0, f"ReqToTokenPool size must be positive, got {size}"
        assert max_context_len > 0, f"max_context_len must be positive, got {max_context_len}"
        self.size = size
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        # [size, max_context_len]
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int64, device=self.device)
        self._free_rows: list[int] = []
        self._is_free: list[bool] = []
        self.journal: list[tuple[int, int, torch.Tensor]] | None = None
        """`write`s since the last `drain_journal`, kept for tensor-parallel ranks to replay (None: not kept)."""
        self.clear()

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """`req_to_token[row, start:start + len(slots)] = slots`, recorded in the journal when one is kept."""
        if slots.shape[0] == 0:
            return
        self.req_to_token[row, start:start + slots.shape[0]] = slots
        if self.journal is not None:
            self.journal.append((row, start, slots))

    def drain_journal(self) -> list[tuple[int, int, torch.Tensor]]:
        """The journal's writes, oldest first, leaving it empty."""
        if self.journal is None:
            return []
        journal, self.journal = self.journal, []
        return journal

    def alloc(self, n: int = 1) -> list[int] | None:
        """Take `n` free rows; None (and nothing taken) when fewer than `n` are free."""
        assert n >= 0, f"cannot allocate {n} rows"
        if n > len(self._free_rows):
            return None
        rows, self._free_rows = self._free_rows[:n], self._free_rows[n:]
        for row in rows:
            self._is_free[row] = False
        return rows

    def free(self, idx: int | list[int]) -> None:
        """Return one row or a list of rows; freeing a row that is already free asserts."""
        rows = [idx] if isinstance(idx, int) else idx
        for row in rows:
            assert 0 <= row < self.size, f"row {row} out of range [0, {self.size})"
            assert not self._is_free[row], f"double free of req_to_token row {row}"
            self._is_free[row] = True
        self._free_rows.extend(rows)

    def available_size(self) -> int:
        """Number of free rows."""
        return len(self._free_rows)

    def clear(self) -> None:
        """Mark every row free."""
        self._free_rows = list(range(self.size))
        self._is_free = [True] * self.size


class TokenToKVPool:
    """Per-layer K and V buffers indexed by KV slot.

    An FP8 pool (`dtype` float8_e4m3fn / float8_e5m2) stores `fp8(k / k_scale)` and `fp8(v / v_scale)`,
    one scale per layer and tensor (1.0 unless the checkpoint carries KV scales); readers multiply back.
    """

    def __init__(
        self,
        size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device,
    ) -> None:
        assert size > 0, f"TokenToKVPool size must be positive, got {size}"
        assert num_layers > 0, f"num_layers must be positive, got {num_layers}"
        self._size = size
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (size + 1, num_kv_heads, head_dim)
        # each [size + 1, num_kv_heads, head_dim]. Zeroed: the dummy slot 0 must never hold NaN, and the
        # whole pool is resident from the start (on the CPU, untouched pages would otherwise be committed
        # one by one as slots are first written, so the process would grow for as long as the pool fills).
        self.k_buffers = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v_buffers = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.k_scales = [1.0] * num_layers
        self.v_scales = [1.0] * num_layers

    @property
    def is_fp8(self) -> bool:
        return self.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)

    def scales(self, layer_id: int) -> tuple[float, float]:
        """(k_scale, v_scale) of one layer: stored values times these are the K and V they stand for."""
        return self.k_scales[layer_id], self.v_scales[layer_id]

    def set_scales(self, scales: dict[int, dict[str, float]]) -> None:
        """Per-layer FP8 scales, e.g. a checkpoint's `{layer: {"k": .., "v": ..}}` (before any KV is stored)."""
        for layer, entry in scales.items():
            assert 0 <= layer < self.num_layers, f"KV scales for layer {layer} of a {self.num_layers}-layer pool"
            for kind, value in entry.items():
                assert value > 0, f"KV scale {kind} of layer {layer} must be > 0, got {value}"
                (self.k_scales if kind == "k" else self.v_scales)[layer] = float(value)

    @property
    def size(self) -> int:
        """Usable slots (1..size); the buffers have one more row for the dummy slot 0."""
        return self._size

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes of K plus V for one token across all layers."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * num_kv_heads * head_dim * itemsize

    def get_kv(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V buffers of one layer, each [size + 1, num_kv_heads, head_dim]."""
        return self.k_buffers[layer_id], self.v_buffers[layer_id]

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write K/V [num_tokens, num_kv_heads, head_dim] of one layer to slots `loc` [num_tokens]."""
        expected = (loc.shape[0], self.num_kv_heads, self.head_dim)
        assert loc.dim() == 1, f"loc must be 1-D, got shape {tuple(loc.shape)}"
        assert tuple(k.shape) == expected, f"k shape {tuple(k.shape)} != expected {expected}"
        assert tuple(v.shape) == expected, f"v shape {tuple(v.shape)} != expected {expected}"
        if self.is_fp8:
            from radixmesh.kernels.fp8_ref import quantize_scaled

            k_scale, v_scale = self.scales(layer_id)
            self.k_buffers[layer_id][loc] = quantize_scaled(k, 1.0 / k_scale, self.dtype)
            self.v_buffers[layer_id][loc] = quantize_scaled(v, 1.0 / v_scale, self.dtype)
            return
        self.k_buffers[layer_id][loc] = k.to(self.dtype)
        self.v_buffers[layer_id][loc] = v.to(self.dtype)

    def read(self, layer_id: int, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V `[len(slots), num_kv_heads, head_dim]` of one layer at `slots`, in `dtype` (dequantized)."""
        # index_select gathers whole rows; `buffer[slots]` takes the general indexing path (4x slower on the CPU)
        k = torch.index_select(self.k_buffers[layer_id], 0, slots)
        v = torch.index_select(self.v_buffers[layer_id], 0, slots)
        if not self.is_fp8:
            return k.to(dtype), v.to(dtype)
        k_scale, v_scale = self.scales(layer_id)
        return (k.float() * k_scale).to(dtype), (v.float() * v_scale).to(dtype)


class KVSlotAllocator:
    """Free list of KV slots 1..size.

    The free list is a tensor on the pool's device: alloc slices off its front and
    free concatenates, so neither needs a host round trip on GPU. With
    `check_double_free`, a host-side mask asserts that no slot is freed twice or
    freed while free (debugging only: it syncs with the device).
    """

    def __init__(self, size: int, device: str | torch.device, check_double_free: bool = False) -> None:
        assert size > 0, f"KVSlotAllocator size must be positive, got {size}"
        self.size = size
        self.device = torch.device(device)
        self.check_double_free = check_double_free
        self._free_slots = torch.empty(0, dtype=torch.int64, device=self.device)
        self._is_free_cpu: torch.Tensor | None = None
        self.clear()

    def alloc(self, n: int) -> torch.Tensor | None:
        """Take `n` slots as an int64 tensor [n] on the device; None (nothing taken) if fewer are free."""
        assert n >= 0, f"cannot allocate {n} slots"
        if n > self._free_slots.numel():
            return None
        slots, self._free_slots = self._free_slots[:n], self._free_slots[n:]
        if self._is_free_cpu is not None:
            self._is_free_cpu[slots.cpu()] = False
        return slots

    def free(self, slots: torch.Tensor) -> None:
        """Return slots (int64 tensor [n], any device; empty is a no-op)."""
        if slots.numel() == 0:
            return
        slots = slots.reshape(-1).to(device=self.device, dtype=torch.int64)
        if self._is_free_cpu is not None:
            self._check_free(slots.cpu())
        self._free_slots = torch.cat([self._free_slots, slots])

    def available_size(self) -> int:
        """Number of free slots."""
        return self._free_slots.numel()

    def clear(self) -> None:
        """Mark every slot free."""
        self._free_slots = torch.arange(1, self.size + 1, dtype=torch.int64, device=self.device)
        if self.check_double_free:
            self._is_free_cpu = torch.ones(self.size + 1, dtype=torch.bool)
            self._is_free_cpu[0] = False

    def _check_free(self, slots_cpu: torch.Tensor) -> None:
        assert self._is_free_cpu is not None
        lo, hi = int(slots_cpu.min()), int(slots_cpu.max())
        assert lo >= 1 and hi <= self.size, f"freeing slots outside [1, {self.size}]: min {lo}, max {hi}"
        assert slots_cpu.unique().numel() == slots_cpu.numel(), "slot freed twice in one call"
        already = slots_cpu[self._is_free_cpu[slots_cpu]]
        assert already.numel() == 0, f"double free of KV slots {already.tolist()[:8]}"
        self._is_free_cpu[slots_cpu] = True
