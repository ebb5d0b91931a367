"""Decode through captured CUDA graphs, one per bucketed batch size.

A decode step of a small model is hundreds of tiny kernels; replaying a graph turns
their launches into one. Inputs live in static buffers; a batch is padded up to the
next captured size with dummy rows (slot 0, length 1) whose outputs are discarded.

The graph of size B reads its inputs from one flat buffer laid out as rows of B:
positions, req_pool_indices, seq_lens, input_ids, gather index, then out_cache_loc. The
first five rows come from the host, padding included, in one non-blocking copy; the slots
and the previous launch's tokens are copied on the device (on CUDA by one kernel,
`radixmesh.kernels.decode_inputs`). Per step that is one host-to-device copy and one small
kernel besides the replay, and no host sync.

With LoRA adapters each size is captured twice: with the adapters' launches (reading a static
per-row slot buffer) and without them, replayed when no row of the batch uses an adapter, so a
batch of base requests pays nothing for LoRA being on.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch

from radixmesh.engine.attention.base import ForwardBatch, ForwardMode
from radixmesh.engine.batch import future_index, resolve_futures
from radixmesh.engine.device_io import copy_to_device
from radixmesh.engine.graph_capture import GraphCapture

if TYPE_CHECKING:
    from radixmesh.engine.batch import ScheduleBatch
    from radixmesh.engine.model_runner import ModelRunner

logger = logging.getLogger(__name__)

_BUCKETS = [1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160, 192, 224, 256, 320, 384, 512]
_NUM_HOST_ROWS = 5


class GraphInputs(NamedTuple):
    """Views of the flat input buffer for one captured batch size B, each `[B]` int64."""

    positions: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    input_ids: torch.Tensor
    gather: torch.Tensor
    """Index of `resolve_futures` (read only when some input is a future)."""
    out_cache_loc: torch.Tensor
    from_host: torch.Tensor
    """The first five rows `[5 * B]`: what one host-to-device copy fills."""

    @classmethod
    def of(cls, flat: torch.Tensor, bs: int) -> GraphInputs:
        """The views for batch size `bs` of a flat int64 buffer of at least `6 * bs` elements."""
        assert flat.dim() == 1 and flat.numel() >= 6 * bs, f"flat buffer of {flat.numel()} for batch size {bs}"
        positions, pool_rows, seq_lens, input_ids, gather, slots = (flat[i * bs:(i + 1) * bs] for i in range(6))
        return cls(positions, pool_rows, seq_lens, input_ids, gather, slots, flat[:_NUM_HOST_ROWS * bs])

    def head(self, bs: int) -> GraphInputs:
        """The first `bs` rows of each view (the batch's own rows, without the padding)."""
        positions, pool_rows, seq_lens, input_ids, gather, slots = (view[:bs] for view in self[:6])
        return GraphInputs(positions, pool_rows, seq_lens, input_ids, gather, slots, self.from_host)


def stage_inputs(views: GraphInputs, head: GraphInputs, batch: ScheduleBatch, prev_tokens: torch.Tensor | None,
                 req_to_token: torch.Tensor) -> None:
    """Fill a graph's input views for a DECODE batch (padded to their size; `head` is
    `views.head(len(batch.reqs))`) and record each request's new slot in `req_to_token`.
    Device work and one non-blocking copy only.

    `prev_tokens` are the previous launch's sampled tokens (the batch's future inputs).
    """
    bs, padded = len(batch.reqs), views.positions.shape[0]
    assert batch.is_decode and head.positions.shape[0] == bs <= padded, (
        f"a {batch.mode.value} batch of {bs} for graph inputs of {padded} (head of {head.positions.shape[0]})")
    pad = [0] * (padded - bs)
    futures = future_index(batch.future_rows, prev_tokens.shape[0] if prev_tokens is not None else 0)
    copy_to_device(views.from_host, [
        *batch.positions, *pad, *batch.req_pool_indices, *pad, *batch.seq_lens, *([1] * len(pad)),
        *batch.input_ids, *pad, *(futures.index if futures is not None else [0] * bs), *pad])
    if futures is not None:
        assert prev_tokens is not None, "future tokens without a previous launch"
    if views.positions.is_cuda:  # one launch for what the CPU path below does in three or four
        from radixmesh.kernels.decode_inputs import stage_decode_inputs

        stage_decode_inputs(head.input_ids, head.gather if futures is not None else None, prev_tokens,
                            batch.out_cache_loc, views.out_cache_loc, req_to_token, head.req_pool_indices,
                            head.positions)
        return
    if futures is not None and prev_tokens is not None:
        resolve_futures(head.input_ids, futures, head.gather, prev_tokens)
    head.out_cache_loc.copy_(batch.out_cache_loc)
    if pad:
        views.out_cache_loc[bs:].zero_()  # dummy rows write their k/v to slot 0
    req_to_token.index_put_((head.req_pool_indices, head.positions), head.out_cache_loc)


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
                                                            runner.layout.num_heads)
        # [6 * max_bs] int64, viewed per batch size B as 6 rows of B (see GraphInputs)
        self.flat_inputs = torch.zeros(6 * self.max_bs, dtype=torch.int64, device=self.device)
        self.inputs = {bs: GraphInputs.of(self.flat_inputs, bs) for bs in self.sizes}
        self.variants = (False, True) if runner.lora is not None else (False,)
        """Captured variants of each size: without LoRA launches, and with them when adapters may run."""
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}  # (batch size, with LoRA) -> graph
        self.outputs: dict[tuple[int, bool], torch.Tensor] = {}
        self._heads: dict[int, GraphInputs] = {}  # batch size -> its rows of its graph's inputs
        self.num_replays = 0
        self._capture_all()

    def release(self) -> None:
        """Drop every captured graph (after the device finished them). Graphs that captured NCCL collectives
        keep the group's teardown waiting (pytorch/pytorch#115388), so a tensor-parallel rank releases them
        before it leaves the group; nothing replays afterwards."""
        try:
            torch.cuda.synchronize(self.device)
        except RuntimeError as exc:  # a failed device: drop the graphs all the same
            logger.warning("releasing CUDA graphs after a device error: %s", exc)
        self.graphs.clear()
        self.outputs.clear()

    def _forward_batch(self, bs: int) -> ForwardBatch:
        r = self.runner
        views = self.inputs[bs]
        views.seq_lens.fill_(1)  # captured with dummy rows: slot 0, length 1
        for view in (views.positions, views.req_pool_indices, views.input_ids, views.out_cache_loc):
            view.zero_()
        return ForwardBatch(
            mode=ForwardMode.DECODE, input_ids=views.input_ids, positions=views.positions,
            out_cache_loc=views.out_cache_loc, req_pool_indices=views.req_pool_indices, seq_lens=views.seq_lens,
            extend_prefix_lens=views.positions, extend_seq_lens=torch.ones_like(views.seq_lens),
            req_to_token_pool=r.req_pool, token_to_kv_pool=r.kv_pool, attn_backend=r.attn_backend,
            seq_lens_cpu=[1] * bs, extend_prefix_lens_cpu=[0] * bs, extend_seq_lens_cpu=[1] * bs)

    def _capture_all(self) -> None:
        start = time.perf_counter()
        with GraphCapture() as session:
            for bs in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory
                for with_lora in self.variants:
                    run = self._make_run(self._forward_batch(bs), bs, with_lora)
                    self.graphs[bs, with_lora], self.outputs[bs, with_lora] = session.capture(run)
        logger.info("captured %d decode CUDA graphs (batch sizes up to %d%s) in %.1f s", len(self.graphs),
                    self.max_bs, ", with and without LoRA" if len(self.variants) > 1 else "",
                    time.perf_counter() - start)

    def _make_run(self, fb: ForwardBatch, bs: int, with_lora: bool) -> Callable[[], torch.Tensor]:
        backend = self.runner.attn_backend
        model = self.runner.model

        lora = self.runner.lora

        def run() -> torch.Tensor:
            if lora is not None:
                lora.bind_graph(bs, with_lora)
            backend.init_forward_metadata_graph(fb, bs)
            logits: torch.Tensor = model(fb.input_ids, fb.positions, fb)
            return logits

        return run

    def can_run(self, batch: ScheduleBatch) -> bool:
        return batch.is_decode and self.fits(len(batch.reqs), sum(batch.seq_lens))

    def fits(self, bs: int, num_kv_indices: int) -> bool:
        """Whether a graph takes `bs` rows that read `num_kv_indices` KV slots in all."""
        return bs <= self.max_bs and num_kv_indices <= self.max_kv_indices

    def replay(self, batch: ScheduleBatch, prev_tokens: torch.Tensor | None) -> torch.Tensor:
        """Logits `[batch, vocab]` of a DECODE batch (a view of the graph's output buffer).

        Also records each request's new slot in `req_to_token`, as the eager path does;
        `prev_tokens` are the previous launch's sampled tokens (the batch's future inputs).
        """
        bs = len(batch.reqs)
        padded = self.sizes[bisect.bisect_left(self.sizes, bs)]
        views = self.inputs[padded]
        head = self._heads.get(bs)
        if head is None:
            head = self._heads[bs] = views.head(bs)
        stage_inputs(views, head, batch, prev_tokens, self.runner.req_pool.req_to_token)
        key = (padded, self._stage_lora(batch, padded))
        self.graphs[key].replay()
        self.num_replays += 1
        return self.outputs[key][:bs]

    def _stage_lora(self, batch: ScheduleBatch, padded: int) -> bool:
        """Whether some row uses an adapter (then its graph's slot buffer is filled)."""
        lora = self.runner.lora
        slots = [req.lora_slot for req in batch.reqs]
        if lora is None or all(slot < 0 for slot in slots):
            return False
        lora.stage_graph(slots, padded)
        return True

    def time_replay_ms(self, bs: int, seq_len: int, iters: int = 20) -> float | None:
        """Device time of one replay for `bs` rows of `seq_len` tokens (benchmarks; it syncs);
        None when they do not fit the captured graphs.

        Dummy rows: row 0 of `req_to_token`, k/v written to the dummy slot 0 only, so no live
        KV is touched; the attention still reads `seq_len` slots per row.
        """
        if bs > self.max_bs:
            return None
        padded = self.sizes[bisect.bisect_left(self.sizes, bs)]
        seq_lens = [seq_len] * bs + [1] * (padded - bs)  # dummy rows as in a real replay
        if not self.fits(bs, sum(seq_lens)):
            return None
        views = self.inputs[padded]
        copy_to_device(views.positions, [n - 1 for n in seq_lens])
        copy_to_device(views.seq_lens, seq_lens)
        for view in (views.req_pool_indices, views.input_ids, views.out_cache_loc):
            view.zero_()
        graph = self.graphs[padded, False]
        graph.replay()  # warm
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / iters
