"""Attention backend id -> lazily imported class; CLI flags and Helm values use these ids."""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixmesh.common.registry import LazyRegistry

if TYPE_CHECKING:
    from radixmesh.engine.attention.base import AttentionBackend

ATTENTION_BACKENDS: LazyRegistry[type[AttentionBackend]] = LazyRegistry("attention backend", {
    "torch-native": "radixmesh.engine.attention.torch_native:TorchNativeBackend",
    "triton": "radixmesh.engine.attention.triton_backend:TritonBackend",
    "flashinfer": "radixmesh.engine.attention.flashinfer_backend:FlashInferBackend",
}, param="attention_backend", dashes_for_underscores=True)


def create_backend(name: str) -> AttentionBackend:
    """A new backend `name`; INVALID_ARGUMENT for an unknown id."""
    backend: AttentionBackend = ATTENTION_BACKENDS.create(name)
    return backend
