"""Loading and unloading LoRA adapters through the router (what a cluster gateway's /load_lora_adapter and
/unload_lora_adapter do): every serving worker or a named one, errors with the worker's code naming the worker,
and routing that follows at once."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from radixmesh.common.errors import ErrorCode, RadixMeshError, invalid_argument, not_found
from radixmesh.protocol import common_pb2
from radixmesh.router.config import AdapterConfig
from radixmesh.router.dispatch import RequestRouter
from radixmesh.router.lora_control import LoraControl
from radixmesh.router.policies import create_policy
from radixmesh.router.workers import WorkerHandle

from .router_factory import make_config, make_registry, make_request, set_load


class AdapterWorker:
    """A worker's LoRA calls: adapters by name; a path containing "bad" is refused as a mismatch."""

    def __init__(self, held: tuple[str, ...] = ()) -> None:
        self.adapters = {name: f"/adapters/{name}" for name in held}

    async def load_lora_adapter(self, name: str, path: str) -> common_pb2.LoadLoraAdapterResponse:
        await asyncio.sleep(0)
        if name in self.adapters:
            raise invalid_argument(f"LoRA adapter {name!r} is already loaded (unload it first)", "lora_name")
        if "bad" in path:
            raise invalid_argument(f"LoRA adapter {name!r}: q_proj lora_A is [8, 64], the model needs [8, 576]",
                                   "lora_path")
        self.adapters[name] = path
        return common_pb2.LoadLoraAdapterResponse(name=name, rank=8, targets=["q_proj"], load_s=0.01)

    async def unload_lora_adapter(self, name: str) -> None:
        if self.adapters.pop(name, None) is None:
            raise not_found(f"LoRA adapter {name!r} is not loaded", "lora_name")

    async def list_lora_adapters(self) -> list[common_pb2.LoraAdapterInfo]:
        return [common_pb2.LoraAdapterInfo(name=n, path=p, rank=8) for n, p in sorted(self.adapters.items())]


def _control(held: tuple[tuple[str, ...], ...] = ((), ())) -> tuple[LoraControl, RequestRouter, list[WorkerHandle]]:
    config = dataclasses.replace(make_config(), adapters=AdapterConfig())
    registry = make_registry(len(held))
    workers = sorted(registry.all(), key=lambda w: w.worker_id)
    for worker, names in zip(workers, held):
        set_load(worker, lora_adapters=tuple((n, 0, 0) for n in names), max_loras_per_batch=4)
        worker.client = AdapterWorker(names)
    router = RequestRouter(config, registry, create_policy("round-robin", config))
    return LoraControl(registry, router.adapters), router, workers


def _land(router: RequestRouter, adapter: str, num: int = 6) -> set[str]:
    async def run() -> set[str]:
        return {(await router.select(dataclasses.replace(make_request(i, 2, rid=f"r{i}"), lora_name=adapter)))
                .worker.worker_id for i in range(num)}
    return asyncio.run(run())


def _load(control: LoraControl, name: str, path: str = "", worker_id: str = "") -> common_pb2.LoadLoraAdapterResponse:
    request = common_pb2.LoadLoraAdapterRequest(name=name, path=path or f"/adapters/{name}", worker_id=worker_id)
    return asyncio.run(control.load(request))


def _unload(control: LoraControl, name: str, worker_id: str = "") -> common_pb2.UnloadLoraAdapterResponse:
    return asyncio.run(control.unload(common_pb2.UnloadLoraAdapterRequest(name=name, worker_id=worker_id)))


