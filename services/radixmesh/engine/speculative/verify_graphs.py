"""Verify passes through captured CUDA graphs, one per (bucketed batch size, tokens per request); a draft model's
catch-up passes (a few tokens per request) replay graphs of the same kind on the draft's runner.

A verify pass feeds each request its last token and its drafts. Graphs are captured for the
decode graphs' batch-size buckets and for a few lengths `E` (tokens per request: 2, 3, 5, 9, ...
up to `K + 1`); a batch replays the graph of the smallest `E` that holds its longest request and
the smallest batch size that holds it. Shorter requests are padded with dummy tokens and missing
requests with dummy rows (row 0 of `req_to_token`); padding writes its K/V to the dummy slot 0 and
its logits are dropped. Real tokens never attend to padding (it comes after them in their own
request), so their logits are those of the eager pass.

Per replay: one host-to-device copy of the inputs (ids, positions, request rows, lengths), a
scatter of the real tokens' KV slots into the static `out_cache_loc`, the replay, and a gather of
the real tokens' logits. With `capture=False` the same static-buffer pass runs eagerly (CPU tests).

Draft trees (`tree=True`, a second set of graphs beside the chains', which keep their unmasked kernel): each
graph also reads a static `[bs, E, E]` tree mask, staged per replay: a request's rows hold its ancestor mask,
padding and dummy rows the causal triangle (so no real row sees padding, and padding rows see real keys only
of their own request); positions are the batch's own (a node's depth), padding continuing after them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from radixmesh.engine.attention.base import ForwardBatch, ForwardMode, TreeMask
from radixmesh.engine.cuda_graph_runner import graph_batch_sizes
from radixmesh.engine.device_io import copy_to_device, rows_to_device
from radixmesh.engine.graph_capture import GraphCapture
from radixmesh.engine.speculative.tree import ancestor_mask

if TYPE_CHECKING:
    from radixmesh.engine.batch import ScheduleBatch
    from radixmesh.engine.model_runner import ModelRunner

logger = logging.getLogger(__name__)

MAX_GRAPH_BATCH = 32
"""Largest verify batch captured (larger ones verify eagerly: they are compute bound anyway)."""
MAX_GRAPH_TOKENS = 256
"""Most tokens (batch size x tokens per request) in one captured verify pass."""


def graph_lengths(max_drafts: int) -> list[int]:
    """Tokens per request captured: 2, 3, 5, 9, ... (at most twice the need) and `max_drafts + 1`."""
    lens = {max_drafts + 1}
    n = 1
    while n + 1 < max_drafts + 1:
        lens.add(n + 1)
        n *= 2
    return sorted(lens)


@dataclass
class _Graph:
    run: Callable[[], torch.Tensor]
    graph: torch.cuda.CUDAGraph | None
    order: list[int]
    """Packed graph row -> its row in the model's output (each request's last token first, then the rest)."""
    mask_indptr: torch.Tensor | None = None
    """Tree graphs: `[bs + 1]` offsets of each request's `[E, E]` mask in the static mask (kept alive here)."""


