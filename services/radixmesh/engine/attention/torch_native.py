"""Reference attention backend: PyTorch SDPA over each request's gathered KV.

Simple and exact; runs on CPU and GPU and is the yardstick every kernel backend is tested
against. Prefill and mixed batches make one SDPA call per request. A decode batch (one new
token per request) gathers its requests' KV padded to the longest context and makes one
masked SDPA call per chunk of requests: per-request calls cost ~30 small ops each, which at
batch 50 over 30 layers made Python the bottleneck of CPU decoding.
"""

from __future__ import annotations

import torch
from torch.nn.functional import scaled_dot_product_attention as sdpa

from radixmesh.engine.attention.base import AttentionBackend, AttentionLayerSpec, ForwardBatch

DECODE_GATHER_BYTES = 64 << 20
"""Most bytes of padded K plus V one layer of a batched decode call gathers (larger batches are chunked)."""


class TorchNativeBackend(AttentionBackend):
    supports_tree_mask = True

    def __init__(self) -> None:
        self._req_rows: list[int] = []
        self._masks: list[torch.Tensor | None] = []
        self._decode_batched = False
        self._decode_slots: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []
        """Per chunk of a batched decode: first request, request count, slots [n, max_len] and the key mask
        [n, 1, 1, max_len]; built by the first layer of the pass. Padding reads each request's first key: a
        masked key still multiplies its value by 0, so it must be finite (the dummy slot 0 need not be)."""

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        rows = forward_batch.req_pool_indices_cpu
        self._req_rows = rows if rows is not None else forward_batch.req_pool_indices.tolist()
        self._masks = []
        device = forward_batch.input_ids.device
        tree = forward_batch.tree_mask
        for i, (prefix_len, new_len) in enumerate(zip(forward_batch.extend_prefix_lens_cpu,
                                                      forward_batch.extend_seq_lens_cpu)):
            if new_len == 1:
                self._masks.append(None)  # one query sees every key: no mask needed
                continue
            # new token j sits at position prefix_len + j and sees keys 0..prefix_len + j
            mask = torch.ones(new_len, prefix_len + new_len, dtype=torch.bool, device=device).tril(diagonal=prefix_len)
            if tree is not None:  # (a draft tree: its ancestors instead of every earlier new token)
                mask[:, prefix_len:] = tree.masks_cpu[i].to(device)
            self._masks.append(mask)
        self._decode_batched = len(self._req_rows) > 1 and all(m is None for m in self._masks)
        self._decode_slots = []

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec,
                forward_batch: ForwardBatch, save_kv: bool = True) -> torch.Tensor:
        pool = forward_batch.token_to_kv_pool
        if save_kv:
            pool.set_kv(layer.layer_id, forward_batch.out_cache_loc, k, v)
        if self._decode_batched:
            return self._decode(q, layer, forward_batch)
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

    def _decode(self, q: torch.Tensor, layer: AttentionLayerSpec, forward_batch: ForwardBatch) -> torch.Tensor:
        if not self._decode_slots:
            self._decode_slots = _decode_chunks(forward_batch, self._req_rows, q.device,
                                                2 * layer.num_kv_heads * layer.head_dim * q.element_size())
        pool = forward_batch.token_to_kv_pool
        out = torch.empty_like(q)  # [batch, heads, head_dim]
        for first, count, slots, mask in self._decode_slots:
            num_keys = slots.shape[1]
            ki, vi = pool.read(layer.layer_id, slots.reshape(-1), q.dtype)  # each [count * num_keys, kv_heads, dim]
            ki = ki.view(count, num_keys, layer.num_kv_heads, layer.head_dim).transpose(1, 2)
            vi = vi.view(count, num_keys, layer.num_kv_heads, layer.head_dim).transpose(1, 2)
            qi = q[first:first + count].unsqueeze(2)  # [count, heads, 1, head_dim]
            oi = sdpa(qi, ki, vi, attn_mask=mask, scale=layer.scaling,
                      enable_gqa=layer.num_heads != layer.num_kv_heads)
            out[first:first + count] = oi.squeeze(2)
        return out.reshape(q.shape[0], layer.num_heads * layer.head_dim)


def _decode_chunks(forward_batch: ForwardBatch, rows: list[int], device: torch.device,
                   bytes_per_key: int) -> list[tuple[int, int, torch.Tensor, torch.Tensor]]:
    """Consecutive requests grouped so that each group's padded K and V stay under DECODE_GATHER_BYTES."""
    seq_lens = forward_batch.seq_lens_cpu
    req_to_token = forward_batch.req_to_token_pool.req_to_token
    chunks = []
    first = 0
    while first < len(rows):
        count, longest = 0, 0
        while first + count < len(rows):
            longest_next = max(longest, seq_lens[first + count])
            if count and (count + 1) * longest_next * bytes_per_key > DECODE_GATHER_BYTES:
                break
            count, longest = count + 1, longest_next
        index = torch.tensor(rows[first:first + count], dtype=torch.int64, device=device)
        lens = torch.tensor(seq_lens[first:first + count], dtype=torch.int64, device=device)
        valid = torch.arange(longest, device=device)[None, :] < lens[:, None]  # [count, longest]
        slots = req_to_token[index, :longest].to(torch.int64)
        slots = torch.where(valid, slots, slots[:, :1])  # padding reads the request's own first key (masked)
        chunks.append((first, count, slots, valid[:, None, None, :]))
        first += count
    return chunks
