"""Compiled grammars by content key: an in-memory LRU (bounded in bytes) in front of Redis.

Redis is shared by every replica of the grammar service, so a grammar compiled by one is
fetched by the others. Redis is optional, and its failures only cost cache hits: the
service keeps answering from memory or by compiling. A Redis that is down (at start or
later) is skipped until `probe` finds it again; each change is logged once.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from radixmesh.common.errors import invalid_argument

logger = logging.getLogger(__name__)
REDIS_KEY_PREFIX = "radixmesh:grammar:"


@dataclass(frozen=True)
class StoreConfig:
    """Where compiled grammars are kept."""

    memory_bytes: int = 256 << 20
    """Most bytes of compiled grammars held in memory (least recently used dropped first)."""
    redis_url: str | None = None
    """Shared Redis (redis://host:port/db); None keeps the cache in this process only."""
    ttl_s: int = 7 * 24 * 3600
    """How long a compiled grammar lives in Redis after it was last written."""
    redis_timeout_s: float = 2.0
    """Per Redis operation; a slow Redis is a cache miss, not a failed call."""

    def __post_init__(self) -> None:
        if self.memory_bytes < 0:
            raise invalid_argument("memory_bytes must be >= 0", "memory_bytes")
        if self.ttl_s < 1:
            raise invalid_argument("ttl_s must be >= 1", "ttl_s")
        if self.redis_timeout_s <= 0:
            raise invalid_argument("redis_timeout_s must be > 0", "redis_timeout_s")


class GrammarStore:
    """get/put of serialized compiled grammars; `get` says where a hit came from."""

    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        self._memory: OrderedDict[str, bytes] = OrderedDict()
        self._memory_bytes = 0
        self._redis: Any = None
        self.redis_up = False
        """Whether Redis answered last time (False without Redis); while False, get/put skip it."""
        self.redis_error = "not contacted yet"
        if config.redis_url:
            self.redis_up = True  # until a call says otherwise
            from redis.asyncio import Redis

            self._redis = Redis.from_url(config.redis_url, socket_timeout=config.redis_timeout_s,
                                         socket_connect_timeout=config.redis_timeout_s)

    async def get(self, key: str) -> tuple[bytes, str] | None:
        """(data, "memory" | "redis"), or None on a miss."""
        data = self._memory.get(key)
        if data is not None:
            self._memory.move_to_end(key)
            return data, "memory"
        if self._redis is None or not self.redis_up:
            return None
        try:
            found = await self._redis.get(REDIS_KEY_PREFIX + key)
        except Exception as exc:  # any Redis failure is a miss (logged once), never a failed Compile
            self._redis_failed(exc)
            return None
        if found is None:
            return None
        self._remember(key, bytes(found))
        return bytes(found), "redis"

    async def put(self, key: str, data: bytes) -> None:
        self._remember(key, data)
        if self._redis is None or not self.redis_up:
            return
        try:
            await self._redis.set(REDIS_KEY_PREFIX + key, data, ex=self.config.ttl_s)
        except Exception as exc:
            self._redis_failed(exc)

    def _redis_failed(self, exc: BaseException) -> None:
        self.redis_error = f"{type(exc).__name__}: {exc}"
        if self.redis_up:
            logger.warning("grammar store: Redis unavailable (%s); caching in memory only until it returns",
                           self.redis_error)
        self.redis_up = False

    async def probe(self) -> bool:
        """Ping Redis; a Redis that answers again is used again. Returns whether it is up (False without one)."""
        if self._redis is None:
            return False
        try:
            await self._redis.ping()
        except Exception as exc:
            self._redis_failed(exc)
            return False
        if not self.redis_up:
            logger.warning("grammar store: Redis answers again; sharing compiled grammars through it")
        self.redis_up, self.redis_error = True, ""
        return True

    def _remember(self, key: str, data: bytes) -> None:
        if len(data) > self.config.memory_bytes:
            return
        old = self._memory.pop(key, None)
        self._memory_bytes -= len(old) if old is not None else 0
        self._memory[key] = data
        self._memory_bytes += len(data)
        while self._memory_bytes > self.config.memory_bytes:
            _, dropped = self._memory.popitem(last=False)
            self._memory_bytes -= len(dropped)

    @property
    def memory_bytes(self) -> int:
        return self._memory_bytes

    async def close(self) -> None:
        if self._redis is not None:
            await self._redis.aclose()
