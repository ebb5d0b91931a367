"""Small factories for the KV-cache index tests: configs in fresh namespaces, writers, prompts of whole blocks."""

from __future__ import annotations

import dataclasses
import itertools

from radixmesh.index.config import IndexConfig
from radixmesh.index.redis_server import LocalRedis
from radixmesh.index.writer import KVIndexWriter, WriterIdentity

_ns = itertools.count()


def make_config(server: LocalRedis, **overrides: object) -> IndexConfig:
    """A fresh namespace per test so tests never see each other's keys."""
    base = IndexConfig(redis_url=server.url, namespace=f"t{next(_ns)}", block_size=4, lease_ttl_s=1.5,
                       flush_interval_s=0.005, speculative_ttl_s=0.3, lease_cache_s=0.0)
    return dataclasses.replace(base, **overrides)


def make_writer(config: IndexConfig, name: str) -> KVIndexWriter:
    return KVIndexWriter(config, WriterIdentity(worker_id=name, address=f"127.0.0.1:{5000 + len(name)}"))


def prompt(prefix: int, num_blocks: int, tail: int = 0) -> list[int]:
    """Token ids: `num_blocks` blocks of 4 determined by `prefix`, then `tail` more tokens."""
    return [prefix * 1000 + i for i in range(num_blocks * 4 + tail)]


async def published(*writers: KVIndexWriter) -> None:
    for writer in writers:
        assert await writer.wait_published(), "writer did not publish in time"
