"""Attention backend id -> lazily imported factory; CLI flags and Helm values use these ids."""

from __future__ import annotations

import importlib

from radixmesh.common.errors import invalid_argument
from radixmesh.engine.attention.base import AttentionBackend

BACKENDS: dict[str, str] = {
    "torch-native": "radixmesh.engine.attention.torch_native:TorchNativeBackend",
    "triton": "radixmesh.engine.attention.triton_backend:TritonBackend",
    "flashinfer": "radixmesh.engine.attention.flashinfer_backend:FlashInferBackend",
}


def create_backend(name: str) -> AttentionBackend:
    key = name.replace("_", "-")
    target = BACKENDS.get(key)
    if target is None:
        raise invalid_argument(f"unknown attention backend {name!r} (known: {', '.join(sorted(BACKENDS))})",
                               param="attention_backend")
    module, _, attr = target.partition(":")
    backend: AttentionBackend = getattr(importlib.import_module(module), attr)()
    return backend
