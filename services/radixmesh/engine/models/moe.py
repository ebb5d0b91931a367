"""The sparse mixture-of-experts MLP (Qwen3-MoE, Mixtral): a router, this rank's experts, and their sum over ranks.

On CUDA the layer is the fused Triton MoE (`radixmesh.kernels.moe.fused_moe`: routing and placement, one grouped
gate/up GEMM with SiLU-and-mul, one down GEMM, the weighted top-k sum; at a few tokens the small-batch path of
`kernels.moe_small`, as RADIXMESH_MOE_PATH allows), sized from host ints and free of host syncs, so decode steps
capture into CUDA graphs; elsewhere the PyTorch reference (`kernels.moe_ref`). FP8 experts
(`--quantization fp8`) hold e4m3 weights with one scale per output channel and expert.

Across the ranks of a tensor-parallel group each rank holds whole experts (expert parallelism) or a slice of every
expert (`models.moe_spec.ExpertLayout`); its output is a partial sum, added up by one all-reduce, or the tokens go
to their experts' ranks by all-to-all (`models.moe_dispatch`).
"""

from __future__ import annotations

import torch
from torch import nn

from radixmesh.engine.distributed.sharding import TP_NONE, TensorParallel, WeightSource
from radixmesh.engine.models.layers import AddRMSNorm, GemvSwitch
from radixmesh.engine.models.moe_runtime import MoeRuntime
from radixmesh.engine.models.moe_spec import ExpertLayout, MoeSpec
from radixmesh.kernels.fp8_ref import quantize_rows
from radixmesh.kernels.moe_ref import moe_ref, route_ref
from radixmesh.kernels.moe_routing import RouterSpec

W8A16_MAX_TOKENS = 32
"""FP8 experts take unquantized activations up to this many tokens (as `kernels.moe.fused_moe` does)."""
PROJECTIONS = ("gate", "up", "down")