def test_load_goes_to_every_worker_or_the_named_one_and_routing_follows_at_once() -> None:
    control, router, workers = _control()
    reply = _load(control, "sql", worker_id="w1")
    assert list(reply.worker_ids) == ["w1"] and reply.rank == 8 and list(reply.targets) == ["q_proj"]
    assert _land(router, "sql") == {"w1"}  # before any GetLoad lists it
    reply = _load(control, "chat")
    assert list(reply.worker_ids) == ["w0", "w1"]
    assert _land(router, "chat") == {"w0", "w1"}
    reply = _load(control, "sql")  # the rest of the workers: w0 only
    assert list(reply.worker_ids) == ["w0"] and "sql" in workers[0].client.adapters
    with pytest.raises(RadixMeshError) as err:
        _load(control, "sql")
    assert err.value.code is ErrorCode.INVALID_ARGUMENT and "already loaded on every worker" in err.value.message
    listed = asyncio.run(control.list()).adapters
    assert [(a.name, list(a.worker_ids)) for a in listed] == [("chat", ["w0", "w1"]), ("sql", ["w0", "w1"])]


def test_unload_goes_to_the_holders_and_routing_leaves_them_at_once() -> None:
    control, router, _ = _control((("sql", "chat"), ("sql",)))
    assert list(_unload(control, "sql", worker_id="w0").worker_ids) == ["w0"]
    assert _land(router, "sql") == {"w1"}  # GetLoad still lists sql on w0
    assert list(_unload(control, "sql").worker_ids) == ["w1"]
    with pytest.raises(RadixMeshError) as err:
        _land(router, "sql")
    assert err.value.code is ErrorCode.NOT_FOUND and "'sql'" in err.value.message
    with pytest.raises(RadixMeshError) as err:
        _unload(control, "sql")
    assert err.value.code is ErrorCode.NOT_FOUND and "'sql' is not loaded on any worker" in err.value.message
    with pytest.raises(RadixMeshError) as err:
        _unload(control, "chat", worker_id="w1")  # the named worker's own answer
    assert err.value.code is ErrorCode.NOT_FOUND and "worker w1" in err.value.message
    assert "'chat'" in err.value.message


def test_errors_keep_the_workers_code_and_name_the_worker() -> None:
    control, _, workers = _control()
    with pytest.raises(RadixMeshError) as err:
        _load(control, "wrong", path="/adapters/bad-shape")
    assert err.value.code is ErrorCode.INVALID_ARGUMENT and err.value.param == "lora_path"
    assert err.value.message.startswith("worker w0: ") and "[8, 576]" in err.value.message
    with pytest.raises(RadixMeshError) as err:
        _load(control, "sql", worker_id="w7")
    assert err.value.code is ErrorCode.NOT_FOUND and "'w7'" in err.value.message and "w0, w1" in err.value.message
    workers[1].client.adapters["half"] = "/adapters/half"  # w1 holds it but has not published it yet
    workers[0].client = _Down()
    with pytest.raises(RadixMeshError) as err:
        _load(control, "half")
    assert err.value.code is ErrorCode.UNAVAILABLE and "worker w0" in err.value.message
    assert "succeeded on w1" in err.value.message


class _Down:
    async def load_lora_adapter(self, name: str, path: str) -> None:
        raise RadixMeshError(ErrorCode.UNAVAILABLE, "service unavailable (worker w0 at 127.0.0.1:6000)")


def test_a_gateway_routing_in_its_own_process_reaches_the_same_calls() -> None:
    """`gateway --embedded-router`: the in-process stub answers the LoRA calls, errors staying domain errors."""
    from radixmesh.gateway.embedded_router import InProcessRouterStub
    from radixmesh.router.service import RouterServicer

    _, router, _ = _control()
    stub = InProcessRouterStub(RouterServicer(router))

    async def run() -> None:
        reply = await stub.LoadLoraAdapter(common_pb2.LoadLoraAdapterRequest(name="sql", path="/a/sql"), timeout=5)
        assert list(reply.worker_ids) == ["w0", "w1"]
        listed = await stub.ListLoraAdapters(common_pb2.ListLoraAdaptersRequest(), timeout=5)
        assert [(a.name, list(a.worker_ids)) for a in listed.adapters] == [("sql", ["w0", "w1"])]
        with pytest.raises(RadixMeshError) as err:
            await stub.UnloadLoraAdapter(common_pb2.UnloadLoraAdapterRequest(name="nope"), timeout=5)
        assert err.value.code is ErrorCode.NOT_FOUND

    asyncio.run(run())
