"""Triton attention backend: split-KV decode and prefix-aware extend over page-size-1 KV slots.

Per forward pass, `init_forward_metadata` flattens every request's slot list once
(`kv_indptr`, `kv_indices`: the prefix and the new tokens, in position order) and picks
the decode split count from host-side lengths; all layers share that plan. Per layer,
`forward` stores the new k/v into the pool, then runs the decode or extend kernel, both
reading K/V from the pool. Runs on CUDA, or on CPU under TRITON_INTERPRET=1 (slow; tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixmesh.engine.attention.base import AttentionBackend, AttentionLayerSpec, ForwardBatch
from radixmesh.kernels.decode_attention import (
    DEFAULT_MAX_KV_SPLITS,
    DecodeScratch,
    choose_num_kv_splits,
    decode_attention_fwd,
    get_num_sms,
)
from radixmesh.kernels.extend_attention import extend_attention_fwd
from radixmesh.kernels.kv_store import build_kv_indices, compute_kv_indptr, store_kv


@dataclass
class TritonForwardMetadata:
    """One pass's plan, shared by all layers."""

    kv_indptr: torch.Tensor  # [batch + 1] int64, request i's slots are kv_indices[kv_indptr[i]:kv_indptr[i + 1]]
    kv_indices: torch.Tensor  # [sum(seq_lens)] int64, KV slots, prefix then new tokens per request
    qo_indptr: torch.Tensor | None  # [batch + 1] int64, request i's new tokens (EXTEND only)
    max_extend_len: int  # most new tokens of any request (EXTEND only)
    num_kv_splits: int  # splits per request launched by decode (DECODE only)


class TritonBackend(AttentionBackend):
    """Attention through the kernels in `radixmesh.kernels`; same results as `TorchNativeBackend`."""

    def __init__(self, max_kv_splits: int = DEFAULT_MAX_KV_SPLITS) -> None:
        assert max_kv_splits >= 1, f"max_kv_splits must be >= 1, got {max_kv_splits}"
        self.max_kv_splits = max_kv_splits
        self.metadata: TritonForwardMetadata | None = None
        self._scratch: DecodeScratch | None = None
        self._num_sms: dict[torch.device, int] = {}

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
            self.metadata = TritonForwardMetadata(kv_indptr, kv_indices, qo_indptr, max_extend_len, 1)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec,
                forward_batch: ForwardBatch) -> torch.Tensor:
        meta = self.metadata
        assert meta is not None, "TritonBackend.forward called before init_forward_metadata"
        num_tokens = q.shape[0]
        # [num_tokens, heads, head_dim]
        q = q.view(num_tokens, layer.num_heads, layer.head_dim)
        k = k.view(num_tokens, layer.num_kv_heads, layer.head_dim)
        v = v.view(num_tokens, layer.num_kv_heads, layer.head_dim)
        k_buf, v_buf = forward_batch.token_to_kv_pool.get_kv(layer.layer_id)
        store_kv(k_buf, v_buf, forward_batch.out_cache_loc, k, v)
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        if forward_batch.is_decode:
            assert num_tokens == forward_batch.batch_size, (
                f"decode expects one token per request: {num_tokens} tokens, {forward_batch.batch_size} requests")
            scratch = self._decode_scratch(num_tokens, layer, meta.num_kv_splits, q.device)
            decode_attention_fwd(q, k_buf, v_buf, out, meta.kv_indptr, meta.kv_indices, layer.scaling,
                                 meta.num_kv_splits, scratch)
        else:
            assert meta.qo_indptr is not None, "extend pass planned without qo_indptr"
            extend_attention_fwd(q, k_buf, v_buf, out, meta.qo_indptr, meta.kv_indptr, meta.kv_indices,
                                 meta.max_extend_len, layer.scaling)
        return out.view(num_tokens, layer.num_heads * layer.head_dim)

    def _decode_scratch(self, batch: int, layer: AttentionLayerSpec, num_kv_splits: int,
                        device: torch.device) -> DecodeScratch:
        """Grow-only scratch shared by all layers (they run one after another on one stream)."""
        scratch = self._scratch
        if (scratch is not None and scratch.mid_out.device == device
                and scratch.fits(batch, layer.num_heads, layer.head_dim, num_kv_splits)):
            return scratch
        rows = batch * layer.num_heads * num_kv_splits
        if scratch is not None and scratch.head_dim == layer.head_dim:
            rows = max(rows, scratch.max_rows)
        self._scratch = DecodeScratch(rows, layer.head_dim, device)
        return self._scratch