class RouterGate(GemvSwitch, nn.Module):
    """The router's logits `[tokens, E]` in the activations' dtype. Not a `Linear`: FP8 leaves it unquantized, as
    published FP8 checkpoints do. At batch 1 with the prologue fusion and `fuse_qwen3_router` on (`enable_gemv`), the
    post-attention norm before it runs inside its GEMV (`forward_normed`)."""

    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))  # [E, hidden]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if x.is_cuda and x.dim() == 2 and x.shape[0] == 1 and x.is_contiguous() and x.dtype == w.dtype and \
                x.dtype in (torch.bfloat16, torch.float16):
            from radixmesh.kernels.gemv import gemv

            return gemv(x, w)
        return nn.functional.linear(x, w)

    def forward_normed(self, x: torch.Tensor, prologue: AddRMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """`(prologue(x), its logits)`: one kernel for one row where the prologue fusion is on, else the norm's
        launch and the router's."""
        fused = prologue.fused_router(self.weight, x) if self.use_gemv and self.fuse_qwen3_router else None
        if fused is not None:
            return fused
        h = prologue.apply(x)
        return h, self(h)


class FusedExperts(nn.Module):
    """This rank's experts of one layer, stacked: `w13` `[E_local, 2 * I_local, hidden]` (each expert's gate rows, then
    its up rows) and `w2` `[E_local, hidden, I_local]`; FP8 adds `w13_scale` / `w2_scale` (float32, per row)."""

    def __init__(self, layout: ExpertLayout, hidden_size: int) -> None:
        super().__init__()
        self.layout, self.hidden_size = layout, hidden_size
        local, inter = layout.num_local, layout.inter_local
        self.w13 = nn.Parameter(torch.empty(local, 2 * inter, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(local, hidden_size, inter), requires_grad=False)
        self.w13_scale: nn.Parameter | None = None
        self.w2_scale: nn.Parameter | None = None
        self.loaded: set[tuple[int, str]] = set()
        """(local expert, projection) pairs copied in by `load`."""

    @property
    def is_fp8(self) -> bool:
        return self.w13_scale is not None

    def quantize_storage(self, dtype: torch.dtype) -> None:
        """FP8 storage (`dtype`) with float32 row scales, in place of the float weights (built on the meta device)."""
        device = self.w13.device
        for name in ("w13", "w2"):
            shape = getattr(self, name).shape
            setattr(self, name, nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False))
            setattr(self, f"{name}_scale", nn.Parameter(torch.empty(shape[:2], dtype=torch.float32, device=device),
                                                        requires_grad=False))

    def load(self, expert: int, projection: str, source: WeightSource) -> bool:
        """Copy this rank's part of expert `expert`'s `projection` (gate | up `[I, hidden]`, down `[hidden, I]`);
        False, reading nothing, when the expert lives on another rank."""
        lay = self.layout
        assert projection in PROJECTIONS, f"unknown expert projection {projection!r}"
        if not 0 <= expert < lay.num_experts:
            raise ValueError(f"checkpoint has expert {expert}; the model has {lay.num_experts}")
        if not lay.is_local(expert):
            return False
        local, inter = expert - lay.expert_start, lay.inter_local
        down = projection == "down"
        want = (self.hidden_size, lay.inter_size) if down else (lay.inter_size, self.hidden_size)
        if tuple(source.shape) != want:
            raise ValueError(f"expert {expert} {projection} has shape {tuple(source.shape)}, expected {want}")
        part = source.narrow(1 if down else 0, lay.inter_begin, inter)
        rows = slice(None) if down else slice(0, inter) if projection == "gate" else slice(inter, 2 * inter)
        weight, scale = (self.w2, self.w2_scale) if down else (self.w13, self.w13_scale)
        with torch.no_grad():
            if scale is None:
                weight[local, rows].copy_(part)
            else:
                q, s = quantize_rows(part.to(weight.device), weight.dtype)
                weight[local, rows].copy_(q)
                scale[local, rows].copy_(s)
        self.loaded.add((local, projection))
        return True

    def missing(self) -> list[tuple[int, str]]:
        """(expert, projection) pairs of this rank that `load` has not filled."""
        start = self.layout.expert_start
        return [(start + e, p) for e in range(self.layout.num_local) for p in PROJECTIONS if (e, p) not in self.loaded]

    @torch.no_grad()
    def fill_dummy_fp8(self, gen: torch.Generator, std: float, dtype: torch.dtype) -> None:
        """Random weights of `dtype`, quantized per row like a checkpoint's (FP8 storage only)."""
        assert self.w13_scale is not None and self.w2_scale is not None, "fill_dummy_fp8 needs FP8 storage"
        for weight, scale in ((self.w13, self.w13_scale), (self.w2, self.w2_scale)):
            for e in range(weight.shape[0]):
                w = torch.empty(weight.shape[1:], dtype=dtype, device=weight.device).normal_(0.0, std, generator=gen)
                q, s = quantize_rows(w, weight.dtype)
                weight[e].copy_(q)
                scale[e].copy_(s)


class SparseMoeBlock(nn.Module):
    """The MoE MLP of one decoder layer: `sum_k weight_k * expert_k(x)` over each token's top-k experts."""

    def __init__(self, spec: MoeSpec, hidden_size: int, tp: TensorParallel = TP_NONE,
                 runtime: MoeRuntime | None = None) -> None:
        super().__init__()
        self.layout = ExpertLayout.of(spec, tp.rank, tp.size, tp.ep_size)
        self.gate = RouterGate(hidden_size, spec.num_experts)
        self.experts = FusedExperts(self.layout, hidden_size)
        self.router = RouterSpec(spec.top_k, "softmax", spec.renormalize)
        self.tp = tp
        self.runtime = runtime if runtime is not None else MoeRuntime(spec.num_experts)
        """Shared by the model's MoE layers (workspaces, expert-load counter, dispatch)."""

    def prepare_runtime(self) -> None:
        """Allocate the expert-load counter and, for the Triton path, the workspace of graph-sized batches now:
        before the KV pool is sized and before any CUDA-graph capture (a buffer first made inside a capture would
        be zeroed at every replay)."""
        ex, weight = self.experts, self.gate.weight
        self.runtime.load_counter(weight.device)
        if self.runtime.kernels_for(weight):
            self.runtime.workspace(self.runtime.graph_max_tokens, self.router.top_k, self.layout, ex.hidden_size,
                                   weight.dtype, ex.w13.dtype if ex.is_fp8 else None, weight.device)
            if self.runtime.block_kernel:
                self.runtime.block_workspace(self.router.top_k, self.layout, ex.hidden_size, weight.dtype,
                                             weight.device)

    def forward(self, x: torch.Tensor, prologue: AddRMSNorm | None = None) -> torch.Tensor:
        """The layer's output `[tokens, hidden]` for `x` (for `prologue(x)` with one: the post-attention norm)."""
        if prologue is not None:  # the norm, with the router at batch 1 (one kernel; or the whole block in one)
            out = self.whole_block(x, prologue)
            if out is not None:
                return out
            x, logits = self.gate.forward_normed(x, prologue)
        else:
            logits = self.gate(x)  # [tokens, E]
        if self.tp.dp_attention:  # `x`: every rank's tokens; the caller reduce-scatters the ranks' partial sums
            return self.local_experts(x, logits)
        if self.runtime.use_all_to_all(self.layout, x):
            from radixmesh.engine.models.moe_dispatch import all_to_all_moe

            return all_to_all_moe(self, x, logits)
        return self.tp.all_reduce(self.local_experts(x, logits))

    def whole_block(self, x: torch.Tensor, prologue: AddRMSNorm) -> torch.Tensor | None:
        """The block's output for one token from one persistent kernel (norm, router, top-k, experts:
        `kernels.moe_block`), where the runtime asks for it and the layer is one it runs (one rank, bf16/fp16
        experts, the batch-1 router fusion on); None elsewhere. Sets `prologue.summed` as the norm would."""
        ex, gate, residual = self.experts, self.gate, prologue.residual
        if not (self.runtime.block_kernel and self.tp.size == 1 and gate.use_gemv and gate.fuse_qwen3_router
                and self.runtime.kernels_for(x) and x.dim() == 2 and x.shape[0] == 1 and x.is_contiguous()
                and residual.is_contiguous() and residual.shape == x.shape):
            return None
        from radixmesh.kernels.moe_block import moe_block_decode, moe_block_supported

        if not moe_block_supported(x, gate.weight, ex.w13, ex.w2, self.router, w13_scale=ex.w13_scale,
                                   expert_start=self.layout.expert_start):
            return None
        ws = self.runtime.block_workspace(self.router.top_k, self.layout, ex.hidden_size, x.dtype, x.device)
        out, _, prologue.summed = moe_block_decode(
            x, residual, prologue.norm.weight, prologue.norm.eps, gate.weight, ex.w13, ex.w2, self.router, ws,
            expert_load=self.runtime.load_counter(x.device))
        return out

    def dispatch_own(self, x: torch.Tensor, num_tokens_all: int) -> torch.Tensor | None:
        """Data-parallel attention: the layer's output for this rank's own tokens `x` by all-to-all (each token to
        its experts' ranks and back), or None when this pass gathers every rank's tokens instead (the same choice
        on every rank: `num_tokens_all` is the pass's tokens over all ranks)."""
        if not self.runtime.use_all_to_all(self.layout, x, num_tokens_all):
            return None
        from radixmesh.engine.models.moe_dispatch import exchange

        return exchange(self, x, self.gate(x))

    def local_experts(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """This rank's part of the layer's output for all of `x`: its experts' weighted outputs (the others' are 0)."""
        ex, lay = self.experts, self.layout
        if self.runtime.kernels_for(x):
            from radixmesh.kernels.moe import fused_moe

            ws = self.runtime.workspace(x.shape[0], self.router.top_k, lay, ex.hidden_size, x.dtype,
                                        ex.w13.dtype if ex.is_fp8 else None, x.device)
            return fused_moe(x, logits, ex.w13, ex.w2, self.router, w13_scale=ex.w13_scale, w2_scale=ex.w2_scale,
                             expert_start=lay.expert_start, workspace=ws,
                             expert_load=self.runtime.load_counter(x.device), path=self.runtime.path)
        weights, ids = route_ref(logits, self.router.top_k, renormalize=self.router.renormalize)
        self.runtime.count(ids)
        return self.expert_outputs(x, weights, ids)

    def expert_outputs(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """`sum_k weights[m, k] * expert_{ids[m, k]}(x[m])` over this rank's experts (PyTorch: the CPU path)."""
        ex = self.experts
        return moe_ref(x, ex.w13, ex.w2, weights, ids, ex.w13_scale, ex.w2_scale,
                       fp8_activations=ex.is_fp8 and x.shape[0] > W8A16_MAX_TOKENS,
                       expert_start=self.layout.expert_start)
