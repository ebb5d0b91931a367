"""Decode through captured CUDA graphs, one per bucketed batch size.

A decode step of a small model is hundreds of tiny kernels; replaying a graph turns
their launches into one. Inputs live in static buffers; a batch is padded up to the
next captured size with dummy rows (slot 0, length 1) whose outputs are discarded.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from radixmesh.engine.attention.base import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from radixmesh.engine.batch import ScheduleBatch
    from radixmesh.engine.model_runner import ModelRunner

logger = logging.getLogger(__name__)

_BUCKETS = [1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160, 192, 224, 256, 320, 384, 512]


def graph_batch_sizes(max_bs: int) -> list[int]:
    sizes = [b for b in _BUCKETS if b < max_bs]
    return [*sizes, max_bs]


class CudaGraphRunner:
    """Captures `model(...)` for DECODE at each bucket size and replays it."""

    def __init__(self, runner: ModelRunner, max_bs: int) -> None:
        self.runner = runner
        self.device = runner.device
        self.sizes = graph_batch_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        backend = runner.attn_backend
        assert backend.supports_cuda_graph, f"{type(backend).__name__} cannot run in CUDA graphs"
        self.max_kv_indices = backend.init_cuda_graph_state(self.max_bs, runner.context_len, runner.kv_pool,
                                                            runner.model_config.num_heads)

        def zeros(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int64, device=self.device)

        self.input_ids, self.positions, self.out_cache_loc = zeros(self.max_bs), zeros(self.max_bs), zeros(self.max_bs)
        self.req_pool_indices = zeros(self.max_bs)
        self.seq_lens = torch.ones(self.max_bs, dtype=torch.int64, device=self.device)
        self.ones = torch.ones(self.max_bs, dtype=torch.int64, device=self.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._capture_all()

    def _forward_batch(self, bs: int) -> ForwardBatch:
        r = self.runner
        return ForwardBatch(
            mode=ForwardMode.DECODE, input_ids=self.input_ids[:bs], positions=self.positions[:bs],
            out_cache_loc=self.out_cache_loc[:bs], req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs], extend_prefix_lens=self.seq_lens[:bs] - 1, extend_seq_lens=self.ones[:bs],
            req_to_token_pool=r.req_pool, token_to_kv_pool=r.kv_pool, attn_backend=r.attn_backend,
            seq_lens_cpu=[1] * bs, extend_prefix_lens_cpu=[0] * bs, extend_seq_lens_cpu=[1] * bs)

    def _capture_all(self) -> None:
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        for bs in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory
            fb = self._forward_batch(bs)
            run = self._make_run(fb, bs)
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm up: Triton compiles, allocator settles
                    run()
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.outputs[bs] = run()
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        logger.info("captured %d decode CUDA graphs (batch sizes up to %d) in %.1f s", len(self.sizes),
                    self.max_bs, time.perf_counter() - start)

    def _make_run(self, fb: ForwardBatch, bs: int) -> Callable[[], torch.Tensor]:
        backend = self.runner.attn_backend
        model = self.runner.model

        def run() -> torch.Tensor:
            backend.init_forward_metadata_graph(fb, bs)
            logits: torch.Tensor = model(fb.input_ids, fb.positions, fb)
            return logits

        return run

    def can_run(self, batch: ScheduleBatch) -> bool:
        return (batch.is_decode and len(batch.reqs) <= self.max_bs
                and sum(batch.seq_lens) <= self.max_kv_indices)

    def replay(self, batch: ScheduleBatch, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits `[batch, vocab]` of a DECODE batch (a view of the graph's output buffer)."""
        bs = len(batch.reqs)
        padded = self.sizes[bisect.bisect_left(self.sizes, bs)]
        # [3, bs] host columns, one copy to the device
        cols = torch.tensor([batch.positions, [r.req_pool_idx or 0 for r in batch.reqs], batch.seq_lens],
                            dtype=torch.int64).to(self.device, non_blocking=True)
        if padded > bs:
            self.seq_lens[bs:padded].fill_(1)
            self.out_cache_loc[bs:padded].zero_()
            self.req_pool_indices[bs:padded].zero_()
            self.positions[bs:padded].zero_()
            self.input_ids[bs:padded].zero_()
        self.input_ids[:bs].copy_(input_ids)
        self.positions[:bs].copy_(cols[0])
        self.req_pool_indices[:bs].copy_(cols[1])
        self.seq_lens[:bs].copy_(cols[2])
        self.out_cache_loc[:bs].copy_(batch.out_cache_loc)
        self.graphs[padded].replay()
        return self.outputs[padded][:bs]
