"""LoRA adapter names where they cross services: the prefix-cache namespace of an adapter and its block-hash key.

A request of adapter NAME caches its prefix under namespace `adapter_namespace(NAME)` (a 31-bit hash of the
name, never 0: 0 is the base model): the scheduler's radix tree keys its tokens as `token | ns << 32`, so two
adapters never share KV and one adapter always does, and its block hashes take `adapter_extra_key(NAME)` as
their extra key (`radixmesh.wire.block_hash`), so the router's cache-aware routing sees adapter prefixes apart.
"""

from __future__ import annotations

import os
from hashlib import blake2b

from radixmesh.common.errors import invalid_argument

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Projections an adapter may target (Llama and Qwen2 names)."""
TOKEN_BITS = 32
"""Token ids are below 2**32; the namespace sits above them in a radix-cache key."""
_TOKEN_MASK = (1 << TOKEN_BITS) - 1


def adapter_namespace(name: str | None) -> int:
    """The cache namespace of adapter `name` (0 for None: the base model)."""
    if not name:
        return 0
    value = int.from_bytes(blake2b(name.encode(), digest_size=4).digest(), "little") & 0x7FFFFFFF
    return value or 1


def namespaced(ids: list[int], namespace: int) -> list[int]:
    """Radix-cache keys of `ids` in `namespace`."""
    if not namespace:
        return ids
    high = namespace << TOKEN_BITS
    return [high | t for t in ids]


def split_namespace(keys: list[int]) -> tuple[int, list[int]]:
    """(namespace, token ids) of radix-cache keys of one path (all in one namespace)."""
    if not keys or keys[0] <= _TOKEN_MASK:
        return 0, keys
    return keys[0] >> TOKEN_BITS, [k & _TOKEN_MASK for k in keys]


def namespace_extra_key(namespace: int) -> bytes:
    """The block-hash extra key of a namespace (empty for the base model)."""
    return b"" if not namespace else b"lora:" + namespace.to_bytes(4, "little")


def adapter_extra_key(name: str | None) -> bytes:
    """The block-hash extra key of adapter `name`'s prompts."""
    return namespace_extra_key(adapter_namespace(name))


def split_model_name(model: str | None, base_names: tuple[str, ...]) -> tuple[str | None, str | None]:
    """(base, adapter) of an OpenAI `model` field: "base:adapter", "adapter", or a base model's name.

    `base_names` are the names the base model answers to; anything else names an adapter."""
    if not model or model in base_names:
        return model, None
    base, sep, adapter = model.partition(":")
    if sep and base in base_names:
        return base, adapter or None
    return None, model


def parse_lora_path(item: str) -> tuple[str, str]:
    """(name, path) of a `--lora-paths` item: NAME=PATH, or PATH named after its last directory."""
    name, sep, path = item.partition("=")
    if not sep:
        path = item
        name = os.path.basename(os.path.normpath(item))
    if not name or not path:
        raise invalid_argument(f"--lora-paths item {item!r} must be NAME=PATH or PATH", "lora_paths")
    if ":" in name:
        raise invalid_argument(f"LoRA adapter name {name!r} may not contain ':' (requests say base:adapter)",
                               "lora_paths")
    return name, path
