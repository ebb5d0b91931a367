"""Builds the scheduler's radix cache: a plain RadixCache, or a HiRadixCache with its host tier."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from radixmesh.common.errors import invalid_argument
from radixmesh.engine.config import EngineConfig
from radixmesh.engine.radix_cache import RadixCache

if TYPE_CHECKING:
    from radixmesh.engine.memory import KVSlotAllocator, TokenToKVPool

logger = logging.getLogger(__name__)
GB = 1e9
HOST_RAM_SHARE = 0.9
"""The host tier may take at most this share of the RAM available when it is allocated."""


def host_tier_tokens(config: EngineConfig, pool: TokenToKVPool) -> int:
    """Host tier capacity in tokens: `hicache_size` GB, or `hicache_ratio` times the device pool."""
    per_token = 2 * pool.num_layers * pool.num_kv_heads * pool.head_dim * pool.dtype.itemsize
    tokens = int(config.hicache_size * GB // per_token) if config.hicache_size > 0 else int(
        config.hicache_ratio * pool.size)
    if tokens < 1:
        raise invalid_argument(f"the host tier of {config.hicache_size:g} GB holds no token "
                               f"({per_token} bytes each)", "hicache_size")
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if tokens * per_token > HOST_RAM_SHARE * available:
        raise invalid_argument(f"the host tier needs {tokens * per_token / GB:.1f} GB ({tokens} tokens); "
                               f"{available / GB:.1f} GB of RAM are available: lower --hicache-size or "
                               "--hicache-ratio", "hicache_size")
    return tokens


def build_tree(config: EngineConfig, allocator: KVSlotAllocator, pool: TokenToKVPool) -> RadixCache:
    """RadixCache, or HiRadixCache over a host tier when `enable_hierarchical_cache` is set."""
    if not config.enable_hierarchical_cache:
        return RadixCache(allocator, disable=config.disable_radix_cache)
    from radixmesh.engine.hicache.host_pool import HostKVPool
    from radixmesh.engine.hicache.transfer import HostTransfer
    from radixmesh.engine.hicache.tree import HiRadixCache

    pinned = pool.device.type == "cuda"
    host = HostKVPool(host_tier_tokens(config, pool), pool.num_layers, pool.num_kv_heads, pool.head_dim,
                      pool.dtype, pin_memory=pinned)
    logger.info("hierarchical cache: host tier of %d tokens (%.2f GB%s, %d on the device), %s", host.size,
                host.size * host.bytes_per_token / GB, ", pinned" if pinned else "", pool.size,
                config.hicache_write_policy)
    return HiRadixCache(allocator, host, HostTransfer(pool, host),
                        write_through=config.hicache_write_policy == "write-through")

