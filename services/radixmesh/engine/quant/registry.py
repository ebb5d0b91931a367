"""Quantization method id -> lazily imported factory; `--quantization` and the Helm value
`worker.engine.quantization` use these ids."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from radixmesh.common.registry import LazyRegistry

if TYPE_CHECKING:
    from radixmesh.engine.quant.base import LinearMethod

QUANT_METHODS: LazyRegistry[type[LinearMethod]] = LazyRegistry("quantization", {
    "fp8": "radixmesh.engine.quant.fp8:Fp8LinearMethod",
}, param="quantization", dashes_for_underscores=True)
"""Linear-layer methods: fp8 = FP8 e4m3 weights with per-output-channel scales, per-token dynamic
FP8 activations (W8A8; batch-1 GEMV reads FP8 weights with bf16 activations)."""

KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")
"""`--kv-cache-dtype`: auto (the model's dtype) | fp8_e4m3 | fp8_e5m2 (FP8 pool, per-tensor scales)."""
FP8_GEMM_BACKENDS = ("auto", "scaled-mm", "triton")
"""`--fp8-gemm-backend`: auto (measured per shape at load) | scaled-mm (torch._scaled_mm) | triton."""


def create_method(name: str, **kwargs: Any) -> LinearMethod:
    method: LinearMethod = QUANT_METHODS.create(name, **kwargs)
    return method
