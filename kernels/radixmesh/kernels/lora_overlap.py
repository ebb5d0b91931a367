"""The adapters' shrink beside the base GEMM, on a side CUDA stream (the engine's --lora-overlap).

At a decode batch of many rows the two LoRA launches of a projection are short, latency-bound kernels on the
critical path after the base GEMM. The shrink (`x @ A_s.T` per row) needs only the projection's input, so it runs
on a side stream while the GEMM runs on the main one; only the expand, which adds into the GEMM's output, waits
for both:

    main:  fork -> y = x @ W.T -------------------> join -> expand (y += scaling * xa @ B_s.T)
    side:  wait(fork) -> shrink xa = x @ A_s.T -> done

With `expand_on_side` (--lora-overlap side) the expand runs on the side stream as well, into a zeroed buffer, and
the main stream adds that buffer after the join: one elementwise add on the critical path instead of the expand.

Every projection reuses one side stream per device, made before any CUDA graph is captured (`side_stream`). The
shrink's buffer is allocated on the main stream before the fork, so nothing is allocated on the side stream (a
capture keeps it in the graph's pool), and the side stream joins the main one before the projection returns,
also when the GEMM fails. Both LoRA kernels launch without PDL here: a PDL launch waits early only on the kernel
before it on its own stream, and the shrink and expand each follow a cross-stream wait. When the engine takes this
path: `radixmesh.engine.lora.overlap`; its cost next to the sequential launches: `bench_lora` (`overlap_us`).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from radixmesh.kernels.lora import LoraBatch, kernel_config, lora_expand, lora_shrink, shrink_shape

_side_streams: dict[int, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream of CUDA `device`, made on first use (the LoRA runtime asks before graphs are captured)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _side_streams.get(index)
    if stream is None:
        stream = _side_streams[index] = torch.cuda.Stream(device=index)
    return stream


class StreamPair:
    """The main stream (current at the fork) and the side stream of a device: fork, run on the side, join."""

    def __init__(self, device: torch.device) -> None:
        self.main = torch.cuda.current_stream(device)
        self.side = side_stream(device)

    def fork(self) -> None:
        """The side stream waits for what the main stream has queued (the projection's input)."""
        self.side.wait_stream(self.main)

    def on_side(self) -> AbstractContextManager[Any]:
        """Launches inside go to the side stream."""
        return torch.cuda.stream(self.side)

    def join(self) -> None:
        """The main stream waits for what the side stream has queued (the shrink)."""
        self.main.wait_stream(self.side)


def lora_overlapped(x: torch.Tensor, project: Callable[[torch.Tensor], torch.Tensor], a: torch.Tensor,
                    b: torch.Tensor, batch: LoraBatch, ranks: torch.Tensor, scalings: torch.Tensor,
                    slice_sizes: tuple[int, ...], kind: str, streams: StreamPair | None = None,
                    expand_on_side: bool = False) -> torch.Tensor:
    """`project(x)` (the base output, on the main stream) plus every row's adapter output, the shrink on the side
    stream meanwhile (`streams`: the current stream and `side_stream` unless given). `x` contiguous `[M, in]`;
    `kind` "rows" or "grouped" (`radixmesh.kernels.lora.choose_kernels`). `expand_on_side`: the expand too, into a
    zeroed buffer in the output's dtype that one add puts into the base output after the join (the adapter's sum
    is rounded to that dtype once more than with the expand on the main stream)."""
    max_rank = b.shape[2]
    cfg = kernel_config(kind, batch, x.shape[1], slice_sizes, max_rank, ranks.shape[0], x.device)
    # [splits, rows, slices * R] (and the adapters' sum), on the main stream before the fork
    xa = torch.empty(shrink_shape(cfg, x.shape[0], len(slice_sizes), max_rank), dtype=torch.float32,
                     device=x.device)
    delta = torch.empty(x.shape[0], b.shape[1], dtype=b.dtype, device=x.device) if expand_on_side else None
    pair = streams if streams is not None else StreamPair(x.device)
    pair.fork()
    try:
        with pair.on_side():
            lora_shrink(x, a, batch, ranks, len(slice_sizes), xa, cfg, kind, pdl=False)
            if delta is not None:
                delta.zero_()
                lora_expand(xa, b, batch, ranks, scalings, delta, slice_sizes, cfg, kind, pdl=False)
        y = project(x)
    finally:
        pair.join()
    if delta is not None:
        return y.add_(delta)
    return lora_expand(xa, b, batch, ranks, scalings, y, slice_sizes, cfg, kind, pdl=False)
