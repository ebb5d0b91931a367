"""A draft model's (or EAGLE head's) decode steps 2..k of one cycle in one pass over static buffers.

Greedy chains of one length: each step feeds the previous step's argmax (mapped to target ids), at
positions `start + j` with the KV slots allocated for the whole chain up front, records the slots in
`req_to_token` and plans attention on the device (`init_forward_metadata_graph`), so nothing returns
to the host between steps. On CUDA the pass is captured as one CUDA graph per (padded batch size,
steps): one replay drafts the chain. Elsewhere (`capture=False`, the CPU tests with the Triton
backend under its interpreter) the same code runs eagerly. Padding rows use the dummy request row
0 and the dummy KV slot 0, as the decode graphs do (their `req_to_token` entries are written back unchanged).
"""

from __future__ import annotations

import bisect
import functools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from radixmesh.engine.attention.base import ForwardBatch, ForwardMode
from radixmesh.engine.cuda_graph_runner import graph_batch_sizes
from radixmesh.engine.device_io import copy_to_device
from radixmesh.engine.graph_capture import GraphCapture
from radixmesh.engine.sampling.sampler import argmax

if TYPE_CHECKING:
    from radixmesh.engine.model_runner import ModelRunner

logger = logging.getLogger(__name__)

ToTarget = Callable[[torch.Tensor], torch.Tensor]
MAX_LOOP_BATCH = 32
"""Largest batch drafted through the loop (larger ones step pass by pass)."""


