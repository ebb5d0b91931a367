"""The one place radixmesh reads its environment: variables named RADIXMESH_<NAME>."""

from __future__ import annotations

import os
from pathlib import Path


def env_str(name: str, default: str | None = None) -> str | None:
    return os.environ.get(f"RADIXMESH_{name}", default)


def env_flag(name: str) -> bool:
    return (env_str(name) or "").lower() in ("1", "true", "yes", "on")


def cache_dir() -> Path:
    """Where converted models and other caches live (RADIXMESH_CACHE_DIR, else ~/.cache/radixmesh)."""
    return Path(env_str("CACHE_DIR") or Path.home() / ".cache" / "radixmesh")
