"""Plain-PyTorch references for the kernels, used by tests and the benchmark's check.

Same arguments as the launchers, one request at a time through SDPA in float32:
slow and simple, the yardstick the kernels are held to.
"""

from __future__ import annotations

import torch
from torch.nn.functional import scaled_dot_product_attention as sdpa


def attention_reference(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, qo_indptr: list[int],
                        kv_indptr: list[int], kv_indices: torch.Tensor, sm_scale: float,
                        tree_masks: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Output `[num_tokens, num_heads, head_dim]` (float32) of packed queries over pool KV.

    Request i's queries are `q[qo_indptr[i]:qo_indptr[i + 1]]`, the last ones of its
    sequence `kv_indices[kv_indptr[i]:kv_indptr[i + 1]]`; query j of n sees keys up to
    position `seq_len - n + j` (decode is n = 1: every key). `tree_masks[i]` `[n, n]` bool: query j sees
    the prefix and the new keys its row allows instead.
    """
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for i in range(len(qo_indptr) - 1):
        q_lo, q_hi = qo_indptr[i], qo_indptr[i + 1]
        slots = kv_indices[kv_indptr[i]:kv_indptr[i + 1]].long()
        new_len, seq_len = q_hi - q_lo, slots.numel()
        if new_len == 0:
            continue
        qi = q[q_lo:q_hi].float().transpose(0, 1)  # [heads, new_len, head_dim]
        ki = k_buffer[slots].float().transpose(0, 1)  # [kv_heads, seq_len, head_dim]
        vi = v_buffer[slots].float().transpose(0, 1)
        mask = torch.ones(new_len, seq_len, dtype=torch.bool, device=q.device).tril(diagonal=seq_len - new_len)
        if tree_masks is not None:
            mask[:, seq_len - new_len:] = tree_masks[i].to(q.device)
        oi = sdpa(qi, ki, vi, attn_mask=mask, scale=sm_scale, enable_gqa=qi.shape[0] != ki.shape[0])
        out[q_lo:q_hi] = oi.transpose(0, 1)
    return out


def kv_indices_reference(req_to_token: torch.Tensor, req_pool_indices: list[int],
                         seq_lens: list[int]) -> tuple[list[int], torch.Tensor]:
    """`(kv_indptr, kv_indices)` as built by `kv_store.build_kv_indices`, by slicing rows."""
    indptr = [0]
    for n in seq_lens:
        indptr.append(indptr[-1] + n)
    parts = [req_to_token[row, :n] for row, n in zip(req_pool_indices, seq_lens)]
    indices = torch.cat(parts) if parts else req_to_token.new_empty(0)
    return indptr, indices
