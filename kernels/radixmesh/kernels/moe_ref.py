"""Mixture-of-experts in plain PyTorch: the router's top-k and a loop over experts.

The reference the Triton MoE kernels (`moe_routing`, `moe_gemm`, `moe.fused_moe`) are tested against, and a
CPU path for models. It rounds where the kernels round: the gate/up output after SiLU-and-mul and each
expert's down output are stored in the activations' dtype; everything else is float32. Ties in the router's
scores go to the lower expert index. Importing this module compiles no kernel.
"""

from __future__ import annotations

import torch

from radixmesh.kernels.fp8_ref import quantize_rows

SCORINGS = ("softmax", "sigmoid")


def route_ref(logits: torch.Tensor, top_k: int, scoring: str = "softmax", renormalize: bool = True,
              routed_scaling_factor: float = 1.0,
              correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`(weights [M, top_k] float32, ids [M, top_k] int32)` of router `logits` `[M, E]`.

    Scores are the softmax or the sigmoid of the logits; experts are chosen by score (plus
    `correction_bias` `[E]` where given, as DeepSeek-V3 selects), highest first, ties to the lower
    index; weights are the chosen experts' scores, divided by their sum when `renormalize`, then
    multiplied by `routed_scaling_factor`.
    """
    assert scoring in SCORINGS, f"scoring must be one of {SCORINGS}, got {scoring!r}"
    assert 1 <= top_k <= logits.shape[-1], f"top_k {top_k} outside [1, {logits.shape[-1]}]"
    x = logits.float()
    scores = x.softmax(dim=-1) if scoring == "softmax" else x.sigmoid()  # [M, E]
    select = scores if correction_bias is None else scores + correction_bias.float()[None, :]
    ids = torch.sort(select, dim=-1, descending=True, stable=True).indices[:, :top_k]  # [M, top_k]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * routed_scaling_factor, ids.to(torch.int32)


def expert_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None,
                  fp8_activations: bool) -> torch.Tensor:
    """`x @ W.T` in float32 for one expert: `weight` `[N, K]` in `x`'s dtype, or FP8 with `scale` `[N]`
    (read as `fp8 * scale`), the activations then quantized per row first when `fp8_activations`."""
    if scale is None:
        return x.float() @ weight.float().t()
    if fp8_activations:
        xq, xs = quantize_rows(x, weight.dtype)
        return (xq.float() @ weight.float().t()) * xs[:, None] * scale.float()[None, :]
    return (x.float() @ weight.float().t()) * scale.float()[None, :]


def moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
            topk_ids: torch.Tensor, w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
            fp8_activations: bool = False, expert_start: int = 0) -> torch.Tensor:
    """`sum_k topk_weights[m, k] * expert_{topk_ids[m, k]}(x[m])` as `[M, H]` in `x`'s dtype.

    `x` `[M, H]`; `w13` `[E, 2I, H]` (each expert's gate rows, then its up rows); `w2` `[E, H, I]`;
    an expert computes `down(silu(gate(x)) * up(x))`. FP8 experts carry `w13_scale` `[E, 2I]` and
    `w2_scale` `[E, H]`. Only experts `expert_start .. expert_start + E - 1` are here (the rest live on
    other ranks): assignments to others add nothing.
    """
    assert x.dim() == 2 and w13.dim() == 3 and w2.dim() == 3, "x [M, H], w13 [E, 2I, H], w2 [E, H, I]"
    inter = w2.shape[2]
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    for e in range(w13.shape[0]):
        rows, slots = torch.nonzero(topk_ids == e + expert_start, as_tuple=True)
        if rows.numel() == 0:
            continue
        h = expert_linear(x[rows], w13[e], None if w13_scale is None else w13_scale[e], fp8_activations)
        gate, up = h[:, :inter], h[:, inter:]
        act = (torch.nn.functional.silu(gate) * up).to(x.dtype)  # [n, I], stored in x's dtype as the kernel does
        y = expert_linear(act, w2[e], None if w2_scale is None else w2_scale[e], fp8_activations).to(x.dtype)
        out.index_add_(0, rows, topk_weights[rows, slots].float()[:, None] * y.float())
    return out.to(x.dtype)
