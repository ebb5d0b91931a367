"""Reference attention backend: PyTorch SDPA over each request's gathered KV.

Slow (one SDPA call per request) but simple and exact; runs on CPU and GPU and
is the yardstick every kernel backend is tested against.
"""

from __future__ import annotations

import torch
from torch.nn.functional import scaled_dot_product_attention as sdpa

from radixmesh.engine.attention.base import AttentionBackend, AttentionLayerSpec, ForwardBatch


class TorchNativeBackend(AttentionBackend):
    def __init__(self) -> None:
        self._req_rows: list[int] = []
        self._masks: list[torch.Tensor | None] = []

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        rows = forward_batch.req_pool_indices_cpu
        self._req_rows = rows if rows is not None else forward_batch.req_pool_indices.tolist()
        self._masks = []
        device = forward_batch.input_ids.device
        for prefix_len, new_len in zip(forward_batch.extend_prefix_lens_cpu,
                                       forward_batch.extend_seq_lens_cpu):
            if new_len == 1:
                self._masks.append(None)  # one query sees every key: no mask needed
                continue
            # new token j sits at position prefix_len + j and sees keys 0..prefix_len + j
            mask = torch.ones(new_len, prefix_len + new_len, dtype=torch.bool, device=device)
            self._masks.append(mask.tril(diagonal=prefix_len))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec,
                forward_batch: ForwardBatch, save_kv: bool = True) -> torch.Tensor:
        pool = forward_batch.token_to_kv_pool
        if save_kv:
            pool.set_kv(layer.layer_id, forward_batch.out_cache_loc, k, v)
        req_to_token = forward_batch.req_to_token_pool.req_to_token
        out = torch.empty_like(q)
        start = 0
        for i, (row, seq_len, new_len) in enumerate(zip(self._req_rows, forward_batch.seq_lens_cpu,
                                                          forward_batch.extend_seq_lens_cpu)):
            slots = req_to_token[row, :seq_len]
            qi = q[start:start + new_len].transpose(0, 1)  # [heads, new_len, head_dim]
            ki, vi = pool.read(layer.layer_id, slots, q.dtype)  # each [seq_len, kv_heads, head_dim]
            ki, vi = ki.transpose(0, 1), vi.transpose(0, 1)  # [kv_heads, seq_len, head_dim]
            oi = sdpa(qi, ki, vi, attn_mask=self._masks[i], scale=layer.scaling,
                      enable_gqa=layer.num_heads != layer.num_kv_heads)
            out[start:start + new_len] = oi.transpose(0, 1)
            start += new_len
        return out.reshape(q.shape[0], layer.num_heads * layer.head_dim)
