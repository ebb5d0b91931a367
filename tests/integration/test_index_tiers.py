"""Cache tiers in the KV-cache index against a real Redis: host-tier blocks live under their own keys,
lookups report device and either-tier prefixes, readers that predate tiers see them as misses, and
the janitor cleans both tiers."""

from __future__ import annotations

import asyncio

import pytest
import redis as sync_redis

from radixmesh.index.keys import IndexKeys
from radixmesh.index.reader import KVIndexReader
from radixmesh.index.redis_server import LocalRedis
from radixmesh.index.writer import connect
from radixmesh.wire.block_hash import block_hashes
from tests.integration.index_factory import make_config, make_writer, prompt, published
from tests.redis_helpers import local_redis  # noqa: F401  (fixture)

pytestmark = pytest.mark.integration


def test_host_tier_blocks_count_in_the_prefix_but_not_on_the_device(local_redis: LocalRedis) -> None:  # noqa: F811
    async def run() -> None:
        config = make_config(local_redis)
        a, b = make_writer(config, "a"), make_writer(config, "b")
        await a.start()
        await b.start()
        hashes = block_hashes(prompt(1, 6), 4)
        a.stored(hashes)
        a.stored(hashes[2:], "host")  # blocks 2.. moved to a's host tier
        b.stored(hashes[:3])
        await published(a, b)
        reader = KVIndexReader(config, connect(config))
        match = await reader.lookup(hashes)
        assert match.cached_blocks == {"a": 6, "b": 3}
        assert match.device_blocks_of("a") == 2 and match.device_blocks_of("b") == 3
        assert match.footprint == {"a": 6, "b": 3}
        keys = IndexKeys(config.namespace)
        raw = sync_redis.Redis.from_url(local_redis.url)
        assert raw.hget(keys.block(hashes[3]), "a") is None and raw.hget(keys.host_block(hashes[3]), "a") == b"1"
        assert raw.scard(keys.worker_blocks("a", 1)) == 2 and raw.scard(keys.worker_host_blocks("a", 1)) == 4
        # a reader that predates tiers walks b: keys only: a's host blocks are misses to it
        old_view = [h for h in hashes if raw.hget(keys.block(h), "a") is not None]
        assert old_view == hashes[:2]
        a.stored(hashes[2:4])  # loaded back to the device
        a.removed(hashes[4:])  # evicted from the host
        await published(a)
        match = await reader.lookup(hashes)
        assert match.cached_blocks["a"] == 4 and match.device_blocks_of("a") == 4
        assert raw.exists(keys.host_block(hashes[2])) == 0 and raw.exists(keys.host_block(hashes[5])) == 0
        await a.close()
        await b.close()
        assert (await reader.lookup(hashes)).cached_blocks == {}
        assert raw.scard(keys.worker_host_blocks("a", 1)) == 0  # withdrawn: both tiers cleaned
        await reader.redis.aclose()
        raw.close()

    asyncio.run(run())


def test_resync_republishes_tiers_and_the_janitor_cleans_old_host_entries(local_redis: LocalRedis) -> None:  # noqa: F811
    async def run() -> None:
        config = make_config(local_redis)
        writer = make_writer(config, "w")
        await writer.start()
        hashes = block_hashes(prompt(3, 4), 4)
        writer.stored(hashes[:2])
        writer.stored(hashes[2:], "host")
        await published(writer)
        first_epoch = writer.epoch
        writer._needs_resync = True  # as after a Redis failure
        await published(writer)
        assert writer.epoch == first_epoch + 1
        keys = IndexKeys(config.namespace)
        raw = sync_redis.Redis.from_url(local_redis.url)
        assert raw.hget(keys.host_block(hashes[3]), "w") == str(writer.epoch).encode()
        assert raw.exists(keys.worker_host_blocks("w", first_epoch)) == 0  # the old epoch's set is gone
        reader = KVIndexReader(config, connect(config))
        match = await reader.lookup(hashes)
        assert match.cached_blocks == {"w": 4} and match.device_blocks_of("w") == 2
        raw.hset(keys.host_block(hashes[0]), "gone", "3")  # a host entry of a worker without a lease
        assert (await reader.lookup(hashes)).cached_blocks == {"w": 4}
        assert await reader.clean_stale() == 1 and raw.hget(keys.host_block(hashes[0]), "gone") is None
        await writer.close()
        await reader.redis.aclose()
        raw.close()

    asyncio.run(run())
