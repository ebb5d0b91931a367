"""Triton attention backend: split-KV decode and prefix-aware extend over page-size-1 KV slots.

Per forward pass, `init_forward_metadata` flattens every request's slot list once
(`kv_indptr`, `kv_indices`: the prefix and the new tokens, in position order) and picks
the decode split count from host-side lengths; all layers share that plan. Per layer,
`forward` stores the new k/v into the pool, then runs the decode or extend kernel, both
reading K/V from the pool (extend reads the new tokens' own k/v rows instead where they
equal what the pool holds: same dtype, no FP8). Runs on CUDA, or on CPU under TRITON_INTERPRET=1 (slow; tests).

Decode over an FP8 pool launches with `RADIXMESH_DECODE_FP8_TILES` / `RADIXMESH_DECODE_FP8_WIDEN` when set
(`radixmesh.common.env.DecodeFp8Tuning`: tiles and widening a `bench_decode` sweep picked on this GPU).

Short extends (at most SHORT_EXTEND_MAX new tokens per request: a speculative verify pass, a prompt whose
prefix was cached but for a few tokens) run the split-KV decode kernel with a query row per new token, whose
range is a prefix of its request's slots (the new tokens' K/V are stored first, as for any pass): the extend
kernel's grid of requests x KV heads leaves most SMs idle there (8 programs for a batch-1 verify pass of the
8B shape: 33 us a layer on an H200).

Qwen3 decode passes may come raw (`forward_decode_rope`): the split kernel norms and rotates q itself and its
program holding a request's last position stores the new token's k/v, so the model launches no rotary kernel.

CUDA graphs (DECODE): `init_cuda_graph_state` allocates static index and scratch buffers
once; `init_forward_metadata_graph` plans into them with device work only, and the split
count per captured batch size is fixed from the context length (each request then uses
as many of those splits as its own length needs, decided on the device).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from radixmesh.common.env import DecodeFp8Tuning, decode_fp8_tuning
from radixmesh.engine.attention.base import AttentionBackend, AttentionLayerSpec, ForwardBatch
from radixmesh.engine.attention.dense_prefill import DENSE_PREFILL_MIN_TOKENS, DenseAttention, DensePlan, plan_dense
from radixmesh.engine.device_io import to_device
from radixmesh.kernels._checks import FP8_DTYPES
from radixmesh.kernels.decode_attention import (
    DEFAULT_MAX_KV_SPLITS,
    DecodeScratch,
    choose_num_kv_splits,
    decode_attention_fwd,
    get_num_sms,
)
from radixmesh.kernels.decode_rope import DecodeRope
from radixmesh.kernels.extend_attention import extend_attention_fwd
from radixmesh.kernels.kv_store import (
    MAX_INDPTR_BATCH,
    build_kv_indices,
    compute_kv_indptr,
    fill_kv_indices,
    store_kv,
)

if TYPE_CHECKING:
    from radixmesh.engine.memory import TokenToKVPool


logger = logging.getLogger(__name__)

_KERNEL_DEFAULTS = DecodeFp8Tuning()
SHORT_EXTEND_MAX = 8
"""Extends of at most this many new tokens per request run the decode kernel, a query row per token."""
DENSE_POOL_DTYPES = (torch.float16, torch.bfloat16)
"""KV pools whose requests may take the dense prefill path (an FP8 pool's attention must see its rounding)."""


@dataclass
class TritonForwardMetadata:
    """One pass's plan, shared by all layers."""

    kv_indptr: torch.Tensor  # [batch + 1] int64, request i's slots are kv_indices[kv_indptr[i]:kv_indptr[i + 1]]
    kv_indices: torch.Tensor  # [>= sum(seq_lens)] int64 (int32 in graphs), slots: prefix, then new tokens
    qo_indptr: torch.Tensor | None  # [batch + 1] int64, request i's new tokens (EXTEND only)
    max_extend_len: int  # most new tokens of any request (EXTEND only)
    num_kv_splits: int  # splits per request launched by decode (DECODE only)
    scratch: DecodeScratch | None = None  # decode scratch to use; None: the backend's grow-only one
    dense: DensePlan | None = None  # EXTEND: prefix-free long prompts run by cuDNN (dense_prefill.py)
    rest_map: torch.Tensor | None = None  # EXTEND with `dense`: batch rows left to the Triton kernel
    short_rows: tuple[torch.Tensor, torch.Tensor] | None = None  # short EXTEND: per new token (start, length) in
    # kv_indices, read by the decode kernel (`num_kv_splits` its splits)
    short_graph: bool = False  # short_rows planned for a graph (the static scratch)


@dataclass
class _GraphState:
    """Static buffers that captured decode graphs read and write; they live as long as the backend."""

    kv_indptr: torch.Tensor  # [max_bs + 1] int64
    kv_indices: torch.Tensor  # [max_kv_indices] int32
    scratch: DecodeScratch
    num_kv_splits: dict[int, int]  # batch size -> splits launched (fixed at capture)


class TritonBackend(AttentionBackend):
    """Attention through the kernels in `radixmesh.kernels`; same results as `TorchNativeBackend`."""

    supports_cuda_graph = True
    supports_extend_graph = True
    supports_tree_mask = True
    concurrent_passes = True  # (eager decode and eager short extends keep separate scratch)
    # graph-mode kv_indices capacity, as a multiple of the pool's slots (shared prefixes repeat slots)
    GRAPH_INDICES_PER_SLOT = 4

    def __init__(self, max_kv_splits: int = DEFAULT_MAX_KV_SPLITS, dense_min_tokens: int = 0,
                 dense: DenseAttention | None = None, fp8_tuning: DecodeFp8Tuning | None = None) -> None:
        """`dense_min_tokens`: prompts of at least this many tokens with no cached prefix run through
        `dense` (cuDNN on CUDA); 0: never (`enable_dense_prefill` sets DENSE_PREFILL_MIN_TOKENS).
        `fp8_tuning`: decode's tiles and widening over FP8 pools (default: from the environment)."""
        assert max_kv_splits >= 1, f"max_kv_splits must be >= 1, got {max_kv_splits}"
        self.max_kv_splits = max_kv_splits
        self.fp8_tuning = fp8_tuning if fp8_tuning is not None else decode_fp8_tuning()
        if not self.fp8_tuning.is_default:
            logger.info("decode attention over FP8 pools: tiles %s, widening %s", self.fp8_tuning.tiles,
                        self.fp8_tuning.widen)
        self.dense_min_tokens = dense_min_tokens
        self.dense = dense or DenseAttention()
        self.metadata: TritonForwardMetadata | None = None
        self._scratch: DecodeScratch | None = None
        self._extend_scratch: DecodeScratch | None = None  # short extends run eagerly (apart from decode's)
        self._num_sms: dict[torch.device, int] = {}
        self._graph: _GraphState | None = None
        self._short_scratch: DecodeScratch | None = None  # short extends in verify graphs (static)
        self.fuse_decode_rope = True
        """Decode passes may take the split kernel's rotary path (`--disable-decode-rope-fusion` turns it off)."""

    def enable_dense_prefill(self) -> None:
        self.dense_min_tokens = DENSE_PREFILL_MIN_TOKENS

    def warm_up(self, kv_pool: TokenToKVPool, num_heads: int, max_extend_tokens: int) -> None:
        """Build cuDNN's plans for every padded prompt length the dense path can see (~1 s on an H100)."""
        min_tokens = self.dense_min_tokens
        if min_tokens <= 0 or kv_pool.device.type != "cuda" or kv_pool.dtype not in DENSE_POOL_DTYPES:
            return  # (on a CPU there are no plans to build)
        start = time.perf_counter()
        built = self.dense.warm_up(num_heads, kv_pool.num_kv_heads, kv_pool.head_dim, kv_pool.dtype, kv_pool.device,
                                   min_tokens, max_extend_tokens)
        logger.info("dense prefill: %d attention plans ready in %.2f s", built, time.perf_counter() - start)

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        fb = forward_batch
        device = fb.seq_lens.device
        kv_indptr, kv_indices = build_kv_indices(fb.req_to_token_pool.req_to_token, fb.req_pool_indices,
                                                 fb.seq_lens, sum(fb.seq_lens_cpu))
        if fb.is_decode:
            if device not in self._num_sms:
                self._num_sms[device] = get_num_sms(device)
            num_kv_splits = choose_num_kv_splits(max(fb.batch_size, 1), fb.token_to_kv_pool.num_kv_heads,
                                                 max(fb.seq_lens_cpu, default=1), self._num_sms[device],
                                                 self.max_kv_splits)
            self.metadata = TritonForwardMetadata(kv_indptr, kv_indices, None, 0, num_kv_splits)
        else:
            qo_indptr = compute_kv_indptr(fb.extend_seq_lens)
            max_extend_len = max(fb.extend_seq_lens_cpu, default=0)
            dense, rest_map = self._plan_dense(fb, device)
            self.metadata = TritonForwardMetadata(kv_indptr, kv_indices, qo_indptr, max_extend_len, 1,
                                                  dense=dense, rest_map=rest_map)
            if dense is None and self._short(fb, max_extend_len):
                self._plan_short(fb, device)

    @staticmethod
    def _short(fb: ForwardBatch, max_extend_len: int) -> bool:
        """Whether an extend runs as decode rows (no tree mask: its tokens do not see all tokens before them)."""
        return 0 < max_extend_len <= SHORT_EXTEND_MAX and getattr(fb, "tree_mask", None) is None

    def _plan_short(self, fb: ForwardBatch, device: torch.device) -> None:
        """Each new token's (start, length) in kv_indices, from the host lengths (one copy, no sync)."""
        meta = self.metadata
        assert meta is not None
        starts: list[int] = []
        lens: list[int] = []
        offset = 0
        for seq_len, new in zip(fb.seq_lens_cpu, fb.extend_seq_lens_cpu):
            starts += [offset] * new
            lens += range(seq_len - new + 1, seq_len + 1)
            offset += seq_len
        rows = len(lens)
        packed = to_device([*starts, offset, *lens], torch.int64, device)
        if device not in self._num_sms:
            self._num_sms[device] = get_num_sms(device)
        meta.num_kv_splits = choose_num_kv_splits(rows, fb.token_to_kv_pool.num_kv_heads,
                                                  max(fb.seq_lens_cpu, default=1), self._num_sms[device],
                                                  self.max_kv_splits)
        meta.short_rows = (packed[:rows + 1], packed[rows + 1:])

    def _plan_dense(self, fb: ForwardBatch, device: torch.device) -> tuple[DensePlan | None, torch.Tensor | None]:
        if self.dense_min_tokens <= 0 or not self.dense.enabled or fb.token_to_kv_pool.dtype not in DENSE_POOL_DTYPES:
            return None, None
        plan = plan_dense(fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu, self.dense_min_tokens)
        if plan is None or not plan.rest:
            return plan, None
        return plan, to_device(plan.rest, torch.int32, device)

    def init_cuda_graph_state(self, max_bs: int, context_len: int, kv_pool: TokenToKVPool, num_heads: int) -> int:
        assert max_bs >= 1 and context_len >= 1, f"max_bs {max_bs} and context_len {context_len} must be >= 1"
        device = kv_pool.device
        num_sms = get_num_sms(device)
        splits = {bs: choose_num_kv_splits(bs, kv_pool.num_kv_heads, context_len, num_sms, self.max_kv_splits)
                  for bs in range(1, max_bs + 1)}
        max_rows = max(bs * num_heads * n for bs, n in splits.items())
        max_kv_indices = min(max_bs * context_len, max(self.GRAPH_INDICES_PER_SLOT * kv_pool.size, context_len))
        self._graph = _GraphState(
            kv_indptr=torch.zeros(max_bs + 1, dtype=torch.int64, device=device),
            kv_indices=torch.zeros(max_kv_indices, dtype=torch.int32, device=device),
            scratch=DecodeScratch(max_rows, kv_pool.head_dim, device),
            num_kv_splits=splits,
        )
        return max_kv_indices

    def init_forward_metadata_graph(self, forward_batch: ForwardBatch, batch_size: int) -> None:
        graph = self._graph
        assert graph is not None, "init_forward_metadata_graph called before init_cuda_graph_state"
        assert forward_batch.is_decode, "CUDA graphs cover DECODE passes only"
        assert batch_size in graph.num_kv_splits, f"batch size {batch_size} is beyond the graph state's max_bs"
        fb = forward_batch
        kv_indptr = graph.kv_indptr[:batch_size + 1]
        one_launch = batch_size <= MAX_INDPTR_BATCH  # the fill kernel writes kv_indptr too: one kernel, not three
        if not one_launch:
            compute_kv_indptr(fb.seq_lens, out=kv_indptr)
        fill_kv_indices(fb.req_to_token_pool.req_to_token, fb.req_pool_indices, fb.seq_lens, kv_indptr,
                        graph.kv_indices, compute_indptr=one_launch)
        self.metadata = TritonForwardMetadata(kv_indptr, graph.kv_indices, None, 0,
                                              graph.num_kv_splits[batch_size], graph.scratch)

    def init_extend_metadata_graph(self, forward_batch: ForwardBatch, extend_len: int, kv_indptr: torch.Tensor,
                                   kv_indices: torch.Tensor) -> None:
        fb = forward_batch
        assert not fb.is_decode and extend_len >= 1, f"an extend graph of {extend_len} tokens per request"
        batch = fb.req_pool_indices.shape[0]
        kv_indptr = kv_indptr[:batch + 1]
        compute_kv_indptr(fb.seq_lens, out=kv_indptr)
        fill_kv_indices(fb.req_to_token_pool.req_to_token, fb.req_pool_indices, fb.seq_lens, kv_indptr, kv_indices)
        self.metadata = TritonForwardMetadata(kv_indptr, kv_indices, compute_kv_indptr(fb.extend_seq_lens),
                                              extend_len, 1)
        if self._short(fb, extend_len):  # every request has `extend_len` tokens here: device work only
            rows = batch * extend_len
            token = torch.arange(rows, device=kv_indptr.device)
            req = token // extend_len
            starts = torch.zeros(rows + 1, dtype=kv_indptr.dtype, device=kv_indptr.device)
            starts[:rows] = kv_indptr[req]
            lens = fb.seq_lens[req] - extend_len + token % extend_len + 1
            self.metadata.short_rows = (starts, lens)
            self.metadata.num_kv_splits = self._graph_splits(fb, rows)
            self.metadata.short_graph = True

    def _graph_splits(self, fb: ForwardBatch, rows: int) -> int:
        """Decode splits of `rows` query rows in a graph: fixed by the context length (as decode graphs)."""
        device = fb.seq_lens.device
        if device not in self._num_sms:
            self._num_sms[device] = get_num_sms(device)
        return choose_num_kv_splits(rows, fb.token_to_kv_pool.num_kv_heads, fb.req_to_token_pool.req_to_token.shape[1],
                                    self._num_sms[device], self.max_kv_splits)

    def _short_graph_scratch(self, fb: ForwardBatch, rows: int, layer: AttentionLayerSpec) -> DecodeScratch:
        """The static scratch of short extends in graphs. Verify graphs run (uncaptured) the largest size first:
        it is sized then for every row count up to that one, so later captures fit and nothing moves."""
        scratch = self._short_scratch
        splits = self._graph_splits(fb, rows)
        if scratch is None or not scratch.fits(rows, layer.num_heads, layer.head_dim, splits):
            assert not (fb.seq_lens.is_cuda and torch.cuda.is_current_stream_capturing()), (
                "the short-extend scratch must grow before capture")
            need = max(n * layer.num_heads * self._graph_splits(fb, n) for n in range(1, rows + 1))
            scratch = self._short_scratch = DecodeScratch(need, layer.head_dim, fb.seq_lens.device)
        return scratch

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec,
                forward_batch: ForwardBatch, save_kv: bool = True) -> torch.Tensor:
        meta = self.metadata
        assert meta is not None, "TritonBackend.forward called before init_forward_metadata"
        num_tokens = q.shape[0]
        # [num_tokens, heads, head_dim]
        q = q.view(num_tokens, layer.num_heads, layer.head_dim)
        k = k.view(num_tokens, layer.num_kv_heads, layer.head_dim)
        v = v.view(num_tokens, layer.num_kv_heads, layer.head_dim)
        pool = forward_batch.token_to_kv_pool
        k_buf, v_buf = pool.get_kv(layer.layer_id)
        k_scale, v_scale = pool.scales(layer.layer_id)  # FP8 pools; 1.0 otherwise
        if save_kv:
            store_kv(k_buf, v_buf, forward_batch.out_cache_loc, k, v, k_scale, v_scale)
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        if meta.short_rows is not None and not forward_batch.is_decode:
            starts, lens = meta.short_rows
            rows_scratch = (self._short_graph_scratch(forward_batch, num_tokens, layer) if meta.short_graph
                            else self._decode_scratch(num_tokens, layer, meta.num_kv_splits, q.device, extend=True))
            tuning = self.fp8_tuning if k_buf.dtype in FP8_DTYPES else _KERNEL_DEFAULTS
            decode_attention_fwd(q, k_buf, v_buf, out, starts, meta.kv_indices, layer.scaling, meta.num_kv_splits,
                                 rows_scratch, k_scale, v_scale, tiles=tuning.tiles, fp8_widen=tuning.widen,
                                 kv_lens=lens)
        elif forward_batch.is_decode:
            self._decode(q, out, layer, forward_batch, (k_buf, v_buf, k_scale, v_scale))
        else:
            assert meta.qo_indptr is not None, "extend pass planned without qo_indptr"
            # k/v hold what the pool now holds for the new tokens when the dtypes agree (no FP8 rounding):
            # the kernel reads them as rows rather than gathering their slots
            k_new, v_new = (k, v) if k.dtype == k_buf.dtype else (None, None)
            dense = meta.dense if q.dtype == k_buf.dtype and forward_batch.tree_mask is None else None
            dense_out = self.dense.run(q, k, v, out, dense, layer.scaling) if dense is not None else None
            if dense_out is None:  # the Triton kernel computes every request
                tree = forward_batch.tree_mask
                extend_attention_fwd(q, k_buf, v_buf, out, meta.qo_indptr, meta.kv_indptr, meta.kv_indices,
                                     meta.max_extend_len, layer.scaling, k_scale, v_scale, k_new=k_new, v_new=v_new,
                                     custom_mask=tree.mask if tree is not None else None,
                                     mask_indptr=tree.indptr if tree is not None else None)
            else:
                out = dense_out  # (`out` itself unless one request was the whole pass)
                if meta.rest_map is not None:  # and the requests the dense plan left to it
                    assert dense is not None
                    extend_attention_fwd(q, k_buf, v_buf, out, meta.qo_indptr, meta.kv_indptr, meta.kv_indices,
                                         dense.rest_max_extend_len, layer.scaling, k_scale, v_scale,
                                         req_map=meta.rest_map, k_new=k_new, v_new=v_new)
        return out.view(num_tokens, layer.num_heads * layer.head_dim)

    def can_fuse_decode_rope(self, layer: AttentionLayerSpec, forward_batch: ForwardBatch) -> bool:
        """DECODE passes of a power-of-2 head_dim: the split kernel's `ROPE` path (`radixmesh.kernels.decode_rope`),
        unless turned off."""
        return self.fuse_decode_rope and forward_batch.is_decode and layer.head_dim & (layer.head_dim - 1) == 0

    def disable_decode_rope_fusion(self) -> None:
        self.fuse_decode_rope = False

    def decode_kv_ranges(self, forward_batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
        meta = self.metadata
        if not forward_batch.is_decode or meta is None:
            return None
        return meta.kv_indptr, meta.kv_indices

    def forward_decode_rope(self, q: torch.Tensor, layer: AttentionLayerSpec, forward_batch: ForwardBatch,
                            rope: DecodeRope) -> torch.Tensor:
        assert self.can_fuse_decode_rope(layer, forward_batch), (
            f"the fused decode rotary needs a DECODE pass and a power-of-2 head_dim, got {forward_batch.mode} "
            f"and {layer.head_dim}")
        pool = forward_batch.token_to_kv_pool
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        self._decode(q, out, layer, forward_batch, (*pool.get_kv(layer.layer_id), *pool.scales(layer.layer_id)), rope)
        return out.view(q.shape[0], layer.num_heads * layer.head_dim)

    def _decode(self, q: torch.Tensor, out: torch.Tensor, layer: AttentionLayerSpec, forward_batch: ForwardBatch,
                kv: tuple[torch.Tensor, torch.Tensor, float, float], rope: DecodeRope | None = None) -> None:
        """The split-KV decode kernel over the pass's plan, q and out `[n, heads, head_dim]`, `kv` the layer's pool
        buffers and scales (with `rope`: q raw, its rotary and the new k/v's store fused in)."""
        meta = self.metadata
        assert meta is not None, "TritonBackend decode called before init_forward_metadata"
        num_tokens = q.shape[0]
        assert num_tokens == forward_batch.batch_size, (
            f"decode expects one token per request: {num_tokens} tokens, {forward_batch.batch_size} requests")
        k_buf, v_buf, k_scale, v_scale = kv
        scratch = meta.scratch
        if scratch is None:
            scratch = self._decode_scratch(num_tokens, layer, meta.num_kv_splits, q.device)
        tuning = self.fp8_tuning if k_buf.dtype in FP8_DTYPES else _KERNEL_DEFAULTS
        decode_attention_fwd(q, k_buf, v_buf, out, meta.kv_indptr, meta.kv_indices, layer.scaling,
                             meta.num_kv_splits, scratch, k_scale, v_scale, tiles=tuning.tiles,
                             fp8_widen=tuning.widen, rope=rope)

    def _decode_scratch(self, batch: int, layer: AttentionLayerSpec, num_kv_splits: int,
                        device: torch.device, extend: bool = False) -> DecodeScratch:
        """Grow-only scratch shared by all layers (they run one after another on one stream); eager decode passes
        and eager short extends (`extend`) each have their own (they may run at once on two streams)."""
        scratch = self._extend_scratch if extend else self._scratch
        if (scratch is not None and scratch.mid_out.device == device
                and scratch.fits(batch, layer.num_heads, layer.head_dim, num_kv_splits)):
            return scratch
        rows = batch * layer.num_heads * num_kv_splits
        if scratch is not None and scratch.head_dim == layer.head_dim:
            rows = max(rows, scratch.max_rows)
        scratch = DecodeScratch(rows, layer.head_dim, device)
        if extend:
            self._extend_scratch = scratch
        else:
            self._scratch = scratch
        return scratch
