"""The host tier's memory: token-major KV buffers (pinned when the device is CUDA) and their slot allocator.

`HostKVPool.buffer` is `[num_slots + 1, num_layers, 2, kv_heads, head_dim]` in the device pool's dtype:
every token's K and V of all layers together, so the KV of a run of consecutive host slots is one
contiguous block that moves between host and device in one DMA. Host slot 0 is never handed out, like
the device pool's dummy slot.

`HostSlotAllocator` keeps the free slots as sorted, disjoint runs and hands out the fewest runs it can
(best fit), so a node's host copy is usually one contiguous block.
"""

from __future__ import annotations

import bisect

import torch


class HostSlotAllocator:
    """Free list of host slots 1..size as sorted runs `(start, length)`."""

    def __init__(self, size: int) -> None:
        assert size > 0, f"HostSlotAllocator size must be positive, got {size}"
        self.size = size
        self._starts: list[int] = []
        self._lengths: list[int] = []
        self._free = 0
        self.clear()

    def available_size(self) -> int:
        return self._free

    def num_runs(self) -> int:
        """Disjoint free runs (1 when nothing is fragmented)."""
        return len(self._starts)

    def clear(self) -> None:
        self._starts, self._lengths, self._free = [1], [self.size], self.size

    def alloc(self, n: int) -> torch.Tensor | None:
        """`n` slots as an int64 CPU tensor (ascending within each run); None (nothing taken) if fewer are free."""
        assert n >= 0, f"cannot allocate {n} host slots"
        if n > self._free:
            return None
        if n == 0:
            return torch.empty(0, dtype=torch.int64)
        pieces: list[torch.Tensor] = []
        need = n
        while need:
            i = self._best_run(need)
            start, length = self._starts[i], self._lengths[i]
            take = min(length, need)
            pieces.append(torch.arange(start, start + take, dtype=torch.int64))
            if take == length:
                del self._starts[i], self._lengths[i]
            else:
                self._starts[i], self._lengths[i] = start + take, length - take
            need -= take
        self._free -= n
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def free(self, slots: torch.Tensor) -> None:
        """Return host slots (int64 CPU tensor, any order; empty is a no-op)."""
        if slots.numel() == 0:
            return
        for start, length in slot_runs(slots.sort().values):
            self._insert_run(start, length)
        self._free += slots.numel()
        assert self._free <= self.size, f"host slots freed twice: {self._free} free of {self.size}"

    def _best_run(self, need: int) -> int:
        """The smallest run holding `need` slots, else the largest run."""
        best, best_len, largest, largest_len = -1, 0, 0, -1
        for i, length in enumerate(self._lengths):
            if length >= need and (best < 0 or length < best_len):
                best, best_len = i, length
            if length > largest_len:
                largest, largest_len = i, length
        return best if best >= 0 else largest

    def _insert_run(self, start: int, length: int) -> None:
        i = bisect.bisect_left(self._starts, start)
        assert start >= 1 and start + length - 1 <= self.size, f"host slots [{start}, {start + length}) out of range"
        if i < len(self._starts):
            assert start + length <= self._starts[i], f"host slot {self._starts[i]} freed twice"
        if i > 0:
            assert self._starts[i - 1] + self._lengths[i - 1] <= start, f"host slot {start} freed twice"
        if i > 0 and self._starts[i - 1] + self._lengths[i - 1] == start:  # merge with the run before
            i -= 1
            self._lengths[i] += length
        else:
            self._starts.insert(i, start)
            self._lengths.insert(i, length)
        if i + 1 < len(self._starts) and self._starts[i] + self._lengths[i] == self._starts[i + 1]:
            self._lengths[i] += self._lengths.pop(i + 1)
            self._starts.pop(i + 1)


def slot_runs(slots: torch.Tensor) -> list[tuple[int, int]]:
    """Maximal runs of consecutive values in `slots` (a CPU int64 tensor, in its order), as `(first, length)`."""
    if slots.numel() == 0:
        return []
    breaks = (torch.nonzero(slots[1:] - slots[:-1] != 1).flatten() + 1).tolist()
    bounds = [0, *breaks, slots.numel()]
    firsts = slots[bounds[:-1]].tolist()
    return [(first, end - begin) for first, begin, end in zip(firsts, bounds[:-1], bounds[1:])]


class HostKVPool:
    """Token-major KV of the host tier (see the module docstring)."""

    def __init__(self, size: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 pin_memory: bool) -> None:
        assert size > 0, f"HostKVPool size must be positive, got {size}"
        self.size = size
        self.dtype = dtype
        self.token_shape = (num_layers, 2, num_kv_heads, head_dim)
        # [size + 1, num_layers, 2, kv_heads, head_dim]; not zeroed: a slot is read only after it was written
        self.buffer = torch.empty((size + 1, *self.token_shape), dtype=dtype, pin_memory=pin_memory)
        self.allocator = HostSlotAllocator(size)

    @property
    def bytes_per_token(self) -> int:
        return self.buffer[0].numel() * self.buffer.element_size()

    @staticmethod
    def tokens_for_bytes(num_bytes: float, num_layers: int, num_kv_heads: int, head_dim: int,
                         dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return int(num_bytes // (2 * num_layers * num_kv_heads * head_dim * itemsize))
