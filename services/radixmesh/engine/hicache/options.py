"""Bounds of the hierarchical cache's EngineConfig fields (kept beside the feature, checked at build time)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixmesh.common.errors import invalid_argument

if TYPE_CHECKING:
    from radixmesh.engine.config import EngineConfig

WRITE_POLICIES = ("write-through", "write-back")
"""Ids of `--hicache-write-policy` (Helm: worker.engine.hicacheWritePolicy)."""


def check_hicache_options(config: EngineConfig) -> None:
    if config.hicache_write_policy not in WRITE_POLICIES:
        raise invalid_argument(f"hicache_write_policy must be one of {', '.join(WRITE_POLICIES)} "
                               f"(got {config.hicache_write_policy!r})", "hicache_write_policy")
    if not config.hicache_size >= 0:
        raise invalid_argument(f"hicache_size must be >= 0 GB (got {config.hicache_size:g})", "hicache_size")
    if not 0 < config.hicache_ratio <= 1000:
        raise invalid_argument(f"hicache_ratio must be in (0, 1000] (got {config.hicache_ratio:g})", "hicache_ratio")
    if config.enable_hierarchical_cache and config.disable_radix_cache:
        raise invalid_argument("the hierarchical cache is a tier of the radix cache: drop --disable-radix-cache "
                               "or --enable-hierarchical-cache", "enable_hierarchical_cache")
