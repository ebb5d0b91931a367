"""A fused MoE layer: route, place by expert, gate/up GEMM with SiLU-and-mul, down GEMM, weighted top-k sum.

    out = fused_moe(x, router_logits, w13, w2, RouterSpec(top_k=8, renormalize=True), workspace=ws)

Launches, all sized from host ints (the token count, the config's block rows), none syncing with the host,
so a decode step captures in a CUDA graph over a `MoeWorkspace` allocated for its largest batch: the
routing (one launch up to `route_rows(E)` tokens, two above), the gate/up GEMM, the down GEMM and the
combine; FP8 weights with quantized activations (W8A8) add the two per-token quantizations. Up to
`SMALL_MAX_TOKENS` tokens the layer takes the small-batch path instead (`moe_small`: top-k, gate/up and down,
three launches, nothing sorted); `path` forces either. The reference is `moe_ref.moe_ref`; `bench_moe` times
the layer (and both paths) at the Qwen3-30B-A3B and Mixtral-8x7B shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixmesh.kernels._checks import check_device, check_float, check_last_dim_contiguous
from radixmesh.kernels.fp8_quant import quantize_rows
from radixmesh.kernels.moe_config import MoeConfig, SmallMoeConfig, default_config, dtype_key, small_default_config
from radixmesh.kernels.moe_gemm import moe_combine, moe_down, moe_gate_up
from radixmesh.kernels.moe_routing import RouterSpec, RoutingBuffers, route_align
from radixmesh.kernels.moe_small import RouteInputs, small_down, small_gate_up, small_topk

W8A16_MAX_TOKENS = 32
"""Up to this many tokens FP8 experts run with unquantized activations (W8A16) unless told otherwise: the
batch is memory-bound there and the two quantization launches would only add time."""
MOE_PATHS = ("auto", "small", "sorted")
"""How `fused_moe` runs: `small` (per-assignment GEMVs, `moe_small`), `sorted` (placement by expert and grouped
GEMMs), or `auto`: small up to `SMALL_MAX_TOKENS` tokens (W8A8 layers always sorted)."""
SMALL_MAX_TOKENS = 8
"""Most tokens `auto` takes the small-batch path for: FP8 (W8A16) experts up to this many, 16-bit ones while the
assignments cover at most half the experts (`M * top_k * 2 <= E`). `bench_moe_small` on an H200 (small / sorted
layer time): Qwen3-30B-A3B bf16 1.96x at M=1, 1.55x at 2, 1.36x at 4, 1.17x at 8, 0.99x at 16; Mixtral-8x7B bf16
1.15x at 1, 0.96x at 2, 1.01x at 4, 0.83x at 8; FP8 W8A16 1.22-2.36x up to 8 at both shapes, 0.68-1.07x at 16."""


@dataclass(frozen=True)
class MoeWorkspace:
    """Every buffer `fused_moe` writes, for batches of up to `max_tokens` tokens and blocks of up to `max_block_m`
    rows, allocated once (a CUDA graph of a decode step replays over the same buffers)."""

    routing: RoutingBuffers
    inter: torch.Tensor  # [max padded rows, I]: silu(gate) * up, by sorted position
    y: torch.Tensor  # [max_tokens * top_k, H]: each assignment's expert output
    x_fp8: tuple[torch.Tensor, torch.Tensor] | None  # W8A8: ([max_tokens, H] fp8, [max_tokens] scales)
    inter_fp8: tuple[torch.Tensor, torch.Tensor] | None  # W8A8: ([max padded rows, I] fp8, [max padded rows])

    @classmethod
    def allocate(cls, max_tokens: int, top_k: int, num_experts: int, num_local: int, hidden: int, inter: int,
                 dtype: torch.dtype, device: torch.device, max_block_m: int = 128,
                 fp8_dtype: torch.dtype | None = None) -> MoeWorkspace:
        """Buffers for `num_local` experts of `num_experts`; `fp8_dtype` adds those of W8A8 layers."""
        routing = RoutingBuffers.allocate(max_tokens, top_k, num_experts, num_local, max_block_m, device)
        rows = routing.sorted_ids.shape[0]
        x_fp8 = inter_fp8 = None
        if fp8_dtype is not None:
            x_fp8 = (torch.empty(max_tokens, hidden, dtype=fp8_dtype, device=device),
                     torch.empty(max_tokens, dtype=torch.float32, device=device))
            inter_fp8 = (torch.empty(rows, inter, dtype=fp8_dtype, device=device),
                         torch.empty(rows, dtype=torch.float32, device=device))
        # zeros: padding rows are never used, but W8A8 quantizes them whole (finite values, no NaN warnings)
        return cls(routing, torch.zeros(rows, inter, dtype=dtype, device=device),
                   torch.empty(max_tokens * top_k, hidden, dtype=dtype, device=device), x_fp8, inter_fp8)


def fused_moe(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, spec: RouterSpec, *,
              w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
              correction_bias: torch.Tensor | None = None, expert_start: int = 0,
              fp8_activations: bool | None = None, config: MoeConfig | None = None,
              workspace: MoeWorkspace | None = None, out: torch.Tensor | None = None,
              expert_load: torch.Tensor | None = None, path: str = "auto",
              small_config: SmallMoeConfig | None = None) -> torch.Tensor:
    """The MoE layer's output `[M, H]` (x's dtype) for tokens `x` `[M, H]` and `router_logits` `[M, E]`.

    `w13` `[E_local, 2I, H]` holds each expert's gate rows then up rows, `w2` `[E_local, H, I]`; both in `x`'s
    dtype, or FP8 with `w13_scale` `[E_local, 2I]` and `w2_scale` `[E_local, H]` (float32, per output channel).
    The local experts are `expert_start .. expert_start + E_local - 1` of E: under expert parallelism each rank
    passes its own and the ranks' outputs sum to the layer's. `fp8_activations` picks W8A8 (True) or W8A16
    (False) for FP8 experts; None: W8A16 up to `W8A16_MAX_TOKENS` tokens. `config` overrides the tiles.
    `expert_load` `[E]` (int64) gets each expert's assignments added (see `route_align`). `path` is one of
    `MOE_PATHS`; `small_config` overrides the small-batch path's tiles.
    """
    assert x.dim() == 2, f"x must be [M, H], got {tuple(x.shape)}"
    check_float("x", x)
    check_last_dim_contiguous("x", x)
    m, hidden = x.shape
    assert w13.dim() == 3 and w13.shape[1] % 2 == 0, f"w13 must be [E_local, 2I, H], got {tuple(w13.shape)}"
    num_local, inter = w13.shape[0], w13.shape[1] // 2
    assert router_logits.dim() == 2 and router_logits.shape[0] == m, (
        f"router_logits must be [{m}, E], got {tuple(router_logits.shape)}")
    check_device("router_logits", router_logits, x.device)
    assert (w13_scale is None) == (w2_scale is None), "FP8 experts need both w13_scale and w2_scale"
    fp8 = w13_scale is not None
    a8 = fp8 and (fp8_activations if fp8_activations is not None else m > W8A16_MAX_TOKENS and path != "small")
    num_experts = router_logits.shape[1]
    if takes_small_path(m, a8, path, top_k=spec.top_k, num_experts=num_experts, fp8_weights=fp8):
        return _small_path(x, router_logits, w13, w2, spec, w13_scale, w2_scale, correction_bias, expert_start,
                           small_config, workspace, out, expert_load)
    cfg = config or default_config(num_local, inter, hidden, dtype_key(x.dtype, fp8, a8), m, spec.top_k, x.device)
    if workspace is None:
        workspace = MoeWorkspace.allocate(max(m, 1), spec.top_k, num_experts, num_local, hidden, inter, x.dtype,
                                          x.device, cfg.block_m, w13.dtype if a8 else None)
    _check_workspace(workspace, x, inter, a8)
    al = route_align(router_logits, spec, cfg.block_m, workspace.routing, correction_bias=correction_bias,
                     expert_start=expert_start, num_local=num_local, expert_load=expert_load)
    rows = al.num_blocks * al.block_m
    y = workspace.y[:m * spec.top_k]
    if a8:
        assert workspace.x_fp8 is not None and workspace.inter_fp8 is not None
        xq, xs = quantize_rows(x, w13.dtype, out=workspace.x_fp8[0][:m], scale=workspace.x_fp8[1][:m])
        moe_gate_up(xq, al, w13, cfg.up, workspace.inter[:rows], x_scale=xs, w13_scale=w13_scale)
        iq, i_s = quantize_rows(workspace.inter[:rows], w2.dtype, out=workspace.inter_fp8[0][:rows],
                                scale=workspace.inter_fp8[1][:rows])
        moe_down(iq, al, w2, cfg.down, y, inter_scale=i_s, w2_scale=w2_scale)
    else:
        moe_gate_up(x, al, w13, cfg.up, workspace.inter[:rows], w13_scale=w13_scale)
        moe_down(workspace.inter[:rows], al, w2, cfg.down, y, w2_scale=w2_scale)
    return moe_combine(y, al, out)


def takes_small_path(num_tokens: int, fp8_activations: bool, path: str = "auto", *, top_k: int = 1,
                     num_experts: int = 2, fp8_weights: bool = False) -> bool:
    """Whether `fused_moe` runs `num_tokens` tokens on the small-batch path (see `MOE_PATHS`, `SMALL_MAX_TOKENS`):
    each assignment reads its expert's weights on its own, which pays while few assignments share an expert."""
    assert path in MOE_PATHS, f"path must be one of {MOE_PATHS}, got {path!r}"
    if path == "small":
        assert not fp8_activations, "the small-batch path runs FP8 experts as W8A16 only (fp8_activations=False)"
        return True
    if path != "auto" or fp8_activations or num_tokens > SMALL_MAX_TOKENS:
        return False
    return fp8_weights or num_tokens * top_k * 2 <= num_experts


