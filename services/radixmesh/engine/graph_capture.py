"""One way to capture the engine's CUDA graphs (decode, verify, draft loops, one-request prefills).

A `GraphCapture` session shares one memory pool and one side stream among the graphs captured in it (capture the
largest first: the smaller ones reuse its memory) and keeps Python's garbage collection off meanwhile: freeing an
old pinned buffer or event from a collected cycle would make CUDA calls that invalidate the capture. Other threads
(grammar compilation) may use CUDA meanwhile: only this thread's calls are captured (`thread_local`).
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar

import torch

T = TypeVar("T")


class GraphCapture:
    """`with GraphCapture() as session: graph, out = session.capture(run)`; the device is synchronized when the block
    ends without an error."""

    def __enter__(self) -> GraphCapture:
        self.pool: Any = torch.cuda.graph_pool_handle()  # an opaque handle
        self.stream = torch.cuda.Stream()
        gc.collect()
        self._gc_was_enabled = gc.isenabled()
        gc.disable()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._gc_was_enabled:
            gc.enable()
        if kind is None:
            torch.cuda.synchronize()

    def capture(self, run: Callable[[], T]) -> tuple[torch.cuda.CUDAGraph, T]:
        """A graph of `run()` after two uncaptured runs (Triton compiles, the allocator settles), and what the captured
        run returned (its outputs live in the graph's memory: each replay rewrites them)."""
        with torch.cuda.stream(self.stream):
            for _ in range(2):
                run()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
                out = run()
        return graph, out
