"""An EAGLE head's tree steps 2..S of one cycle in one pass over static buffers (one CUDA graph replay).

The tree version of `draft_loop.py`: for up to `max_bs` requests of `topk` beams each, every step records the
beams' KV slots in their rows of `req_to_token`, plans attention on the device (`init_forward_metadata_graph`),
runs the head over the beams' tokens and features, scores their top-K children (`expand_beams`), keeps the K best
as the next beams (features, tokens and row paths moved on the device) and writes the children into static
candidate buffers; nothing returns to the host between steps. Captured per (padded request count, steps); padding
beams use the dummy request row 0 and slot 0 and write `req_to_token` back unchanged (row 0 may be a real request's),
as the chain loop's padding does. With `capture=False` the same pass runs eagerly (the CPU tests).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from radixmesh.engine.attention.base import ForwardBatch, ForwardMode
from radixmesh.engine.cuda_graph_runner import graph_batch_sizes
from radixmesh.engine.device_io import copy_to_device
from radixmesh.engine.speculative.draft_loop import MAX_LOOP_BATCH, capture_step_graphs
from radixmesh.engine.speculative.eagle_tree import copy_paths, expand_beams

if TYPE_CHECKING:
    from radixmesh.engine.model_runner import ModelRunner
    from radixmesh.engine.models.eagle import EagleDraft

logger = logging.getLogger(__name__)


class TreeLoop:
    """Runs up to `max_steps` tree steps at once for up to `max_bs` requests of `topk` beams."""

    def __init__(self, runner: ModelRunner, head: EagleDraft, topk: int, max_steps: int, max_bs: int,
                 to_target: Callable[[torch.Tensor], torch.Tensor], capture: bool = True) -> None:
        backend = runner.attn_backend
        assert backend.supports_cuda_graph, f"{type(backend).__name__} cannot plan decode passes on the device"
        self.runner, self.head, self.topk, self.to_target = runner, head, topk, to_target
        self.sizes = graph_batch_sizes(max(1, min(max_bs, MAX_LOOP_BATCH)))
        self.max_bs = self.sizes[-1]
        self.max_steps = max_steps
        beams = self.max_bs * topk
        if runner.graph_runner is not None:  # its graph state (kv_indices room) serves these passes too
            assert runner.graph_runner.max_bs >= beams, "the tree loop needs decode graph state for its beams"
            self.max_kv_indices = runner.graph_runner.max_kv_indices
        else:
            self.max_kv_indices = backend.init_cuda_graph_state(beams, runner.context_len, runner.kv_pool,
                                                                runner.layout.num_heads)
        device, k = runner.device, topk
        self.flat = torch.zeros(3 * beams, dtype=torch.int64, device=device)
        """Staged from the host in one copy, per beam: start position, request row, 1 for real beams."""
        self.starts, self.rows, self.real = self.flat[:beams], self.flat[beams:2 * beams], self.flat[2 * beams:]
        self.slots = torch.zeros(max(max_steps, 1), beams, dtype=torch.int64, device=device)
        self.scores = torch.zeros(self.max_bs, k, dtype=torch.float32, device=device)
        self.tokens = torch.zeros(self.max_bs, k, dtype=torch.int64, device=device)
        self.cand = torch.zeros(self.max_bs, k, dtype=torch.int64, device=device)
        """The beams' cumulative scores, target tokens and candidate indices."""
        width = k + max_steps * k * k
        self.cand_scores = torch.zeros(self.max_bs, width, dtype=torch.float32, device=device)
        self.cand_tokens = torch.zeros(self.max_bs, width, dtype=torch.int64, device=device)
        self.cand_parents = torch.zeros(self.max_bs, width, dtype=torch.int64, device=device)
        """Every candidate of the cycle: the first level's K (staged), then K * K per step."""
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.num_runs = 0
        if capture:
            self._capture_all()

    def fits(self, bs: int, steps: int, starts: list[int]) -> bool:
        """Whether `bs` requests (beam starts `starts`, K per request) take `steps` tree steps through the loop."""
        if not 1 <= steps <= self.max_steps or bs > self.max_bs:
            return False
        padded = self.sizes[bisect.bisect_left(self.sizes, bs)]
        return sum(starts) + len(starts) * steps + (padded - bs) * self.topk * steps <= self.max_kv_indices

    def run(self, first: tuple[torch.Tensor, torch.Tensor, torch.Tensor], starts: list[int], rows: list[int],
            slots: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Candidates `[bs, K + steps * K * K]` (scores, target tokens, parent candidates) of `bs` requests whose
        first level is `first` (scores, tokens `[bs, K]`, the catch-up's features `[bs * K, hidden]`); beams start at
        positions `starts` (`[bs * K]`) in rows `rows` with KV slots `slots` `[steps, bs * K]`."""
        k = self.topk
        bs = len(rows) // k
        padded = self.sizes[bisect.bisect_left(self.sizes, bs)]
        pad = [0] * ((self.max_bs - bs) * k)  # padding beams: request row 0 from position 0, never kept
        copy_to_device(self.flat, [*starts, *pad, *rows, *pad, *([1] * (bs * k)), *pad])
        self.slots[:steps, :padded * k].zero_()
        self.slots[:steps, :bs * k].copy_(slots)
        scores, tokens, features = first
        self.scores[:padded].zero_()
        self.scores[:bs].copy_(scores)
        self.tokens[:padded].zero_()
        self.tokens[:bs].copy_(tokens)
        self.cand[:padded].copy_(torch.arange(k, device=scores.device).expand(padded, k))
        self.cand_scores[:bs, :k].copy_(scores)
        self.cand_tokens[:bs, :k].copy_(tokens)
        self.cand_parents[:bs, :k].fill_(-1)
        self.head.draft_in[:padded * k].zero_()
        self.head.draft_in[:bs * k].copy_(features)
        graph = self.graphs.get((padded, steps))
        if graph is not None:
            graph.replay()
        else:
            self._steps(padded, steps)
        self.num_runs += 1
        width = k + steps * k * k
        return self.cand_scores[:bs, :width], self.cand_tokens[:bs, :width], self.cand_parents[:bs, :width]

    def _steps(self, bs: int, steps: int) -> None:
        r, k, head = self.runner, self.topk, self.head
        n = bs * k
        req_to_token = r.req_pool.req_to_token
        rows, starts, real = self.rows[:n], self.starts[:n], self.real[:n].bool()
        ones = torch.ones(n, dtype=torch.int64, device=r.device)
        for j in range(steps):
            positions = starts + j
            loc = self.slots[j, :n]
            # padding beams (row 0, which a real request may own) keep what row 0 holds there
            req_to_token.index_put_((rows, positions), torch.where(real, loc, req_to_token[rows, positions]))
            tokens = self.tokens[:bs].reshape(-1)
            fb = ForwardBatch(
                mode=ForwardMode.DECODE, input_ids=tokens, positions=positions, out_cache_loc=loc,
                req_pool_indices=rows, seq_lens=positions + 1, extend_prefix_lens=positions, extend_seq_lens=ones,
                req_to_token_pool=r.req_pool, token_to_kv_pool=r.kv_pool, attn_backend=r.attn_backend,
                seq_lens_cpu=[1] * n, extend_prefix_lens_cpu=[0] * n, extend_seq_lens_cpu=[1] * n)
            r.attn_backend.init_forward_metadata_graph(fb, n)
            logits = head(tokens, positions, fb)
            offset = k + j * k * k
            grown = expand_beams(logits, self.scores[:bs], self.cand[:bs], k, self.to_target, offset)
            self.cand_scores[:bs, offset:offset + k * k].copy_(grown.scores)
            self.cand_tokens[:bs, offset:offset + k * k].copy_(grown.tokens)
            self.cand_parents[:bs, offset:offset + k * k].copy_(grown.parents)
            head.draft_in[:n].copy_(head.hidden_out[:n].index_select(0, grown.parent_beams))
            self.scores[:bs].copy_(grown.best_scores)
            self.tokens[:bs].copy_(grown.best_tokens)
            self.cand[:bs].copy_(grown.best_cand)
            if j + 1 < steps:
                copy_paths(req_to_token, rows, grown.parent_beams, starts, j + 1)

    def _capture_all(self) -> None:
        start = time.perf_counter()
        self.graphs = capture_step_graphs(self._steps, self.sizes, self.max_steps)
        logger.info("captured %d tree-loop CUDA graphs (up to %d requests of %d beams, up to %d steps) in %.1f s",
                    len(self.graphs), self.max_bs, self.topk, self.max_steps, time.perf_counter() - start)


def make_tree_loop(runner: ModelRunner, head: EagleDraft, topk: int, max_steps: int, max_bs: int,
                   to_target: Callable[[torch.Tensor], torch.Tensor]) -> TreeLoop | None:
    """A captured tree loop when the head replays decode graphs; None (pass by pass) otherwise, or when capturing
    fails (logged)."""
    if runner.graph_runner is None or max_steps < 1 or runner.graph_runner.max_bs < topk:
        return None
    try:
        return TreeLoop(runner, head, topk, max_steps, min(max_bs, runner.graph_runner.max_bs // topk), to_target)
    except Exception as exc:  # drafting still works pass by pass
        logger.warning("tree steps run pass by pass: capturing the tree loop failed (%s: %s)",
                       type(exc).__name__, exc)
        return None
