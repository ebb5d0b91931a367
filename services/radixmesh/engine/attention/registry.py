"""Attention backend id -> lazily imported factory; CLI flags and Helm values use these ids."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from radixmesh.common.errors import invalid_argument

if TYPE_CHECKING:
    from radixmesh.engine.attention.base import AttentionBackend

BACKENDS: dict[str, str] = {
    "torch-native": "radixmesh.engine.attention.torch_native:TorchNativeBackend",
    "triton": "radixmesh.engine.attention.triton_backend:TritonBackend",
    "flashinfer": "radixmesh.engine.attention.flashinfer_backend:FlashInferBackend",
}


def backend_target(name: str) -> str:
    """The "module:attr" factory of backend `name` (imports nothing); INVALID_ARGUMENT for an unknown id."""
    target = BACKENDS.get(name.replace("_", "-"))
    if target is None:
        raise invalid_argument(f"unknown attention backend {name!r} (known: {', '.join(sorted(BACKENDS))})",
                               param="attention_backend")
    return target


def create_backend(name: str) -> AttentionBackend:
    module, _, attr = backend_target(name).partition(":")
    backend: AttentionBackend = getattr(importlib.import_module(module), attr)()
    return backend
