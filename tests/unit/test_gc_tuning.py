"""Startup objects leave the collector's generations; garbage made before the freeze is collected, not frozen."""

from __future__ import annotations

import gc
import weakref

from radixmesh.common.gc_tuning import freeze_startup_objects


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


def test_live_objects_are_frozen_and_cyclic_garbage_is_collected_first() -> None:
    garbage = _Node()
    gone = weakref.ref(garbage)
    del garbage
    kept = [_Node() for _ in range(10)]
    try:
        freeze_startup_objects()
        assert gone() is None  # collected before the freeze, not kept forever in the permanent generation
        assert gc.get_freeze_count() >= len(kept)
        assert not any(obj is kept for obj in gc.get_objects())  # the collector no longer tracks it
    finally:
        gc.unfreeze()