def _small_path(x: torch.Tensor, logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, spec: RouterSpec,
                w13_scale: torch.Tensor | None, w2_scale: torch.Tensor | None, correction_bias: torch.Tensor | None,
                expert_start: int, cfg: SmallMoeConfig | None, workspace: MoeWorkspace | None,
                out: torch.Tensor | None, expert_load: torch.Tensor | None) -> torch.Tensor:
    """The layer on the small-batch path, over the workspace's top-k and intermediate buffers."""
    m, hidden = x.shape
    num_local, inter, num_experts = w13.shape[0], w13.shape[1] // 2, logits.shape[1]
    assert expert_start >= 0 and expert_start + num_local <= num_experts, (
        f"local experts [{expert_start}, {expert_start + num_local}) outside the {num_experts} experts")
    assert w2.dim() == 3 and tuple(w2.shape) == (num_local, hidden, inter), (
        f"w2 must be [{num_local}, {hidden}, {inter}] (local experts, H, I), got {tuple(w2.shape)}")
    cfg = cfg or small_default_config(num_local, inter, hidden, spec.top_k,
                                      dtype_key(x.dtype, w13_scale is not None, False), x.device)
    if workspace is None:
        workspace = MoeWorkspace.allocate(max(m, 1), spec.top_k, num_experts, num_local, hidden, inter, x.dtype,
                                          x.device, 1)
    _check_workspace(workspace, x, inter, False)
    routing = workspace.routing
    assert routing.topk_ids.shape[0] >= m and routing.topk_ids.shape[1] == spec.top_k, (
        f"buffers hold {tuple(routing.topk_ids.shape)} top-k ids, the batch needs [{m}, {spec.top_k}]")
    assert workspace.inter.shape[0] >= m * spec.top_k, "workspace.inter holds too few rows"
    if out is None:
        out = torch.empty(m, hidden, dtype=x.dtype, device=x.device)
    ids, weights = routing.topk_ids[:m], routing.topk_weights[:m]
    route = RouteInputs(logits, spec, weights, correction_bias, expert_load)
    if not cfg.fuse_topk:
        small_topk(logits, spec, ids, weights, correction_bias=correction_bias, expert_load=expert_load)
    act = workspace.inter[:m * spec.top_k]
    small_gate_up(x, ids, w13, cfg.up, act, w13_scale=w13_scale, expert_start=expert_start,
                  route=route if cfg.fuse_topk else None)
    return small_down(act, ids, weights, w2, cfg.down, out, w2_scale=w2_scale, expert_start=expert_start)


def _check_workspace(ws: MoeWorkspace, x: torch.Tensor, inter: int, a8: bool) -> None:
    assert ws.inter.dtype == x.dtype and ws.inter.shape[1] == inter, (
        f"workspace holds {ws.inter.dtype} [*, {ws.inter.shape[1]}] intermediates, the layer needs {x.dtype} "
        f"[*, {inter}]")
    assert ws.y.shape[1] == x.shape[1] and ws.y.dtype == x.dtype, "workspace.y does not match x's width or dtype"
    assert not a8 or ws.x_fp8 is not None, "W8A8 needs a workspace allocated with fp8_dtype"
    if ws.x_fp8 is not None:
        assert ws.x_fp8[0].shape[0] >= x.shape[0], "workspace's FP8 activations hold too few rows"