class VerifyGraphRunner:
    """Replays verify passes; `key(batch)` says whether (and in which graph) a batch can run."""

    def __init__(self, runner: ModelRunner, max_drafts: int, max_bs: int, capture: bool = True,
                 tree: bool = False) -> None:
        backend = runner.attn_backend
        assert backend.supports_extend_graph, f"{type(backend).__name__} cannot capture extend passes"
        assert not tree or backend.supports_tree_mask, f"{type(backend).__name__} takes no tree mask"
        self.runner = runner
        self.tree = tree
        self.lens = graph_lengths(max_drafts)
        self.sizes = graph_batch_sizes(max_bs)
        self.keys = [(bs, e) for bs in self.sizes for e in self.lens if bs * e <= MAX_GRAPH_TOKENS]
        max_tokens = max(bs * e for bs, e in self.keys)
        max_bs = self.max_bs = max(bs for bs, _ in self.keys)
        device = runner.device
        self.max_seq_len = runner.req_pool.max_context_len
        # [2 * tokens + 2 * batch] int64 viewed per graph: ids, positions, request rows, lengths
        self.flat = torch.zeros(2 * max_tokens + 2 * max_bs, dtype=torch.int64, device=device)
        self.out_cache_loc = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.kv_indptr = torch.zeros(max_bs + 1, dtype=torch.int64, device=device)
        self.kv_indices = torch.zeros(max_bs * self.max_seq_len, dtype=torch.int32, device=device)
        width = int(getattr(runner.model, "draft_vocab", runner.model_config.vocab_size))  # (an EAGLE-3 head's own)
        self.logits = torch.zeros(max_tokens, width, dtype=torch.float32, device=device)
        self.mask = torch.zeros(max((bs * e * e for bs, e in self.keys), default=0) if tree else 0, dtype=torch.uint8,
                                device=device)
        """Tree graphs: each request's `[E, E]` mask, request after request."""
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.num_replays = 0
        start = time.perf_counter()
        self._build_all(capture)
        if capture:
            logger.info("captured %d verify CUDA graphs%s (batch sizes up to %d, %s tokens per request) in %.1f s",
                        len(self.graphs), " for draft trees" if tree else "", max_bs, self.lens,
                        time.perf_counter() - start)

    def _views(self, bs: int, e: int) -> tuple[torch.Tensor, ...]:
        """ids `[bs * e]`, positions `[bs * e]`, request rows `[bs]`, lengths `[bs]`, and all four (one copy)."""
        t, f = bs * e, self.flat
        return f[:t], f[t:2 * t], f[2 * t:2 * t + bs], f[2 * t + bs:2 * t + 2 * bs], f[:2 * t + 2 * bs]

    def _make(self, bs: int, e: int) -> _Graph:
        r = self.runner
        device = r.device
        ids, positions, rows, seq_lens, _ = self._views(bs, e)
        ids.zero_()
        rows.zero_()
        seq_lens.fill_(e)
        positions.copy_(torch.arange(e, device=device).repeat(bs))  # dummy rows: row 0, positions 0..e-1
        out_cache_loc = self.out_cache_loc[:bs * e]
        out_cache_loc.zero_()
        lasts = [(i + 1) * e - 1 for i in range(bs)]
        extras = [g for g in range(bs * e) if g % e != e - 1]
        place = {g: i for i, g in enumerate(lasts + extras)}
        fb = ForwardBatch(
            mode=ForwardMode.EXTEND, input_ids=ids, positions=positions, out_cache_loc=out_cache_loc,
            req_pool_indices=rows, seq_lens=seq_lens,
            extend_prefix_lens=torch.zeros(bs, dtype=torch.int64, device=device),  # read by no backend in graphs
            extend_seq_lens=torch.full((bs,), e, dtype=torch.int64, device=device), req_to_token_pool=r.req_pool,
            token_to_kv_pool=r.kv_pool, attn_backend=r.attn_backend, seq_lens_cpu=[e] * bs,
            extend_prefix_lens_cpu=[0] * bs, extend_seq_lens_cpu=[e] * bs,
            extra_logit_rows=torch.tensor(extras, dtype=torch.int64, device=device))
        out = self.logits[:bs * e]
        mask_indptr = None
        if self.tree:
            mask_indptr = torch.arange(bs + 1, dtype=torch.int64, device=device) * (e * e)
            mask = self.mask[:bs * e * e]
            mask.copy_(_causal(e).repeat(bs, 1, 1).reshape(-1))
            fb.tree_mask = TreeMask(mask, mask_indptr, [])

        def run() -> torch.Tensor:
            r.attn_backend.init_extend_metadata_graph(fb, e, self.kv_indptr, self.kv_indices)
            return out.copy_(r.model(fb.input_ids, fb.positions, fb))

        return _Graph(run, None, [place[g] for g in range(bs * e)], mask_indptr)

    def _build_all(self, capture: bool) -> None:
        if not capture:
            self.graphs = {key: self._make(*key) for key in self.keys}
            return
        with GraphCapture() as session:
            for key in sorted(self.keys, key=lambda k: k[0] * k[1], reverse=True):  # largest first: pool reuse
                item = self.graphs[key] = self._make(*key)
                item.graph = session.capture(item.run)[0]

    def key(self, batch: ScheduleBatch) -> tuple[int, int] | None:
        """The graph (batch size, tokens per request) that holds `batch`, or None (verify eagerly)."""
        bs, need = len(batch.reqs), max(batch.extend_lens)
        e = next((e for e in self.lens if e >= need), None)
        size = next((s for s in self.sizes if s >= bs), None)
        if e is None or size is None or (size, e) not in self.graphs:
            return None
        # padding runs past each request's own tokens: its positions must stay inside the context
        if any(p + e > self.max_seq_len - 1 for p in batch.prefix_lens):
            return None
        return size, e

    def replay(self, batch: ScheduleBatch, key: tuple[int, int],
               stage: Callable[[list[int]], None] | None = None) -> torch.Tensor:
        """Float32 logits `[rows, vocab]` of the batch's tokens, in packed order (as the eager pass). `stage` gets
        each packed token's row in the graph's layout before the replay (to fill a model's own static inputs)."""
        size, e = key
        item = self.graphs[key]
        ids: list[int] = []
        positions: list[int] = []
        graph_rows: list[int] = []
        offset = 0
        for i, (prefix, n) in enumerate(zip(batch.prefix_lens, batch.extend_lens)):
            ids += batch.input_ids[offset:offset + n] + [0] * (e - n)
            positions += batch.positions[offset:offset + n] + list(range(prefix + n, prefix + e))
            graph_rows += range(i * e, i * e + n)
            offset += n
        dummy = size - len(batch.reqs)
        ids += [0] * (dummy * e)
        positions += list(range(e)) * dummy
        rows = batch.req_pool_indices + [0] * dummy
        seq_lens = [p + e for p in batch.prefix_lens] + [e] * dummy
        ids_view, *_, host = self._views(size, e)
        copy_to_device(host, ids + positions + rows + seq_lens)
        device_drafts = getattr(batch, "device_drafts", None)  # (a VerifyBatch whose drafts stayed on the device)
        if device_drafts is not None:
            batch.put_device_drafts(ids_view, [graph_rows[r] for r in batch.draft_rows])  # type: ignore[attr-defined]
        device = self.runner.device
        scatter, gather = rows_to_device([graph_rows, [item.order[g] for g in graph_rows]], device)
        out_cache_loc = self.out_cache_loc[:size * e]
        out_cache_loc.zero_()  # padding writes its K/V to the dummy slot 0
        out_cache_loc.index_copy_(0, scatter, batch.out_cache_loc)
        if self.tree:
            self._stage_mask(batch, size, e)
        if stage is not None:
            stage(graph_rows)
        if item.graph is not None:
            item.graph.replay()
            logits = self.logits[:size * e]
        else:
            logits = item.run()
        self.num_replays += 1
        return logits.index_select(0, gather)


    def _stage_mask(self, batch: ScheduleBatch, size: int, e: int) -> None:
        """Each request's ancestor mask into its `[E, E]` block (the rest of the block stays causal)."""
        trees = getattr(batch, "trees", None)
        assert trees is not None, "a chain batch replays the chain graphs"
        host = _causal(e).repeat(size, 1, 1)
        for i, parents in enumerate(trees):
            n = len(parents)
            host[i, :n, :n] = ancestor_mask(parents)
        mask = self.mask[:size * e * e]
        mask.copy_(host.reshape(-1).pin_memory() if mask.is_cuda else host.reshape(-1), non_blocking=mask.is_cuda)


def _causal(e: int) -> torch.Tensor:
    return torch.ones(e, e, dtype=torch.uint8).tril()


def make_verify_graphs(runner: ModelRunner, max_drafts: int, max_bs: int,
                       tree: bool = False) -> VerifyGraphRunner | None:
    """Verify graphs (of draft trees with `tree`) when the target replays decode graphs and its backend can capture
    extend passes (and take tree masks); None (verify eagerly) otherwise, or when capturing fails (logged)."""
    backend = runner.attn_backend
    if runner.graph_runner is None or not backend.supports_extend_graph or (tree and not backend.supports_tree_mask):
        return None
    try:
        return VerifyGraphRunner(runner, max_drafts, min(max_bs, MAX_GRAPH_BATCH), tree=tree)
    except Exception as exc:  # the engine still serves, verifying eagerly
        logger.warning("verify passes run eagerly: capturing their CUDA graphs failed (%s: %s)",
                       type(exc).__name__, exc)
        return None