class DraftLoop:
    """Runs `steps` draft decode steps at once for up to `max_bs` chains; `to_target` maps the draft's argmax ids
    to target ids, `between(bs)` runs after each step (an EAGLE head moves its output features to its input)."""

    def __init__(self, runner: ModelRunner, max_steps: int, max_bs: int, to_target: ToTarget,
                 between: Callable[[int], None] | None = None, capture: bool = True) -> None:
        backend = runner.attn_backend
        assert backend.supports_cuda_graph, f"{type(backend).__name__} cannot plan decode passes on the device"
        self.runner = runner
        self.to_target = to_target
        self.between = between
        self.sizes = graph_batch_sizes(min(max_bs, MAX_LOOP_BATCH))
        self.max_bs = self.sizes[-1]
        self.max_steps = max_steps
        if runner.graph_runner is not None:  # its graph state (kv_indices room) serves these passes too
            assert runner.graph_runner.max_bs >= self.max_bs, "the draft loop needs decode graph state for its batch"
            self.max_kv_indices = runner.graph_runner.max_kv_indices
        else:
            self.max_kv_indices = backend.init_cuda_graph_state(self.max_bs, runner.context_len, runner.kv_pool,
                                                                runner.layout.num_heads)
        device = runner.device
        b = self.max_bs
        self.flat = torch.zeros(3 * b, dtype=torch.int64, device=device)
        """Staged from the host in one copy: start positions [b], request rows [b], 1 for real rows [b]."""
        self.starts, self.rows, self.real = self.flat[:b], self.flat[b:2 * b], self.flat[2 * b:]
        self.slots = torch.zeros(max_steps, b, dtype=torch.int64, device=device)
        self.first = torch.zeros(b, dtype=torch.int64, device=device)
        """The chains' first drafts (target ids), from the catch-up pass."""
        self.out = torch.zeros(max_steps, b, dtype=torch.int64, device=device)
        """Draft j + 2 of chain i at `out[j, i]`."""
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.num_runs = 0
        if capture:
            self._capture_all()

    def fits(self, bs: int, steps: int, starts: list[int]) -> bool:
        """Whether `bs` chains of `steps` further drafts from positions `starts` run through the loop."""
        if not 1 <= steps <= self.max_steps or bs > self.max_bs:
            return False
        padded = self.sizes[bisect.bisect_left(self.sizes, bs)]
        return sum(starts) + bs * steps + (padded - bs) * steps <= self.max_kv_indices

    def run(self, first: torch.Tensor, starts: list[int], rows: list[int], slots: torch.Tensor,
            steps: int) -> torch.Tensor:
        """Drafts 2..steps+1 `[steps, bs]` (target ids, on the device) of chains whose draft 1 is `first` `[bs]`, at
        positions `starts[i] + j` with KV slots `slots` `[steps, bs]`, in request rows `rows`."""
        bs = len(rows)
        padded = self.sizes[bisect.bisect_left(self.sizes, bs)]
        pad = [0] * (self.max_bs - bs)  # padding rows: request row 0 from position 0, never written
        copy_to_device(self.flat, [*starts, *pad, *rows, *pad, *([1] * bs), *pad])
        self.slots[:steps, :padded].zero_()
        self.slots[:steps, :bs].copy_(slots)
        self.first[:padded].zero_()
        self.first[:bs].copy_(first)
        graph = self.graphs.get((padded, steps))
        if graph is not None:
            graph.replay()
        else:
            self._steps(padded, steps)
        self.num_runs += 1
        return self.out[:steps, :bs]

    def _steps(self, bs: int, steps: int) -> None:
        r = self.runner
        backend, model, device = r.attn_backend, r.model, r.device
        req_to_token = r.req_pool.req_to_token
        rows = self.rows[:bs]
        ones = torch.ones(bs, dtype=torch.int64, device=device)
        tokens = self.first[:bs]
        real = self.real[:bs].bool()
        for j in range(steps):
            positions = self.starts[:bs] + j
            loc = self.slots[j, :bs]
            # padding rows (row 0, which a real request may own, at positions below any of its new ones) keep
            # what row 0 holds there
            req_to_token.index_put_((rows, positions), torch.where(real, loc, req_to_token[rows, positions]))
            fb = ForwardBatch(
                mode=ForwardMode.DECODE, input_ids=tokens, positions=positions, out_cache_loc=loc,
                req_pool_indices=rows, seq_lens=positions + 1, extend_prefix_lens=positions, extend_seq_lens=ones,
                req_to_token_pool=r.req_pool, token_to_kv_pool=r.kv_pool, attn_backend=backend,
                seq_lens_cpu=[1] * bs, extend_prefix_lens_cpu=[0] * bs, extend_seq_lens_cpu=[1] * bs)
            backend.init_forward_metadata_graph(fb, bs)
            logits = model(tokens, positions, fb)
            self.out[j, :bs].copy_(self.to_target(argmax(logits)))
            tokens = self.out[j, :bs]
            if self.between is not None:
                self.between(bs)

    def _capture_all(self) -> None:
        start = time.perf_counter()
        self.graphs = capture_step_graphs(self._steps, self.sizes, self.max_steps)
        logger.info("captured %d draft-loop CUDA graphs (batch sizes up to %d, up to %d steps) in %.1f s",
                    len(self.graphs), self.max_bs, self.max_steps, time.perf_counter() - start)


def make_draft_loop(runner: ModelRunner, max_steps: int, max_bs: int, to_target: ToTarget,
                    between: Callable[[int], None] | None = None) -> DraftLoop | None:
    """A captured draft loop when the draft replays decode graphs; None (step by step) otherwise, or when capturing
    fails (logged)."""
    if runner.graph_runner is None or max_steps < 1:
        return None
    try:
        return DraftLoop(runner, max_steps, min(max_bs, runner.graph_runner.max_bs), to_target, between)
    except Exception as exc:  # drafting still works pass by pass
        logger.warning("draft steps run pass by pass: capturing the draft loop failed (%s: %s)",
                       type(exc).__name__, exc)
        return None


def capture_step_graphs(run: Callable[[int, int], None], sizes: list[int],
                        max_steps: int) -> dict[tuple[int, int], torch.cuda.CUDAGraph]:
    """A CUDA graph of `run(bs, steps)` for every batch size and step count (largest first, one memory pool),
    each after two uncaptured warm-up runs; the draft loop's and the tree loop's passes."""
    graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
    with GraphCapture() as session:
        for bs in reversed(sizes):
            for steps in range(max_steps, 0, -1):
                graphs[(bs, steps)] = session.capture(functools.partial(run, bs, steps))[0]
    return graphs
