"""The KV-cache index against a real Redis: writer leases and epochs, reader chains, cleanup."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
import redis as sync_redis
from redis.exceptions import RedisError

from radixmesh.index.keys import HOST_TIER, IndexKeys
from radixmesh.index.lease import WorkerLease
from radixmesh.index.reader import KVIndexReader
from radixmesh.index.redis_server import LocalRedis
from radixmesh.index.writer import connect, connect_inline
from radixmesh.wire.block_hash import block_hashes
from tests.redis_helpers import local_redis, own_redis  # noqa: F401  (fixtures)

from .index_factory import make_config, make_writer, prompt, published

pytestmark = pytest.mark.integration
def test_lookup_counts_leading_blocks_per_worker(local_redis: LocalRedis) -> None:  # noqa: F811
    async def run() -> None:
        config = make_config(local_redis)
        a, b = make_writer(config, "a"), make_writer(config, "b")
        await a.start()
        await b.start()
        hashes = block_hashes(prompt(1, 6, tail=3), 4)
        assert len(hashes) == 6
        a.stored(hashes[:5])
        b.stored(hashes[:2])
        b.stored(hashes[3:5])  # b holds blocks 3 and 4 but not 2: its prefix is 2 blocks
        await published(a, b)
        reader = KVIndexReader(config, connect(config))
        match = await reader.lookup(hashes)
        assert match.cached_blocks == {"a": 5, "b": 2}
        assert match.footprint == {"a": 5, "b": 4}
        assert match.tokens_of("a") == 20 and match.tokens_of("zzz") == 0
        other = await reader.lookup(block_hashes(prompt(2, 3), 4))
        assert other.cached_blocks == {}
        a.removed(hashes[2:])
        await published(a)
        assert (await reader.lookup(hashes)).cached_blocks == {"a": 2, "b": 2}
        await a.close()
        await b.close()
        assert (await reader.lookup(hashes)).cached_blocks == {}
        await reader.redis.aclose()

    asyncio.run(run())


def test_lookup_reads_long_chains_in_rounds(local_redis: LocalRedis) -> None:  # noqa: F811
    async def run() -> None:
        config = make_config(local_redis)
        writer = make_writer(config, "w")
        await writer.start()
        hashes = block_hashes(prompt(3, 300), 4)
        writer.stored(hashes[:250])
        await published(writer)
        reader = KVIndexReader(config, connect(config))
        assert (await reader.lookup(hashes)).cached_blocks == {"w": 250}
        await writer.close()
        await reader.redis.aclose()

    asyncio.run(run())


def test_clear_and_restart_start_new_epochs_and_clean_old_ones(local_redis: LocalRedis) -> None:  # noqa: F811
    async def run() -> None:
        config = make_config(local_redis)
        keys = IndexKeys(config.namespace)
        raw = sync_redis.Redis.from_url(config.redis_url)
        hashes = block_hashes(prompt(4, 4), 4)
        first = make_writer(config, "w")
        await first.start()
        first.stored(hashes)
        await published(first)
        epoch1 = first.epoch
        first.cleared()
        await published(first)
        assert first.epoch > epoch1
        reader = KVIndexReader(config, connect(config))
        assert (await reader.lookup(hashes)).cached_blocks == {}
        assert not raw.exists(keys.block(hashes[0])), "clearing must clean the old epoch's entries"
        first.stored(hashes[:2])
        await published(first)
        await first.close(withdraw=False)  # a crash: lease and entries stay behind

        second = make_writer(config, "w")
        await second.start()
        await published(second)
        assert second.epoch > first.epoch, "every restart must use a higher epoch"
        assert (await reader.lookup(hashes)).cached_blocks == {}, "a restarted worker's old entries must not count"
        assert not raw.exists(keys.block(hashes[0]))
        second.stored(hashes[:3])
        await published(second)
        assert (await reader.lookup(hashes)).cached_blocks == {"w": 3}
        await second.close()
        await reader.redis.aclose()
        raw.close()

    asyncio.run(run())


def test_a_cached_lease_set_is_read_again_when_a_lease_changed(own_redis: LocalRedis) -> None:  # noqa: F811
    """A reader that caches leases for a long time still sees, on its very next lookup, a worker that
    started or republished under a new epoch since (the lease counter moved); otherwise it costs nothing."""
    async def run(server: LocalRedis) -> None:
        config = make_config(server, lease_cache_s=600.0, lease_ttl_s=600.0)
        hashes = block_hashes(prompt(11, 3), 4)
        reader = KVIndexReader(config, connect(config))
        one = make_writer(config, "one")
        await one.start()
        one.stored(hashes)
        await published(one)
        assert (await reader.lookup(hashes)).cached_blocks == {"one": 3}
        assert (await reader.lookup(hashes)).cached_blocks == {"one": 3} and reader.num_lease_rereads == 0
        two = make_writer(config, "two")  # a new worker: its lease is not in the reader's cached set
        await two.start()
        two.stored(hashes[:2])
        await published(two)
        assert (await reader.lookup(hashes)).cached_blocks == {"one": 3, "two": 2}
        assert reader.num_lease_rereads == 1
        server.stop()  # Redis loses everything; the workers republish under epochs counted from 1 again
        server.start()
        with contextlib.suppress(RedisError):  # the first command after a restart finds its connection closed
            await reader.redis.ping()
        for writer in (one, two):
            writer.cleared()
            writer.stored(hashes[:1])
            assert await writer.wait_published(timeout_s=10)
        assert (await reader.lookup(hashes)).cached_blocks == {"one": 1, "two": 1}
        for writer in (one, two):
            await writer.close()
        await reader.redis.aclose()

    asyncio.run(run(own_redis))


def test_lapsed_lease_is_ignored_then_swept(local_redis: LocalRedis) -> None:  # noqa: F811
    async def run() -> None:
        config = make_config(local_redis)  # a 1.5 s TTL: the live lease outlasts a stall of this machine
        keys = IndexKeys(config.namespace)
        raw = sync_redis.Redis.from_url(config.redis_url)
        hashes = block_hashes(prompt(5, 3), 4)
        live, dying = make_writer(config, "live"), make_writer(config, "dying")
        for w in (live, dying):
            await w.start()
            w.stored(hashes)
        await published(live, dying)
        reader = KVIndexReader(config, connect(config))
        assert (await reader.lookup(hashes)).cached_blocks == {"live": 3, "dying": 3}
        await dying.close(withdraw=False)  # heartbeats stop; the lease lapses after its TTL
        deadline = time.monotonic() + 10
        while (await reader.lookup(hashes)).cached_blocks != {"live": 3}:
            assert time.monotonic() < deadline, "the dying lease never lapsed"
            await asyncio.sleep(0.05)
        assert raw.hexists(keys.block(hashes[0]), "dying"), "entries stay until cleaned"
        await reader.sweep()
        assert not raw.hexists(keys.block(hashes[0]), "dying")
        assert raw.hexists(keys.block(hashes[0]), "live")
        assert b"dying" not in raw.smembers(keys.workers)
        assert set(await reader.live_leases()) == {"live"}
        await live.close()
        await reader.redis.aclose()
        raw.close()

    asyncio.run(run())


def test_malformed_and_unknown_entries_are_ignored(local_redis: LocalRedis, caplog: pytest.LogCaptureFixture) -> None:  # noqa: F811
    async def run() -> None:
        config = make_config(local_redis)
        keys = IndexKeys(config.namespace)
        raw = sync_redis.Redis.from_url(config.redis_url)
        hashes = block_hashes(prompt(6, 3), 4)
        writer = make_writer(config, "w")
        await writer.start()
        writer.stored(hashes)
        await published(writer)
        raw.hset(keys.block(hashes[0]), "ghost", "1")  # a worker that has no lease
        raw.hset(keys.block(hashes[1]), "junk", "not-an-epoch")
        raw.set(keys.lease("broken"), b"\xff\x00 not a protobuf")
        raw.set(keys.lease("noaddr"), WorkerLease("noaddr", 1, "nohostport").to_bytes())
        raw.sadd(keys.workers, "broken", "noaddr")
        raw.hset(keys.block(hashes[0]), "broken", "1")
        reader = KVIndexReader(config, connect(config))
        match = await reader.lookup(hashes)
        assert match.cached_blocks == {"w": 3}
        assert reader.num_malformed == 1
        assert await reader.clean_stale() >= 1
        assert not raw.hexists(keys.block(hashes[0]), "ghost")
        await writer.close()
        await reader.redis.aclose()
        raw.close()

    with caplog.at_level("WARNING"):
        asyncio.run(run())
    assert "malformed entry" in caplog.text and "malformed lease" in caplog.text and "undecodable lease" in caplog.text


def test_speculative_entries_count_until_they_expire(local_redis: LocalRedis) -> None:  # noqa: F811
    async def run() -> None:
        config = make_config(local_redis, speculative_ttl_s=1.0)  # the lookups below outlast a stall
        hashes = block_hashes(prompt(7, 5), 4)
        a, b = make_writer(config, "a"), make_writer(config, "b")
        await a.start()
        await b.start()
        a.stored(hashes[:1])
        await published(a, b)
        reader = KVIndexReader(config, connect(config))
        other = block_hashes(prompt(9, 2), 4)
        await reader.record_speculative(other, "nobody")  # no lease: never counts
        assert (await reader.lookup(other)).cached_blocks == {}
        await reader.record_speculative(hashes, "a", from_block=1)
        match = await reader.lookup(hashes)
        assert match.cached_blocks == {"a": 5} and match.speculative == {"a"}
        await reader.record_speculative(hashes, "b", from_block=1)  # the latest decision wins
        assert (await reader.lookup(hashes)).cached_blocks == {"a": 1}
        await reader.record_speculative(hashes, "b", from_block=0)
        assert (await reader.lookup(hashes)).cached_blocks == {"a": 1, "b": 5}
        deadline = time.monotonic() + 10
        while (await reader.lookup(hashes)).cached_blocks != {"a": 1}:  # expired after the TTL
            assert time.monotonic() < deadline, "the speculative entry never expired"
            await asyncio.sleep(0.05)
        for w in (a, b):
            await w.close()
        await reader.redis.aclose()

    asyncio.run(run())


def test_two_readers_agree(local_redis: LocalRedis) -> None:  # noqa: F811
    async def run() -> None:
        config = make_config(local_redis)
        writers = [make_writer(config, f"w{i}") for i in range(3)]
        prompts = [block_hashes(prompt(10 + i, 6), 4) for i in range(4)]
        for i, w in enumerate(writers):
            await w.start()
            for j, hashes in enumerate(prompts):
                w.stored(hashes[: (i * 3 + j) % 7])
        await published(*writers)
        r1, r2 = KVIndexReader(config, connect(config)), KVIndexReader(config, connect(config))
        inline = KVIndexReader(config, connect(config), connect_inline(config))  # the walk as a blocking call
        writers[1].stored(prompts[0][:6], tier=HOST_TIER)
        await published(*writers)
        await r1.record_speculative(prompts[3], "w0", from_block=2)
        for hashes in prompts:
            match = await r1.lookup(hashes)
            assert match == (await r2.lookup(hashes)) == (await inline.lookup(hashes))
        assert (await inline.lookup(prompts[0])).device_blocks is not None, "the host tier was read inline too"
        assert (await inline.lookup(prompts[3])).speculative == {"w0"}
        fresh = KVIndexReader(config, connect(config), connect_inline(config))
        await fresh.open_inline()  # from a thread: the connection is open before the first lookup
        assert fresh.inline is not None and len(fresh.inline.connection_pool._available_connections) == 1
        assert (await fresh.lookup(prompts[1])) == (await r1.lookup(prompts[1]))
        await fresh.close()
        for w in writers:
            await w.close()
        for reader in (r1, r2, inline):
            await reader.close()

    asyncio.run(run())


def test_events_of_one_batch_apply_in_order(local_redis: LocalRedis) -> None:  # noqa: F811
    """A batch is one script call: a block stored, removed and stored again ends held, and one
    stored then removed ends absent from both the block's hash and the worker's member set."""
    async def run() -> None:
        config = make_config(local_redis)
        writer = make_writer(config, "a")
        await writer.start()
        assert await writer.wait_published()  # the first epoch exists before the batch is queued
        hashes = block_hashes(prompt(7, 3), 4)
        writer.stored(hashes)
        writer.removed(hashes[1:])
        writer.stored(hashes[2:])
        await published(writer)
        reader = KVIndexReader(config, connect(config))
        assert (await reader.lookup(hashes)).cached_blocks == {"a": 1}
        client = sync_redis.Redis.from_url(config.redis_url)
        keys = IndexKeys(config.namespace)
        members = {m.decode() for m in client.smembers(keys.worker_blocks("a", writer.epoch))}
        assert members == {f"{hashes[0]:016x}", f"{hashes[2]:016x}"}
        assert client.hget(keys.block(hashes[1]), "a") is None
        assert client.hget(keys.block(hashes[2]), "a") == str(writer.epoch).encode()
        assert writer.num_flushed_events == 6
        await writer.close()
        client.close()

    asyncio.run(run())
