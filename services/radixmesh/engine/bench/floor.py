"""The bandwidth floor of batch-1 decode: the bytes one token's forward pass must read, over the device's measured
copy bandwidth (`radixmesh bench one-batch --bandwidth-floor`).

A token reads every weight once, except the embedding table (one row; all of it when the LM head shares it) and,
in an MoE layer, only the `top_k` experts it is routed to (their weights and FP8 scales). The KV cache it reads is
reported beside it (`kv_read_bytes`, at the run's mean context) but not counted in the floor, so the floor is the
weights' alone: the issue's "active experts, attention and embeddings". One rank of one device (TP 1).
"""

from __future__ import annotations

from typing import Any

from torch import nn


def decode_read_bytes(model: nn.Module) -> dict[str, int]:
    """Weight bytes one batch-1 decode token reads: `{"active_expert_bytes", "dense_bytes", "total_bytes"}`."""
    from radixmesh.engine.models.moe import FusedExperts, SparseMoeBlock

    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    experts = 0
    skip: set[int] = set()
    for module in model.modules():
        if isinstance(module, SparseMoeBlock):
            ex: FusedExperts = module.experts
            stack = [t for t in (ex.w13, ex.w2, ex.w13_scale, ex.w2_scale) if t is not None]
            per_expert = sum(t[0].numel() * t.element_size() for t in stack)
            experts += min(module.router.top_k, ex.layout.num_local) * per_expert
            skip.update(id(t) for t in stack)
    dense = 0
    for name, param in model.named_parameters():
        if id(param) in skip:
            continue
        if name.endswith("embed_tokens.weight") and not tied:
            dense += param.shape[-1] * param.element_size()  # one row
            continue
        dense += param.numel() * param.element_size()
    return {"active_expert_bytes": experts, "dense_bytes": dense, "total_bytes": experts + dense}


def bandwidth_floor(sched: Any, decode_tok_s: float, context_len: int) -> dict[str, Any]:
    """The floor of batch-1 decode on this device and how close `decode_tok_s` comes (CUDA; TP 1)."""
    runner = sched.runner
    if runner.device.type != "cuda" or sched.config.tp_size != 1:
        return {"bandwidth_floor_note": "measured on one CUDA device at --tp-size 1 only"}
    from radixmesh.kernels._bench import copy_bandwidth_tb_s

    read = decode_read_bytes(runner.model)
    copy_tb_s = copy_bandwidth_tb_s(256 << 20)  # 256 MiB: beside the KV pool, well past the L2 cache
    floor_tok_s = copy_tb_s * 1e12 / read["total_bytes"]
    kv = runner.kv_pool
    kv_per_token = sum(b[0].numel() * b.element_size() for b in (*kv.k_buffers, *kv.v_buffers))
    return {"decode_read_bytes": read, "copy_bandwidth_tb_s": round(copy_tb_s, 3),
            "bandwidth_floor_tok_s": round(floor_tok_s, 1),
            "of_bandwidth_floor": round(decode_tok_s / floor_tok_s, 4),
            "kv_read_bytes": kv_per_token * context_len}
