"""Plug-ins added to two registries at run time, as a new feature would add itself: a KV transport (id and device
checks, options to its constructor, chunking by layer) and a scheduler hook (built per scheduler, in registry
order, left out where its factory says the feature is off)."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch

from radixmesh.common.errors import ErrorCode, RadixMeshError
from radixmesh.common.registry import LazyRegistry
from radixmesh.engine.disagg.transport.base import BaseKVTransport
from radixmesh.engine.disagg.transport.registry import (
    KV_TRANSPORTS,
    check_transport_device,
    check_transport_id,
    create_transport,
)
from radixmesh.engine.memory import TokenToKVPool
from radixmesh.engine.scheduler import hooks as hooks_module
from radixmesh.engine.scheduler.hooks import SCHEDULER_HOOKS, HookSet, SchedulerHook
from radixmesh.wire.disagg import KVChunk


class CudaOnly(BaseKVTransport):
    """A transport for GPU pools only (as an RDMA one would be), with an option of its own."""

    transport_id = "test-cuda-only"
    device_types: ClassVar[tuple[str, ...]] = ("cuda",)

    def __init__(self, pool: TokenToKVPool, lanes: int = 1, **kwargs: Any) -> None:
        super().__init__(pool, **kwargs)
        self.lanes = lanes

    def export(self, transfer_id: str, slots: torch.Tensor) -> list[KVChunk]:
        return []

    def receive(self, chunk: KVChunk, slots: torch.Tensor) -> None:
        self.check_chunk(chunk, slots.numel())


def pool(num_layers: int = 4, heads: int = 2, head_dim: int = 8) -> TokenToKVPool:
    return TokenToKVPool(16, num_layers, heads, head_dim, torch.float32, "cpu")


@pytest.fixture
def with_cuda_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(KV_TRANSPORTS, "test-cuda-only", f"{__name__}:CudaOnly")


def test_an_unknown_transport_is_invalid_and_the_error_lists_the_known_ones() -> None:
    with pytest.raises(RadixMeshError) as info:
        check_transport_id("carrier-pigeon")
    assert info.value.code is ErrorCode.INVALID_ARGUMENT and info.value.param == "kv_transport"
    assert "grpc" in info.value.message and "cuda-ipc" in info.value.message


def test_a_transport_added_at_run_time_is_checked_against_the_pools_device(with_cuda_only: None) -> None:
    check_transport_id("test-cuda-only")
    check_transport_device("test-cuda-only", "cuda")
    with pytest.raises(RadixMeshError) as info:
        check_transport_device("test-cuda-only", "cpu")
    assert info.value.code is ErrorCode.UNSUPPORTED and info.value.param == "kv_transport"
    assert "needs the KV pool on cuda, not cpu" in info.value.message


def test_options_reach_the_transports_constructor(with_cuda_only: None) -> None:
    transport = create_transport("test-cuda-only", pool(), lanes=3, max_chunk_bytes=1024)
    assert isinstance(transport, CudaOnly) and transport.lanes == 3 and transport.max_chunk_bytes == 1024


def test_the_plug_in_is_gone_with_its_test() -> None:
    assert "test-cuda-only" not in KV_TRANSPORTS and KV_TRANSPORTS.ids[:2] == ("grpc", "cuda-ipc")


@pytest.mark.parametrize(("budget", "num_tokens", "groups"), [
    (10**9, 4, [(0, 4)]),  # all layers fit one chunk
    (2 * 2 * 8 * 4 * 4, 4, [(0, 1), (1, 2), (2, 3), (3, 4)]),  # one layer of 4 tokens per chunk
    (2 * 2 * 8 * 4 * 4 * 3, 4, [(0, 3), (3, 4)]),  # three layers, then the last one
    (1, 4, [(0, 1), (1, 2), (2, 3), (3, 4)]),  # never less than a layer
])
def test_a_transport_cuts_kv_into_layer_groups_under_its_chunk_size(budget: int, num_tokens: int,
                                                                    groups: list[tuple[int, int]]) -> None:
    transport = CudaOnly(pool(), max_chunk_bytes=budget)
    assert transport.layer_token_bytes == 2 * 2 * 8 * 4  # K and V, 2 heads of 8 float32
    assert transport.layer_groups(num_tokens) == groups


# ---- scheduler hooks ---------------------------------------------------------------------------------------
class Counting(SchedulerHook):
    def __init__(self, name: str) -> None:
        self.name = name
        self.steps = 0

    def on_step_start(self) -> None:
        self.steps += 1

    def stats(self) -> dict[str, Any]:
        return {f"{self.name}_steps": self.steps}


def first_factory(sched: Any) -> SchedulerHook | None:
    return Counting("first") if sched.wants_first else None


def second_factory(sched: Any) -> SchedulerHook | None:
    return Counting("second")


class FakeScheduler:
    def __init__(self, wants_first: bool) -> None:
        self.wants_first = wants_first


@pytest.fixture
def only_test_hooks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The registry with two stand-in hooks alone (the real one, its order included, comes back afterwards)."""
    registry: LazyRegistry[Any] = LazyRegistry(SCHEDULER_HOOKS.kind, {
        "first": f"{__name__}:first_factory", "second": f"{__name__}:second_factory"})
    monkeypatch.setattr(hooks_module, "SCHEDULER_HOOKS", registry)


def test_hooks_are_built_in_registry_order_for_each_scheduler(only_test_hooks: None) -> None:
    hooks = HookSet.build(FakeScheduler(wants_first=True))  # type: ignore[arg-type]
    assert [h.name for h in hooks] == ["first", "second"]  # type: ignore[attr-defined]
    hooks.on_step_start()
    hooks.on_step_start()
    assert hooks.stats() == {"first_steps": 2, "second_steps": 2}
    other = HookSet.build(FakeScheduler(wants_first=True))  # type: ignore[arg-type]
    assert other.stats() == {"first_steps": 0, "second_steps": 0}  # a hook per scheduler, not shared


def test_a_factory_returning_none_leaves_its_feature_out(only_test_hooks: None) -> None:
    hooks = HookSet.build(FakeScheduler(wants_first=False))  # type: ignore[arg-type]
    assert [h.name for h in hooks] == ["second"]  # type: ignore[attr-defined]
    assert hooks.get(Counting) is hooks.hooks[0] and hooks.overriding("on_step_start") == hooks.hooks
    assert hooks.overriding("launch") == [] and not hooks.busy and hooks.flush()


@pytest.mark.parametrize(("change", "says"), [
    ({"transport": "grpc"}, "a grpc chunk reached the test-cuda-only transport"),
    ({"num_tokens": 5}, "KV of 5 tokens; 3 slots are reserved"),
    ({"layer_begin": 2, "layer_end": 2}, "layers [2, 2) are outside this model's 4"),
    ({"layer_end": 5}, "layers [0, 5) are outside"),
    ({"dtype": "bfloat16"}, "the chunk's KV is bfloat16; this pool holds float32"),
])
def test_a_chunk_that_cannot_land_in_the_reserved_slots_is_refused_by_name(change: dict[str, Any], says: str) -> None:
    transport = CudaOnly(pool())
    fields: dict[str, Any] = dict(transport="test-cuda-only", layer_begin=0, layer_end=4, num_tokens=3,
                                  dtype="float32", data=b"", num_bytes=0)
    transport.receive(KVChunk(**fields), torch.arange(3))  # fits
    with pytest.raises(RadixMeshError) as info:
        transport.receive(KVChunk(**{**fields, **change}), torch.arange(3))
    assert info.value.code is ErrorCode.INVALID_ARGUMENT and says in info.value.message
