"""Quantization method id -> lazily imported factory; `--quantization` and the Helm value
`worker.engine.quantization` use these ids."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from radixmesh.common.errors import invalid_argument

if TYPE_CHECKING:
    from radixmesh.engine.quant.base import LinearMethod

QUANT_METHODS: dict[str, str] = {
    "fp8": "radixmesh.engine.quant.fp8:Fp8LinearMethod",
}
"""Linear-layer methods: fp8 = FP8 e4m3 weights with per-output-channel scales, per-token dynamic
FP8 activations (W8A8; batch-1 GEMV reads FP8 weights with bf16 activations)."""

KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")
"""`--kv-cache-dtype`: auto (the model's dtype) | fp8_e4m3 | fp8_e5m2 (FP8 pool, per-tensor scales)."""
FP8_GEMM_BACKENDS = ("auto", "scaled-mm", "triton")
"""`--fp8-gemm-backend`: auto (measured per shape at load) | scaled-mm (torch._scaled_mm) | triton."""


def create_method(name: str, **kwargs: Any) -> LinearMethod:
    target = QUANT_METHODS.get(name.replace("_", "-"))
    if target is None:
        raise invalid_argument(f"unknown quantization {name!r} (known: {', '.join(sorted(QUANT_METHODS))})",
                               "quantization")
    module, _, attr = target.partition(":")
    method: LinearMethod = getattr(importlib.import_module(module), attr)(**kwargs)
    return method
