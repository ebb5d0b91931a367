"""One request's prefill through a captured CUDA graph, one graph per bucketed number of new tokens.

An eager prefill launches about ten kernels a layer from Python. On the GPU hosts measured each launch costs
60-97 us of host time (H200, `scripts/prefill_host_probe.py`), so an 8B prefill's launches take ~20 ms whatever
its length: at 512 tokens 20.3 ms of launches for 11.1 ms of device work (`bench one-batch --profile-prefill`,
docs/benchmarks/h200-prefill-profile-2026-11-29.jsonl). Up to ~1,000 tokens the device waits for the host, and a
short prompt's time to first token is mostly launches. A graph launches the whole pass at once.

Graphs are captured for one request of E new tokens, E in `graph_lengths(max_tokens)`. A pass of one request
whose n new tokens (after any cached prefix) fit replays the smallest E >= n:
- its n tokens fill the first n rows; the other E - n rows are padding (token 0, position 0, KV slot 0, the slot
  no request owns);
- its own lengths are staged on the device (seq_len = prefix + n, new tokens n), so the KV index list, the
  attention plan and the logits row are the eager pass's;
- padding rows belong to no request: attention computes none of them, and every other kernel of a dense layer
  works row by row, so they never reach a real row; their K/V land in slot 0.
The real rows run the same kernels as eagerly; only the GEMM library may pick another kernel for E rows than for n
(bf16 rounding apart, the same logits).

Per replay: one host-to-device copy (ids, positions, the request's row and lengths), the new tokens' slots copied
on the device, the replay. Not taken: several requests in one pass, prompt log-probs, inputs that are the previous
step's tokens, fewer than SHORT_EXTEND_MAX + 1 new tokens (the decode kernel's path), MoE models, LoRA, multimodal
models, tensor or data parallelism, speculative decoding (those passes stay eager).

Measured on an H200 (8B shape, SGLang's text workload at 1 req/s through `serve`, the tree without graphs in the
same call; docs/benchmarks/README.md, 2026-11-30g): prompts under 1,536 tokens reached their first token 16.7 ms
sooner (median per request; 0.3-0.7 ms for longer ones), the 500-prompt offline run +1.0%, batch 1 unchanged.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from radixmesh.engine import plain_runner
from radixmesh.engine.attention.base import ForwardBatch, ForwardMode
from radixmesh.engine.attention.triton_backend import SHORT_EXTEND_MAX
from radixmesh.engine.batch import ScheduleBatch
from radixmesh.engine.device_io import copy_to_device
from radixmesh.engine.graph_capture import GraphCapture

if TYPE_CHECKING:
    from radixmesh.engine.model_runner import ModelRunner

logger = logging.getLogger(__name__)

MIN_GRAPH_TOKENS = SHORT_EXTEND_MAX + 1
"""Fewer new tokens run the decode kernel a row per token (triton_backend), planned on the host: eager."""


def graph_lengths(max_tokens: int) -> list[int]:
    """New-token counts captured, up to `max_tokens`: 16, 24, 32, 48, 64, ... (each at most 1.5x the one before, so
    padding adds at most half a bucket's rows) and `max_tokens` itself; empty when it is below 16."""
    lengths: list[int] = []
    n = 16
    while n < max_tokens:
        lengths.append(n)
        n = n * 3 // 2 if n & (n - 1) == 0 else n // 3 * 4  # 16, 24, 32, 48, 64, 96, ...
    if max_tokens >= 16:
        lengths.append(max_tokens)
    return lengths


@dataclass
class _Graph:
    run: Callable[[], torch.Tensor]
    """The pass over the static buffers (what the graph captured; run as it is without a graph)."""
    logits: torch.Tensor
    """`[1, vocab]` float32: the request's next-token logits (the pass's output)."""
    graph: torch.cuda.CUDAGraph | None = None


class PrefillGraphRunner:
    """Captures and replays one-request prefills; `fits(batch)` says which batches it takes."""

    def __init__(self, runner: ModelRunner, max_tokens: int, capture: bool = True) -> None:
        """`capture=False`: the same static-buffer passes run eagerly (CPU tests)."""
        backend = runner.attn_backend
        assert backend.supports_extend_graph, f"{type(backend).__name__} cannot capture extend passes"
        self.runner = runner
        self.lengths = graph_lengths(max_tokens)
        assert self.lengths, f"no prefill graph length up to {max_tokens} tokens (the least is 16)"
        top = self.lengths[-1]
        device = runner.device
        self.max_seq_len = runner.req_pool.max_context_len
        # ids [top], positions [top], then the request's row, seq_len, new tokens: viewed per graph, one copy
        self.flat = torch.zeros(2 * top + 3, dtype=torch.int64, device=device)
        self.out_cache_loc = torch.zeros(top, dtype=torch.int64, device=device)
        self.kv_indptr = torch.zeros(2, dtype=torch.int64, device=device)
        self.kv_indices = torch.zeros(self.max_seq_len, dtype=torch.int32, device=device)
        self.graphs: dict[int, _Graph] = {}
        self.num_replays = 0
        start = time.perf_counter()
        self._build_all(capture)
        if capture:
            logger.info("captured %d prefill CUDA graphs (one request, %d-%d new tokens) in %.1f s", len(self.graphs),
                        self.lengths[0], top, time.perf_counter() - start)

    def _views(self, e: int) -> tuple[torch.Tensor, ...]:
        """ids `[e]`, positions `[e]`, the request's row, seq_len and new tokens `[1]` each, and all of them."""
        f = self.flat
        return f[:e], f[e:2 * e], f[2 * e:2 * e + 1], f[2 * e + 1:2 * e + 2], f[2 * e + 2:2 * e + 3], f[:2 * e + 3]

    def _make(self, e: int) -> _Graph:
        """The pass over the static buffers for `e` rows (captured with a dummy request: row 0, `e` tokens)."""
        r = self.runner
        device = r.device
        ids, positions, row, seq_len, new_tokens, _ = self._views(e)
        ids.zero_()
        positions.copy_(torch.arange(e, device=device))
        row.zero_()
        seq_len.fill_(e)
        new_tokens.fill_(e)
        out_cache_loc = self.out_cache_loc[:e]
        out_cache_loc.zero_()
        fb = ForwardBatch(
            mode=ForwardMode.EXTEND, input_ids=ids, positions=positions, out_cache_loc=out_cache_loc,
            req_pool_indices=row, seq_lens=seq_len,
            extend_prefix_lens=torch.zeros(1, dtype=torch.int64, device=device),  # read by no backend in graphs
            extend_seq_lens=new_tokens, req_to_token_pool=r.req_pool, token_to_kv_pool=r.kv_pool,
            attn_backend=r.attn_backend, seq_lens_cpu=[e], extend_prefix_lens_cpu=[0], extend_seq_lens_cpu=[e])
        logits = torch.zeros(1, r.model_config.vocab_size, dtype=torch.float32, device=device)

        def run() -> torch.Tensor:
            r.attn_backend.init_extend_metadata_graph(fb, e, self.kv_indptr, self.kv_indices)
            return logits.copy_(r.model(fb.input_ids, fb.positions, fb))

        return _Graph(run, logits)

    def _build_all(self, capture: bool) -> None:
        if not capture:
            self.graphs = {e: self._make(e) for e in self.lengths}
            return
        with GraphCapture() as session:
            for e in reversed(self.lengths):  # largest first: the smaller ones reuse its memory
                item = self.graphs[e] = self._make(e)
                item.graph = session.capture(item.run)[0]

    def length(self, batch: ScheduleBatch) -> int | None:
        """The captured length that takes `batch`, or None (it runs eagerly)."""
        if batch.is_decode or len(batch.reqs) != 1 or batch.future_rows:
            return None
        if batch.prompt_logprobs is not None and batch.prompt_logprobs.rows:
            return None
        n = batch.extend_lens[0]
        if n < MIN_GRAPH_TOKENS or n > self.lengths[-1] or batch.prefix_lens[0] + n > self.max_seq_len:
            return None
        return self.lengths[bisect.bisect_left(self.lengths, n)]

    def replay(self, batch: ScheduleBatch, e: int) -> torch.Tensor:
        """Float32 logits `[1, vocab]` of the request's last new token (a view of the graph's output buffer)."""
        n, prefix = batch.extend_lens[0], batch.prefix_lens[0]
        host = self._views(e)[-1]
        pad = [0] * (e - n)
        copy_to_device(host, [*batch.input_ids, *pad, *batch.positions, *pad, batch.req_pool_indices[0], prefix + n,
                              n])
        out_cache_loc = self.out_cache_loc[:e]
        out_cache_loc[n:].zero_()  # padding writes its K/V to slot 0
        out_cache_loc[:n].copy_(batch.out_cache_loc)
        item = self.graphs[e]
        if item.graph is not None:
            item.graph.replay()
        else:
            item.run()
        self.num_replays += 1
        return item.logits


def prefill_graph_refusal(runner: ModelRunner) -> str | None:
    """Why this runner captures no prefill graphs (None: it may)."""
    if not runner.attn_backend.supports_extend_graph:
        return f"the {type(runner.attn_backend).__name__} backend captures no extend passes"
    return plain_runner.refusal(runner)


def make_prefill_graphs(runner: ModelRunner) -> PrefillGraphRunner | None:
    """Prefill graphs up to `--prefill-graph-max-tokens` new tokens when the runner can replay them (None: every
    prefill eager; also when capturing fails, logged)."""
    config = runner.config  # no pass holds more new tokens than the prefill budget (the chunk) or the context
    max_tokens = min(config.prefill_graph_max_tokens, config.prefill_token_budget, runner.context_len - 1)
    if max_tokens < 16:
        return None
    refusal = prefill_graph_refusal(runner)
    if refusal is not None:
        logger.info("prefills run eagerly: %s", refusal)
        return None
    try:
        return PrefillGraphRunner(runner, max_tokens)
    except Exception as exc:  # the engine still serves, prefilling eagerly
        logger.warning("prefills run eagerly: capturing their CUDA graphs failed (%s: %s)", type(exc).__name__, exc)
        return None
