"""The KV-cache index when Redis hangs, restarts or comes back: lookups give up in time, writers publish again,
lease sets are refreshed off the lookup path."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
from redis.exceptions import RedisError

from radixmesh.index.config import IndexConfig
from radixmesh.index.reader import KVIndexReader
from radixmesh.index.redis_server import LocalRedis
from radixmesh.index.writer import connect, connect_inline
from radixmesh.wire.block_hash import block_hashes
from tests.redis_helpers import local_redis, own_redis  # noqa: F401  (fixtures)

from .index_factory import make_config, make_writer, prompt, published

pytestmark = pytest.mark.integration
def test_an_inline_lookup_gives_up_on_a_hung_redis_within_its_timeout() -> None:
    """A Redis that accepts connections but never answers holds the event loop for inline_timeout_s, then the
    lookup raises a Redis error (the cache-aware policy then routes with its fallback)."""
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(8)  # connections complete in the kernel; nothing ever reads or answers them
        config = IndexConfig(redis_url=f"redis://127.0.0.1:{hung.getsockname()[1]}/0", namespace="hung",
                             block_size=4, inline_timeout_s=0.1, op_timeout_s=5.0)

        async def run() -> None:
            reader = KVIndexReader(config, connect(config), connect_inline(config))
            reader._leases, reader._leases_read_s = {}, time.monotonic() + 3600  # no lease read first
            start = time.perf_counter()
            with pytest.raises(RedisError):
                await reader.lookup(block_hashes(prompt(1, 3), 4))
            # the inline 0.1 s, with room for a loaded machine, not the awaited client's 5 s
            assert time.perf_counter() - start < 2.5, "the awaited client's timeout, not the inline one's"
            # Opening the inline connection ahead (routers do at start and after an outage) waits in a thread:
            # the loop keeps running meanwhile.
            ticks = 0

            async def tick() -> None:
                nonlocal ticks
                while True:
                    await asyncio.sleep(0.01)
                    ticks += 1

            ticker = asyncio.create_task(tick())
            with pytest.raises(RedisError):
                await reader.open_inline()
            ticker.cancel()
            assert ticks >= 1, "the loop was held while the connection was opened"  # held: not one tick
            await reader.close()

        asyncio.run(run())


def test_writer_republishes_after_redis_restart(own_redis: LocalRedis) -> None:  # noqa: F811
    async def run(server: LocalRedis) -> None:
        config = make_config(server)
        hashes = block_hashes(prompt(8, 4), 4)
        writer = make_writer(config, "w")
        await writer.start()
        writer.stored(hashes[:2])
        await published(writer)
        server.stop()  # Redis loses everything (no persistence)
        writer.stored(hashes[2:3])
        deadline = time.monotonic() + 10
        while not writer._needs_resync:  # the writer saw the outage (its next flush failed)
            assert time.monotonic() < deadline, "the writer never noticed Redis was gone"
            await asyncio.sleep(0.01)
        server.start()
        assert await writer.wait_published(timeout_s=10)
        reader = KVIndexReader(config, connect(config))
        assert (await reader.lookup(hashes)).cached_blocks == {"w": 3}
        assert writer.num_resyncs >= 2
        await writer.close()
        await reader.redis.aclose()

    asyncio.run(run(own_redis))


def test_an_idle_writer_republishes_once_redis_returns(own_redis: LocalRedis) -> None:  # noqa: F811
    """No event arrives during or after the outage: the failed heartbeat alone must bring the resync
    (nothing here calls wait_published, which would wake the writer itself)."""
    async def run(server: LocalRedis) -> None:
        config = make_config(server)
        hashes = block_hashes(prompt(9, 3), 4)
        writer = make_writer(config, "idle")
        await writer.start()
        writer.stored(hashes)
        await published(writer)
        server.stop()
        await asyncio.sleep(3 * config.heartbeat_s)  # at least two heartbeats fail
        server.start()
        reader = KVIndexReader(config, connect(config))
        deadline = time.monotonic() + 10
        while (await reader.lookup(hashes)).cached_blocks != {"idle": 3}:
            assert time.monotonic() < deadline, "the idle writer never republished"
            await asyncio.sleep(0.1)
        await writer.close()
        await reader.redis.aclose()

    asyncio.run(run(own_redis))


def test_an_expired_lease_set_is_refreshed_off_the_lookup_path(local_redis: LocalRedis) -> None:  # noqa: F811
    """A lease that lapses changes no lease counter: within the lease TTL, a lookup after the cache
    expired uses the cached leases and reads them again in the background; past the TTL it reads them first."""
    async def run() -> None:
        # a 1 s cache and TTL: after the 1.2 s sleep below, a stall of up to 0.8 s still finds the set stale but served
        config = make_config(local_redis, lease_cache_s=1.0, lease_ttl_s=1.0)
        hashes = block_hashes(prompt(7, 2), 4)
        first, second = make_writer(config, "first"), make_writer(config, "second")
        for writer in (first, second):
            await writer.start()
            writer.stored(hashes)
            await published(writer)
        reader = KVIndexReader(config, connect(config))
        assert (await reader.lookup(hashes)).cached_blocks == {"first": 2, "second": 2}
        await second.close(withdraw=False)  # a crash: its lease lapses within the TTL
        await asyncio.sleep(1.2)  # lapsed, and the cached set is stale but younger than cache + TTL
        assert (await reader.lookup(hashes)).cached_blocks == {"first": 2, "second": 2}, "served from the cache"
        assert reader._refresh is not None
        await reader._refresh
        assert (await reader.lookup(hashes)).cached_blocks == {"first": 2}
        await first.close(withdraw=False)
        await asyncio.sleep(2.2)  # past cache + TTL: the leases are read before the lookup
        assert (await reader.lookup(hashes)).cached_blocks == {}
        assert reader.num_lease_rereads == 0
        await reader.redis.aclose()

    asyncio.run(run())
