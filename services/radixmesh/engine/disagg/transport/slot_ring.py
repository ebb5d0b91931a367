"""Regions of a fixed-size array handed out per transfer: where cuda-ipc's direct mode puts a transfer's slots.

The prefill side copies each exported prompt's slot indices into a region of one persistent device array
(shared once with CUDA IPC), so a transfer costs no allocation and no new IPC handle. Regions are freed in any
order (transfers end out of order). Allocation is next-fit from where the last region ended, wrapping
around: a region just freed is reused last, and a full array answers None (the caller falls back).
"""

from __future__ import annotations

import bisect


class SlotRing:
    """Allocator of `[offset, offset + length)` regions of `[0, capacity)`, one per key; no two overlap."""

    def __init__(self, capacity: int) -> None:
        assert capacity > 0, f"the ring's capacity must be positive, got {capacity}"
        self.capacity = capacity
        self._regions: dict[str, tuple[int, int]] = {}
        """key -> (offset, length)."""
        self._starts: list[int] = []
        """Offsets of the live regions, sorted."""
        self._ends: dict[int, int] = {}
        """offset -> end of the live region starting there."""
        self._cursor = 0

    def __len__(self) -> int:
        return len(self._regions)

    @property
    def num_used(self) -> int:
        return sum(length for _, length in self._regions.values())

    def allocate(self, key: str, length: int) -> int | None:
        """The offset of a new region of `length` entries for `key`; None when no gap that long is free."""
        assert key not in self._regions, f"ring region {key!r} is already allocated"
        assert length > 0, f"a ring region needs at least one entry, got {length}"
        offset = self._find(length)
        if offset is None:
            return None
        self._regions[key] = (offset, length)
        bisect.insort(self._starts, offset)
        self._ends[offset] = offset + length
        self._cursor = offset + length
        return offset

    def free(self, key: str) -> None:
        """Free `key`'s region (no-op when it has none)."""
        region = self._regions.pop(key, None)
        if region is None:
            return
        offset = region[0]
        del self._starts[bisect.bisect_left(self._starts, offset)]
        del self._ends[offset]

    def region(self, key: str) -> tuple[int, int] | None:
        """(offset, length) of `key`'s region, or None."""
        return self._regions.get(key)

    def _find(self, length: int) -> int | None:
        gaps = self._gaps()
        for begin, end in gaps:  # next fit: the first gap at or after the cursor
            start = max(begin, self._cursor)
            if start + length <= end:
                return start
        for begin, end in gaps:  # then wrap around
            if begin + length <= end:
                return begin
        return None

    def _gaps(self) -> list[tuple[int, int]]:
        """Free `[begin, end)` intervals in order."""
        gaps, pos = [], 0
        for start in self._starts:
            if start > pos:
                gaps.append((pos, start))
            pos = self._ends[start]
        if pos < self.capacity:
            gaps.append((pos, self.capacity))
        return gaps
