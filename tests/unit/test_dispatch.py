"""Admission and fan-out of generation requests (gateway/dispatch.py) on its own, over the fake gateway backend:
checks before anything runs, the queue limit, sequence ids, the merged stream of n > 1 sequences, aborts, and
the admission given back however a request ends."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from radixmesh.common.errors import ErrorCode, RadixMeshError
from radixmesh.gateway.dispatch import Dispatcher, PromptJob
from radixmesh.gateway.metrics import GatewayMetrics
from radixmesh.wire.outputs import GenerationChunk
from radixmesh.wire.sampling import SamplingParams

from .test_gateway_api import FakeBackend


def dispatcher(backend: FakeBackend | None = None, max_queued: int | None = 1) -> tuple[Dispatcher, FakeBackend]:
    backend = backend or FakeBackend(max_running_requests=2)
    return Dispatcher(backend, GatewayMetrics("fake-model"), max_queued), backend


def job(text: str = "hi", max_new_tokens: int = 3, n: int = 1) -> PromptJob:
    return PromptJob([ord(c) % 100 for c in text], SamplingParams(max_new_tokens=max_new_tokens, n=n))


async def run(generation: Any) -> list[tuple[int, GenerationChunk]]:
    try:
        return [item async for item in generation.stream()]
    finally:
        await generation.aclose()


def test_a_request_runs_its_sequence_and_gives_its_admission_back() -> None:
    d, _ = dispatcher()
    generation = d.open("/v1/completions", [job(max_new_tokens=2)], request_id="req")
    assert d.num_in_flight == 1 and d.active == {"req": generation} and generation.rids == ["req"]
    items = asyncio.run(run(generation))
    assert [i for i, _ in items] == [0, 0] and items[-1][1].finish_reason == "length"
    assert d.num_in_flight == 0 and d.active == {}


def test_sequences_are_numbered_prompt_major_and_stream_merged() -> None:
    d, backend = dispatcher(max_queued=None)
    generation = d.open("/v1/completions", [job("ab", n=2), job("cd")], request_id="req")
    assert generation.rids == ["req-0", "req-1", "req-2"] and generation.num_seqs == 3
    items = asyncio.run(run(generation))
    assert sorted({i for i, _ in items}) == [0, 1, 2]
    for index in range(3):
        chunks = [c for i, c in items if i == index]
        assert "".join(c.text for c in chunks) == "abc" and chunks[-1].finished
    assert backend.cached_prefixes == [[97, 98]]  # the shared prompt of the n = 2 pair, prefilled once first


def test_given_sequence_ids_must_match_the_sequences() -> None:
    d, _ = dispatcher(max_queued=None)
    generation = d.open("/generate", [job(n=2)], rids=["x", "y"])
    assert generation.rids == ["x", "y"]
    asyncio.run(generation.aclose())
    with pytest.raises(RadixMeshError) as info:
        d.open("/generate", [job(n=2)], rids=["only-one"])
    assert info.value.param == "rid" and d.num_in_flight == 0


def test_the_queue_limit_counts_sequences_and_refuses_with_429() -> None:
    d, _ = dispatcher(max_queued=1)  # 2 running + 1 queued
    assert d.capacity == 3
    first = d.open("/v1/completions", [job(n=2)])
    with pytest.raises(RadixMeshError) as info:
        d.open("/v1/completions", [job(n=2)])
    assert info.value.code is ErrorCode.RESOURCE_EXHAUSTED and "2 sequences in flight, at most 3" in info.value.message
    assert d.metrics.registry.get_sample_value("radixmesh_requests_rejected_total") == 1
    second = d.open("/v1/completions", [job()])  # one more fits
    assert d.num_in_flight == 3
    for generation in (first, second):
        asyncio.run(generation.aclose())
    assert d.num_in_flight == 0
    unlimited, _ = dispatcher(max_queued=None)
    assert unlimited.capacity is None


def test_checks_come_before_admission() -> None:
    d, _ = dispatcher()
    with pytest.raises(RadixMeshError) as info:
        d.open("/v1/completions", [job(), PromptJob([1], SamplingParams(top_p=5.0))])
    assert info.value.param == "top_p" and d.num_in_flight == 0
    with pytest.raises(RadixMeshError) as info:
        d.open("/v1/completions", [job("x" * 80)])
    assert info.value.param == "prompt"


def test_a_backend_that_is_not_ready_refuses_with_its_reason() -> None:
    backend = FakeBackend()
    backend.not_ready_reason = lambda: "the router at r:1 is unavailable"  # type: ignore[method-assign]
    d, _ = dispatcher(backend)
    with pytest.raises(RadixMeshError) as info:
        d.open("/v1/completions", [job()])
    assert info.value.code is ErrorCode.UNAVAILABLE and info.value.message == "the router at r:1 is unavailable"


def test_a_request_id_runs_once_at_a_time() -> None:
    d, _ = dispatcher(max_queued=None)
    first = d.open("/generate", [job()], request_id="same")
    with pytest.raises(RadixMeshError, match="already running"):
        d.open("/generate", [job()], request_id="same")
    asyncio.run(first.aclose())
    asyncio.run(d.open("/generate", [job()], request_id="same").aclose())


def test_an_abort_reaches_every_sequence_of_the_request() -> None:
    d, backend = dispatcher(FakeBackend(delay_s=0.01), max_queued=None)

    async def go() -> list[tuple[int, GenerationChunk]]:
        generation = d.open("/generate", [job(max_new_tokens=200, n=2)], request_id="req")
        items: list[tuple[int, GenerationChunk]] = []
        try:
            async for item in generation.stream():
                items.append(item)
                if len(items) == 2:
                    await d.abort("req")
        finally:
            await generation.aclose()
        return items

    items = asyncio.run(go())
    assert sorted(c.finish_reason for _, c in items if c.finished) == ["abort", "abort"]
    asyncio.run(d.abort("nobody"))  # an unknown id is passed on as one engine sequence id
    assert "nobody" in backend._abort_requested


def test_leaving_a_stream_early_aborts_its_sequences_and_releases_them() -> None:
    d, backend = dispatcher(FakeBackend(delay_s=0.01), max_queued=None)

    async def go() -> None:
        generation = d.open("/generate", [job(max_new_tokens=200, n=2)], request_id="req")
        async for _ in generation.stream():
            break
        await generation.aclose()
        await generation.aclose()  # idempotent

    asyncio.run(go())
    assert sorted(backend.aborted) == ["req-0", "req-1"] and d.num_in_flight == 0


def test_an_error_in_one_sequence_ends_the_merged_stream() -> None:
    class Failing(FakeBackend):
        async def generate(self, input_ids: list[int], params: SamplingParams, rid: str | None = None) -> Any:
            if rid and rid.endswith("-1"):
                raise RadixMeshError(ErrorCode.INTERNAL, "the worker crashed")
            async for chunk in super().generate(input_ids, params, rid):
                yield chunk

    d, _ = dispatcher(Failing(delay_s=0.01), max_queued=None)
    generation = d.open("/generate", [job(max_new_tokens=50, n=2)], request_id="req")
    with pytest.raises(RadixMeshError, match="the worker crashed"):
        asyncio.run(run(generation))
    assert d.num_in_flight == 0


def test_abort_all_stops_every_request() -> None:
    d, backend = dispatcher(FakeBackend(delay_s=0.01), max_queued=None)
    d.open("/generate", [job()], request_id="a")
    d.open("/generate", [job(n=2)], request_id="b")
    asyncio.run(d.abort_all())
    assert backend._abort_requested == {"a", "b-0", "b-1"}
