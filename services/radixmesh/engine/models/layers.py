"""Building blocks shared by the decoder models: RMSNorm, rotary embedding, gated MLP.

On CUDA each block is one fused Triton launch (`radixmesh.kernels.fused`); elsewhere the
PyTorch ops below, which the kernels match rounding step for rounding step.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch
from torch import nn


def _fused(x: torch.Tensor) -> bool:
    return x.is_cuda


def _kernels() -> Any:
    # imported on first CUDA use: CPU processes never load Triton for these layers
    from radixmesh.kernels import fused

    return fused


def _kernels_fp8() -> Any:
    from radixmesh.kernels import fp8_fused

    return fp8_fused


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _fused(x) and x.dim() == 2:
            return _kernels().rms_norm(x, self.weight, self.eps)[0]
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(norm(x + residual), x + residual)`: the residual add fused into the norm."""
        if _fused(x):
            normed, summed = _kernels().rms_norm(x, self.weight, self.eps, residual)
            assert summed is not None
            return normed, summed
        summed = x + residual
        return self.forward(summed), summed


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2], with llama3 or linear scaling when configured."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type")
    if not scaling or kind in (None, "default"):
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"unsupported rope scaling {kind!r}")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept; the band between is blended.
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(is_mid, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) rotary embedding with a precomputed cos/sin cache."""

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None) -> None:
        super().__init__()
        self.head_dim, self.max_positions = head_dim, max_positions
        self.theta, self.scaling = theta, scaling
        self.register_buffer("cos_cache", torch.empty(0), persistent=False)
        self.register_buffer("sin_cache", torch.empty(0), persistent=False)
        self.init_buffers()

    def init_buffers(self) -> None:
        """(Re)compute the float32 cos/sin cache on the module's device, e.g. after `to_empty`."""
        device = self.get_buffer("cos_cache").device
        if device.type == "meta":
            return
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling).to(device)
        t = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        freqs = torch.outer(t, inv_freq)  # [max_positions, head_dim // 2]
        self.cos_cache = freqs.cos()
        self.sin_cache = freqs.sin()

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [num_tokens, heads, head_dim]; k: [num_tokens, kv_heads, head_dim]
        if _fused(q):  # in place: q and k may be views of the layer's fused qkv output
            _kernels().apply_rotary_(q, k, positions, self.cos_cache, self.sin_cache)
            return q, k
        cos = self.cos_cache[positions].unsqueeze(1)  # [num_tokens, 1, head_dim // 2]
        sin = self.sin_cache[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def can_store_kv(self, q: torch.Tensor) -> bool:
        """Whether `forward_store` is one fused launch here (CUDA); elsewhere the attention
        backend stores k/v itself."""
        return _fused(q)

    def forward_store(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      k_buffer: torch.Tensor, v_buffer: torch.Tensor, loc: torch.Tensor,
                      k_scale: float = 1.0, v_scale: float = 1.0,
                      qk_norm: tuple[RMSNorm, RMSNorm] | None = None) -> None:
        """Rotate q and k in place and write the rotated k and v into pool rows `loc`, in one
        launch (only where `can_store_kv`); an FP8 pool stores them divided by its scales. With `qk_norm`
        (Qwen3's per-head norms of q and k) the heads are normalized first, in the same launch."""
        kernels = _kernels()
        norm = None
        if qk_norm is not None:
            q_norm, k_norm = qk_norm
            assert q_norm.eps == k_norm.eps, "q and k norms with different epsilons"
            norm = kernels.QKNorm(q_norm.weight, k_norm.weight, q_norm.eps)
        kernels.apply_rotary_(q, k, positions, self.cos_cache, self.sin_cache,
                              kernels.KVStoreTarget(v, k_buffer, v_buffer, loc, k_scale, v_scale), norm)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` for `x = [gate | up]` on the last dim."""
    if _fused(x) and x.dim() == 2:
        return _kernels().silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return nn.functional.silu(gate) * up


class GemvSwitch:
    """The batch-1 GEMV switches of a module whose one-row calls may run the GEMV kernels (set by `enable_gemv`)."""

    use_gemv = False
    """One-row calls on CUDA run the GEMV kernel."""
    fuse_prologues = False
    """One-row calls run an `AddRMSNorm` prologue inside the GEMV kernel."""
    fuse_qwen3_qk_norm = False
    """With `fuse_prologues`: Qwen3's q/k norms inside the q/k/v + rotary kernel (`qwen3_fusions`)."""
    fuse_qwen3_router = False
    """With `fuse_prologues`: an MoE router with the norm before it in one kernel (`qwen3_fusions`)."""


class Linear(GemvSwitch, nn.Linear):
    """`nn.Linear` whose one-row calls on CUDA (a batch-1 decode step) run the GEMV kernel.

    cuBLAS treats one row as a skinny GEMM and leaves bandwidth unused on small projections;
    `radixmesh.kernels.gemv` streams the weights at up to 3 TB/s on an H100. The model runner
    turns it on (`use_gemv`) for half-precision weights on CUDA unless `--disable-gemv`.
    """

    quant_method: Any = None
    """A `radixmesh.engine.quant.base.LinearMethod` owning this layer's weights (set by its `prepare`)."""
    lora: Any = None
    """A `radixmesh.engine.lora.layers.LoraProjection` adding the batch's adapters (set when LoRA is on)."""

    def forward(self, x: torch.Tensor, prologue: Prologue | None = None) -> torch.Tensor:
        """`x @ W.T (+ bias)`; with a `prologue`, of `prologue(x)`: inside the GEMV kernel where one runs, or
        inside the quantization method's input step (FP8: the prologue's kernel quantizes its own output). In a
        pass where some row uses a LoRA adapter, plus each row's adapter output (of the normed input: no prologue
        is fused then; a pass of base rows only runs as without LoRA)."""
        lora = self.lora if self.lora is not None and self.lora.active else None  # a pass with adapter rows
        if prologue is not None:
            fused = prologue.fused_gemv(self, x)
            if fused is not None:
                return fused if self.bias is None else fused.add_(self.bias)
            if self.quant_method is not None and lora is None:  # adapters read the normed input
                after = self.quant_method.apply_after(self, x, prologue)
                if after is not None:
                    return after
            x = prologue.apply(x)
        if lora is not None:
            if self._runs_gemv(x) and self.quant_method is None and lora.takes_epilogue(x):
                return self._project(x, lora.epilogue(x))  # the adapter in the GEMV's epilogue
            y: torch.Tensor = lora.project(x, self._project)  # the shrink may run beside the base GEMM
            return y
        return self._project(x)

    def _runs_gemv(self, x: torch.Tensor) -> bool:
        return self.use_gemv and x.dim() == 2 and x.shape[0] == 1 and x.is_contiguous()

    def _project(self, x: torch.Tensor, lora_epilogue: Any = None) -> torch.Tensor:
        """`x @ W.T (+ bias)`; `lora_epilogue` (one row, the GEMV): plus the row's adapter."""
        if self.quant_method is not None:
            assert lora_epilogue is None, "a quantized projection takes no LoRA epilogue"
            y: torch.Tensor = self.quant_method.apply(self, x)
            return y
        if self._runs_gemv(x):
            from radixmesh.kernels.gemv import gemv

            y = gemv(x, self.weight, lora=lora_epilogue)
            return y if self.bias is None else y.add_(self.bias)
        assert lora_epilogue is None, "a LoRA epilogue needs the one-row GEMV"
        if _weight_major_faster(x):
            # [out, in] @ [in, rows] streams the weight once; MKL's `x @ W^T` path re-reads it per
            # row for a few rows (the LM head of a batch-3 decode step: 61 ms vs 14 ms on 2 EPYC cores)
            y = torch.mm(self.weight, x.t()).t().contiguous()  # [rows, out]
            return y if self.bias is None else y.add_(self.bias)
        return super().forward(x)


    def gemv_weights(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """(weight, its FP8 row scales or None) when the one-row call `x` runs a GEMV kernel that takes a prologue;
        else None."""
        if self.lora is not None and self.lora.active and not self.lora.fuses_prologue(x):
            return None  # its adapters read the normed input: no prologue inside the GEMV
        if not (self.use_gemv and self.fuse_prologues and _fused(x) and x.dim() == 2 and x.shape[0] == 1
                and x.is_contiguous()):
            return None
        if self.quant_method is None:
            return (self.weight, None) if self.weight.dtype == x.dtype else None
        weights: tuple[torch.Tensor, torch.Tensor | None] | None = self.quant_method.gemv_weights(self)
        return weights


class Prologue(Protocol):
    """The step before a projection (`Linear.forward(x, prologue)`), which the projection may run inside its own
    kernels."""

    def fused_gemv(self, layer: Linear, x: torch.Tensor) -> torch.Tensor | None:
        """`layer(prologue(x))` with the prologue inside the batch-1 GEMV, or None where that does not run."""

    def quantized(self, x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`prologue(x)` quantized per token to FP8 `dtype` in the prologue's own kernel: (values, row scales), or
        None where that does not run."""

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """`prologue(x)` on its own."""


class SiluAndMul:
    """`silu(gate) * up` of a stacked gate/up output, as the prologue of the down projection."""

    def fused_gemv(self, layer: Linear, x: torch.Tensor) -> torch.Tensor | None:
        return None

    def quantized(self, x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not (_fused(x) and x.dim() == 2 and _kernels_fp8().can_fuse(x.shape[-1] // 2)):
            return None
        q, scale = _kernels_fp8().silu_and_mul_quant(x, dtype)
        return q, scale

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)


SILU_AND_MUL = SiluAndMul()


class AddRMSNorm:
    """The step before a projection (`Linear.forward(x, prologue)`): `norm(x + residual)`, inside the batch-1 GEMV
    where one runs (`radixmesh.kernels.gemv_fused`), inside the FP8 quantization of the projection's input where
    that runs (`radixmesh.kernels.fp8_fused`), else as its own op first. After the call `summed` holds
    `x + residual` (the residual stream)."""

    def __init__(self, norm: RMSNorm, residual: torch.Tensor) -> None:
        self.norm, self.residual = norm, residual
        self.summed: torch.Tensor | None = None

    def fused_gemv(self, layer: Linear, x: torch.Tensor, gated: bool = False) -> torch.Tensor | None:
        """`gated`: `layer` stacks gate and up rows and the result is `silu(gate) * up` (see `gemv_add_rmsnorm`)."""
        weights = layer.gemv_weights(x)
        if weights is None or not self.residual.is_contiguous() or self.residual.shape != x.shape or (
                gated and layer.bias is not None):
            return None
        from radixmesh.kernels.gemv_fused import gemv_add_rmsnorm

        y, self.summed = gemv_add_rmsnorm(x, self.residual, self.norm.weight, self.norm.eps, *weights, gated=gated,
                                          **self._lora_terms(layer, x))
        return y

    def _lora_terms(self, layer: Linear, x: torch.Tensor) -> dict[str, Any]:
        """The row's LoRA adapter for the fused GEMV, in a pass with adapters: `lora` (the shrink of the normed row,
        expanded in the GEMV's epilogue) or `addend` (the adapter's output, added before the epilogue)."""
        lora = layer.lora
        if lora is None or not lora.active:
            return {}
        if lora.takes_epilogue(x):
            return {"lora": lora.epilogue(x, self.residual, self.norm.weight)}
        return {"addend": lora.norm_delta(x, self.residual, self.norm.weight, self.norm.eps)}

    def fused_gemv_rope(self, layer: Linear, x: torch.Tensor, rope: dict[str, Any],
                        qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None) -> torch.Tensor | None:
        """The stacked q/k/v projection of one token with the rotary embedding and the KV store in the same kernel
        (`radixmesh.kernels.gemv_rope`; `rope`: the fields of its `RopeStore`; `qk_norm`: Qwen3's q and k norm
        weights and epsilon, applied per head before the rotation), or None where it does not run."""
        weights = layer.gemv_weights(x)
        if weights is None or layer.bias is not None or not self.residual.is_contiguous() or \
                self.residual.shape != x.shape:
            return None
        from radixmesh.kernels.fused import QKNorm
        from radixmesh.kernels.gemv_rope import RopeStore, gemv_add_rmsnorm_rope, rope_block_n, rope_config

        n, k = weights[0].shape
        d = rope["head_dim"]
        if rope_block_n(rope_config(n, k, d, weights[1] is not None, qk_norm is not None), d, qk_norm is not None) \
                is None:
            return None
        store = RopeStore(**rope, qk_norm=QKNorm(*qk_norm) if qk_norm is not None else None)
        y, self.summed = gemv_add_rmsnorm_rope(x, self.residual, self.norm.weight, self.norm.eps, *weights, store,
                                               **self._lora_terms(layer, x))
        return y

    def fused_router(self, weight: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`(prologue(x), prologue(x) @ weight.T)` for one row in one kernel (`radixmesh.kernels.gemv_norm_out`: an
        MoE router `[E, hidden]` after the post-attention norm), or None where it does not run."""
        if not (_fused(x) and x.dim() == 2 and x.shape[0] == 1 and x.is_contiguous() and x.dtype == weight.dtype
                and self.residual.is_contiguous() and self.residual.shape == x.shape):
            return None
        from radixmesh.kernels.gemv_norm_out import MAX_ROW, gemv_add_rmsnorm_out

        if x.shape[-1] > MAX_ROW:
            return None
        logits, h, self.summed = gemv_add_rmsnorm_out(x, self.residual, self.norm.weight, self.norm.eps, weight)
        return h, logits

    def quantized(self, x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not (_fused(x) and x.dim() == 2 and _kernels_fp8().can_fuse(x.shape[-1])):
            return None
        q, scale, self.summed = _kernels_fp8().rms_norm_quant(x, self.norm.weight, self.norm.eps, self.residual,
                                                             dtype)
        return q, scale

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        h, self.summed = self.norm.forward_add(x, self.residual)
        return h


WEIGHT_MAJOR_MAX_ROWS = 64
"""Above this many rows `x @ W^T` is as fast on the CPU (measured crossover ~128 rows)."""


def _weight_major_faster(x: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and x.dim() == 2 and 1 < x.shape[0] <= WEIGHT_MAJOR_MAX_ROWS
            and x.dtype == torch.float32)


def enable_gemv(model: nn.Module, fuse_prologues: bool = True) -> int:
    """Route the model's one-row linear calls (and MoE routers') to the GEMV kernel (with their prologues inside it
    unless `fuse_prologues` is False); how many layers now do."""
    layers = [m for m in model.modules() if isinstance(m, GemvSwitch)]
    qk_norm, router = qwen3_fusions() if fuse_prologues else (False, False)
    for layer in layers:
        layer.use_gemv = True
        layer.fuse_prologues = fuse_prologues
        layer.fuse_qwen3_qk_norm, layer.fuse_qwen3_router = qk_norm, router
    return len(layers)


QWEN3_FUSIONS = {"": (False, True), "router": (False, True), "0": (False, False), "off": (False, False),
                 "1": (True, True), "on": (True, True), "all": (True, True), "qk-norm": (True, False)}
"""RADIXMESH_QWEN3_FUSION -> (q/k norms in the q/k/v + rotary kernel, router with its norm). Unset: the router
alone. On an H200 (Qwen3-30B-A3B, batch 1, one machine, one after the other): the router with its norm in one kernel
351.3 tok/s against 347.8 without (its kernel 3.4 us against 5.1 for the two launches it replaces); both fusions
288.5 against 346.8 (the whole-head q/k/v programs: 27.3 us a layer against 12.9), so the q/k-norm fusion stays
opt-in (`1`, `qk-norm`) and `0` turns both off (docs/benchmarks/README.md)."""


def qwen3_fusions() -> tuple[bool, bool]:
    """(q/k norm fusion, router fusion) as RADIXMESH_QWEN3_FUSION asks; an unknown value is an error."""
    from radixmesh.common.env import env_str
    from radixmesh.common.errors import invalid_argument

    value = (env_str("QWEN3_FUSION") or "").strip().lower()
    if value not in QWEN3_FUSIONS:
        raise invalid_argument(f"RADIXMESH_QWEN3_FUSION={value!r}: expected one of "
                               f"{', '.join(k for k in QWEN3_FUSIONS if k)}", "RADIXMESH_QWEN3_FUSION")
    return QWEN3_FUSIONS[value]


class GatedMLP(nn.Module):
    """SiLU-gated MLP with gate and up projections stacked in one weight `[2 * inter, hidden]`
    (checkpoints' `gate_proj`/`up_proj` load into its halves: see `STACKED_PARAMS`)."""

    def __init__(self, hidden_size: int, intermediate_size: int, down_proj: nn.Module | None = None) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False)
        # tensor parallelism passes a row-parallel layer (its all-reduce sums the ranks' halves)
        self.down_proj = down_proj if down_proj is not None else Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, prologue: AddRMSNorm | None = None) -> torch.Tensor:
        """The MLP of `x` (of `prologue(x)` with one: see `Linear.forward`). At batch 1 with a norm before it,
        the norm, the gate/up GEMV and SiLU-and-mul are one kernel."""
        if prologue is not None:
            act = prologue.fused_gemv(self.gate_up_proj, x, gated=True)
            if act is not None:
                return self.down_proj(act)
        return self.down_proj(self.gate_up_proj(x, prologue), SILU_AND_MUL)
