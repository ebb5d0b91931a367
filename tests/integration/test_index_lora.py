"""Workers' LoRA adapters in the KV-cache index, against a real Redis: a worker's lease names its adapters (from its
first publish, rewritten at every change, moving the lease counter), and the router's adapter affinity follows the
index where it is fresher than GetLoad, falling back to GetLoad for workers the index does not describe."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import redis as sync_redis

from radixmesh.index.keys import IndexKeys
from radixmesh.index.lease import WorkerLease, parse_lease
from radixmesh.index.reader import KVIndexReader
from radixmesh.index.redis_server import LocalRedis
from radixmesh.index.writer import KVIndexWriter, WriterIdentity, connect
from radixmesh.router.config import AdapterConfig
from radixmesh.router.dispatch import RequestRouter
from radixmesh.router.policies import create_policy
from radixmesh.router.workers import WorkerHandle
from tests.redis_helpers import local_redis  # noqa: F401  (fixture)
from tests.unit.router_factory import make_config as make_router_config
from tests.unit.router_factory import make_registry, make_request, set_load

from .index_factory import make_config, make_writer, published

pytestmark = pytest.mark.integration


def test_lease_names_adapters_and_a_change_moves_the_lease_counter(local_redis: LocalRedis) -> None:  # noqa: F811
    async def run() -> None:
        config = make_config(local_redis)
        keys = IndexKeys(config.namespace)
        raw = sync_redis.Redis.from_url(config.redis_url)
        writer = make_writer(config, "w")
        writer.set_lora_adapters(["sql", "chat", "sql"], 4)  # before the first publish: the first lease has them
        await writer.start()
        await published(writer)
        lease = parse_lease("w", raw.get(keys.lease("w")))
        assert lease is not None and lease.lora_adapters == ("chat", "sql") and lease.max_loras_per_batch == 4
        version = int(raw.get(keys.lease_version) or 0)
        writer.set_lora_adapters(["chat", "sql"], 4)  # no change: nothing written
        await published(writer)
        assert writer.num_lease_rewrites == 0 and int(raw.get(keys.lease_version) or 0) == version
        writer.set_lora_adapters(["chat"], 4)
        await published(writer)
        lease = parse_lease("w", raw.get(keys.lease("w")))
        assert lease is not None and lease.lora_adapters == ("chat",) and lease.epoch == writer.epoch
        assert writer.num_lease_rewrites == 1 and int(raw.get(keys.lease_version) or 0) == version + 1
        reader = KVIndexReader(config, connect(config))
        assert (await reader.live_leases(max_age_s=0))["w"].lora_adapters == ("chat",)
        raw.delete(keys.lease("w"))  # a lapsed lease: the rewrite notices and the writer republishes
        writer.set_lora_adapters(["chat", "code"], 4)
        await published(writer)
        lease = parse_lease("w", raw.get(keys.lease("w")))
        assert lease is not None and lease.lora_adapters == ("chat", "code") and writer.num_resyncs >= 2
        await writer.close()
        await reader.close()
        raw.close()

    asyncio.run(run())


async def _index_router(config_overrides: dict[str, object], reader: KVIndexReader,
                        policy: str = "round-robin") -> tuple[RequestRouter, list[WorkerHandle]]:
    config = dataclasses.replace(make_router_config(), adapters=AdapterConfig(), **config_overrides)
    registry = make_registry(2)
    router = RequestRouter(config, registry, create_policy(policy, config), reader=reader)
    return router, sorted(registry.all(), key=lambda w: w.worker_id)


async def _landing(router: RequestRouter, adapter: str, num: int = 20) -> set[str]:
    workers = set()
    for i in range(num):
        request = dataclasses.replace(make_request(i, 2, rid=f"{adapter}{i}"), lora_name=adapter)
        workers.add((await router.select(request)).worker.worker_id)
    return workers


def test_router_affinity_follows_the_index(local_redis: LocalRedis) -> None:  # noqa: F811
    async def run() -> None:
        config = make_config(local_redis, lease_cache_s=0.0)
        writers: list[KVIndexWriter] = []
        for wid, held in (("w0", ["a0", "a1"]), ("w1", ["a2", "a3"])):
            writer = KVIndexWriter(config, WriterIdentity(worker_id=wid, address=f"127.0.0.1:{6000 + len(writers)}"))
            writer.set_lora_adapters(held, 4)
            await writer.start()
            writers.append(writer)
        await published(*writers)
        reader = KVIndexReader(config, connect(config))
        await reader.live_leases(max_age_s=0)
        router, workers = await _index_router({}, reader)
        # GetLoad has not reported adapters yet (or reports them stale): the index places them
        set_load(workers[0], lora_adapters=(("a2", 0, 0),), max_loras_per_batch=4)
        for adapter, holder in (("a0", "w0"), ("a1", "w0"), ("a2", "w1"), ("a3", "w1")):
            assert await _landing(router, adapter) == {holder}
        writers[0].set_lora_adapters(["a0", "a1", "a3"], 4)  # w0 loads a3 (say, through its own HTTP API)
        await published(writers[0])
        await reader.live_leases(max_age_s=0)
        assert await _landing(router, "a3") == {"w0", "w1"}
        writers[1].set_lora_adapters(["a2"], 4)  # w1 unloads a3
        await published(writers[1])
        await reader.live_leases(max_age_s=0)
        assert await _landing(router, "a3") == {"w0"}
        await writers[1].close()  # w1's lease is withdrawn: its GetLoad speaks for it again
        await reader.live_leases(max_age_s=0)
        set_load(workers[1], lora_adapters=(("a9", 0, 0),), max_loras_per_batch=4)
        assert await _landing(router, "a9") == {"w1"}
        await writers[0].close()
        await reader.close()

    asyncio.run(run())


def test_router_never_waits_on_a_redis_that_hangs(local_redis: LocalRedis) -> None:  # noqa: F811
    async def run() -> None:
        config = make_config(local_redis, lease_cache_s=0.0)
        reader = KVIndexReader(config, connect(config))
        reads: list[int] = []

        async def hung_read() -> dict[str, WorkerLease]:
            reads.append(1)
            await asyncio.Event().wait()  # a Redis that never answers
            return {}

        reader._read_leases = hung_read  # type: ignore[method-assign]
        router, workers = await _index_router({}, reader)
        set_load(workers[1], lora_adapters=(("a2", 0, 0),), max_loras_per_batch=4)
        landed = await asyncio.wait_for(_landing(router, "a2", num=5), 10)  # GetLoad decides meanwhile
        assert landed == {"w1"}
        await asyncio.sleep(0.2)
        assert await asyncio.wait_for(_landing(router, "a2", num=5), 10) == {"w1"}
        assert len(reads) == 1  # one background read, hung: no request waited for it, none started another
        assert reader._refresh is not None
        reader._refresh.cancel()
        await reader.close()

    asyncio.run(run())
