"""FlashInfer attention backend (optional: used when the `flashinfer` package is installed).

The KV pool is read as a paged cache with page size 1 (`[slots, 1, kv_heads, head_dim]`,
NHD layout). Plans are made once per forward pass and shared by all layers. `plan()` needs
the CSR offsets on the host: they are built there from host lengths (FlashInfer would otherwise
copy device offsets back, a sync that waits for the previous batch).
"""

from __future__ import annotations

import itertools
import os

import torch

from radixmesh.common.errors import unsupported
from radixmesh.engine.attention.base import AttentionBackend, AttentionLayerSpec, ForwardBatch
from radixmesh.kernels.kv_store import build_kv_indices, store_kv

WORKSPACE_BYTES = 256 * 1024 * 1024


class FlashInferBackend(AttentionBackend):
    def __init__(self) -> None:
        try:
            import flashinfer
        except ImportError:
            raise unsupported("attention backend 'flashinfer' needs the flashinfer package "
                              "(pip install 'radixmesh[gpu]' flashinfer-python)") from None
        self._fi = flashinfer
        self._workspace: torch.Tensor | None = None
        self._decode = None
        self._prefill = None
        self._planned_for: tuple[int, int] | None = None
        os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", os.path.expanduser("~/.cache/radixmesh"))

    def _wrappers(self, device: torch.device) -> None:
        if self._workspace is None:
            self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            self._decode = self._fi.BatchDecodeWithPagedKVCacheWrapper(self._workspace, "NHD",
                                                                       use_tensor_cores=True)
            self._prefill = self._fi.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        fb = forward_batch
        assert fb.tree_mask is None, "the flashinfer backend does not take tree masks (supports_tree_mask)"
        device = fb.seq_lens.device
        self._wrappers(device)
        _, kv_indices = build_kv_indices(fb.req_to_token_pool.req_to_token, fb.req_pool_indices,
                                         fb.seq_lens, sum(fb.seq_lens_cpu), dtype=torch.int32)
        self._meta = (fb.is_decode, _host_indptr(fb.seq_lens_cpu), kv_indices,
                      torch.ones(fb.batch_size, dtype=torch.int32),
                      None if fb.is_decode else _host_indptr(fb.extend_seq_lens_cpu))
        self._planned_for = None

    def _plan(self, layer: AttentionLayerSpec, dtype: torch.dtype) -> None:
        key = (layer.num_heads, layer.head_dim)
        if self._planned_for == key:
            return
        is_decode, kv_indptr, kv_indices, last_page_len, qo_indptr = self._meta
        common = dict(q_data_type=dtype, kv_data_type=dtype, sm_scale=layer.scaling)
        if is_decode:
            assert self._decode is not None
            self._decode.plan(kv_indptr, kv_indices, last_page_len, layer.num_heads, layer.num_kv_heads,
                              layer.head_dim, 1, **common)
        else:
            assert self._prefill is not None
            self._prefill.plan(qo_indptr, kv_indptr, kv_indices, last_page_len, layer.num_heads,
                               layer.num_kv_heads, layer.head_dim, 1, causal=True, **common)
        self._planned_for = key

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec,
                forward_batch: ForwardBatch, save_kv: bool = True) -> torch.Tensor:
        k_buf, v_buf = forward_batch.token_to_kv_pool.get_kv(layer.layer_id)
        if save_kv:
            store_kv(k_buf, v_buf, forward_batch.out_cache_loc, k, v)
        self._plan(layer, q.dtype)
        # page size 1: [slots, 1, kv_heads, head_dim]
        cache = (k_buf.unsqueeze(1), v_buf.unsqueeze(1))
        wrapper = self._decode if forward_batch.is_decode else self._prefill
        assert wrapper is not None
        out: torch.Tensor = wrapper.run(q.contiguous(), cache)
        return out.reshape(q.shape[0], layer.num_heads * layer.head_dim)


def _host_indptr(lengths: list[int]) -> torch.Tensor:
    """Exclusive prefix sum `[len + 1]` int32 on the host (pinned when CUDA is there)."""
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32,
                        pin_memory=torch.cuda.is_available())
