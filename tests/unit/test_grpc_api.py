"""The public gRPC API over the scripted fake backend: for the same request it must reach the backend
with the same token ids and sampling parameters as the HTTP API, answer the same (text, finish
reasons, logprobs, usage; unary and streaming), fail the same way, and abort on cancellation."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from radixmesh.gateway.config import GatewayConfig
from radixmesh.protocol import common_pb2
from radixmesh.protocol import inference_pb2 as pb
from tests.unit.grpc_api_harness import Gateway, error_detail, gateway, sse_events
from tests.unit.test_gateway_api import FakeBackend

FINISH = {common_pb2.FINISH_REASON_UNSPECIFIED: None, common_pb2.FINISH_REASON_STOP: "stop",
          common_pb2.FINISH_REASON_LENGTH: "length", common_pb2.FINISH_REASON_ABORT: "abort"}

EVERY_OPTION = (pb.GenerationOptions(max_tokens=6, min_tokens=2, temperature=0.7, top_p=0.9, top_k=5, min_p=0.1,
                                     frequency_penalty=0.5, presence_penalty=0.25, repetition_penalty=1.1,
                                     stop=["zz"], stop_token_ids=[7], ignore_eos=True, seed=3, n=2,
                                     logit_bias={5: -100.0}, skip_special_tokens=False, logprobs=True,
                                     top_logprobs=2, regex="[a-z]+"),
                {"max_tokens": 6, "min_tokens": 2, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.1,
                 "frequency_penalty": 0.5, "presence_penalty": 0.25, "repetition_penalty": 1.1, "stop": ["zz"],
                 "stop_token_ids": [7], "ignore_eos": True, "seed": 3, "n": 2, "logit_bias": {"5": -100.0},
                 "skip_special_tokens": False, "regex": "[a-z]+"})

COMPLETIONS: list[tuple[str, pb.CompleteRequest, dict[str, Any]]] = [
    ("defaults", pb.CompleteRequest(text="hello"), {"prompt": "hello"}),
    ("every-option", pb.CompleteRequest(token_ids=pb.TokenIds(ids=[1, 2, 3, 4]), options=EVERY_OPTION[0]),
     {"prompt": [1, 2, 3, 4], **EVERY_OPTION[1], "logprobs": 2}),
    ("echo-json-object", pb.CompleteRequest(model="fake", text="abc", echo=True, options=pb.GenerationOptions(
        max_tokens=3, json_object=True)), {"model": "fake", "prompt": "abc", "echo": True, "max_tokens": 3,
                                           "response_format": {"type": "json_object"}}),
    ("json-schema", pb.CompleteRequest(text="q", options=pb.GenerationOptions(
        max_tokens=2, json_schema='{"type": "object"}', logprobs=True)),
     {"prompt": "q", "max_tokens": 2, "json_schema": '{"type": "object"}', "logprobs": 0}),
]

CHATS: list[tuple[str, pb.ChatRequest, dict[str, Any]]] = [
    ("defaults", pb.ChatRequest(messages=[pb.ChatTurn(role="user", content="hi")]),
     {"messages": [{"role": "user", "content": "hi"}]}),
    ("every-option", pb.ChatRequest(model="fake-model", messages=[
        pb.ChatTurn(role="system", content="be brief"), pb.ChatTurn(role="user", content="hi")],
        options=EVERY_OPTION[0]),
     {"model": "fake-model", "messages": [{"role": "system", "content": "be brief"},
                                          {"role": "user", "content": "hi"}],
      **EVERY_OPTION[1], "logprobs": True, "top_logprobs": 2}),
    ("ebnf", pb.ChatRequest(messages=[pb.ChatTurn(role="user", content="x")], options=pb.GenerationOptions(
        max_tokens=3, ebnf='root ::= "a"+')),
     {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "ebnf": 'root ::= "a"+'}),
]


def _logprob_rows(entries: Any) -> list[tuple[str, float, list[tuple[str, float]]]]:
    return [(e.token, round(e.logprob, 6), [(t.token, round(t.logprob, 6)) for t in e.top_logprobs])
            for e in entries]


def _http_completion_logprobs(lp: dict[str, Any] | None) -> list[tuple[str, float, list[tuple[str, float]]]]:
    if lp is None:
        return []
    return [(tok, round(lp["token_logprobs"][i], 6),
             [(t, round(v, 6)) for t, v in (lp["top_logprobs"][i] or {}).items()])
            for i, tok in enumerate(lp["tokens"])]


def _http_chat_logprobs(lp: dict[str, Any] | None) -> list[tuple[str, float, list[tuple[str, float]]]]:
    if lp is None or lp.get("content") is None:
        return []
    return [(e["token"], round(e["logprob"], 6), [(t["token"], round(t["logprob"], 6)) for t in e["top_logprobs"]])
            for e in lp["content"]]


def _usage(usage: Any) -> tuple[int, int, int, int]:
    if isinstance(usage, dict):
        return (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"],
                usage["prompt_tokens_details"]["cached_tokens"])
    return usage.prompt_tokens, usage.completion_tokens, usage.total_tokens, usage.cached_tokens


async def _pair(run_http: Any, run_grpc: Any) -> tuple[Any, Any, FakeBackend, FakeBackend]:
    """Run one request on HTTP and its twin on gRPC, each against a fresh backend."""
    async with gateway() as http_side, gateway() as grpc_side:
        http_result = await run_http(http_side)
        grpc_result = await run_grpc(grpc_side)
        return http_result, grpc_result, http_side.backend, grpc_side.backend


@pytest.mark.parametrize("name,request_pb,body", COMPLETIONS, ids=[c[0] for c in COMPLETIONS])
def test_complete_equals_http(name: str, request_pb: pb.CompleteRequest, body: dict[str, Any]) -> None:
    async def http(gw: Gateway) -> dict[str, Any]:
        response = await gw.http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        return dict(response.json())

    async def rpc(gw: Gateway) -> pb.CompleteResponse:
        return await gw.stub.Complete(request_pb)

    out_http, out_grpc, backend_http, backend_grpc = asyncio.run(_pair(http, rpc))
    assert backend_grpc.seen_params == backend_http.seen_params and backend_http.seen_params
    assert out_grpc.model == out_http["model"]
    assert [(c.index, c.text, FINISH[c.finish_reason], _logprob_rows(c.logprobs)) for c in out_grpc.choices] == \
        [(c["index"], c["text"], c["finish_reason"], _http_completion_logprobs(c["logprobs"]))
         for c in out_http["choices"]]
    assert _usage(out_grpc.usage) == _usage(out_http["usage"])
    for choice in out_grpc.choices:  # token ids out: the fake's output token i is i % 26
        assert list(choice.token_ids) == [i % 26 for i in range(len(choice.token_ids))]
        assert choice.token_ids


@pytest.mark.parametrize("name,request_pb,body", COMPLETIONS, ids=[c[0] for c in COMPLETIONS])
def test_stream_complete_equals_http(name: str, request_pb: pb.CompleteRequest, body: dict[str, Any]) -> None:
    async def http(gw: Gateway) -> list[dict[str, Any]]:
        stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        response = await gw.http.post("/v1/completions", json=stream_body)
        assert response.status_code == 200, response.text
        return sse_events(response.text)

    async def rpc(gw: Gateway) -> list[pb.CompleteResponse]:
        return [m async for m in gw.stub.StreamComplete(request_pb)]

    events, messages, backend_http, backend_grpc = asyncio.run(_pair(http, rpc))
    assert backend_grpc.seen_params == backend_http.seen_params
    assert [[(c.index, c.text, FINISH[c.finish_reason], _logprob_rows(c.logprobs)) for c in m.choices]
            for m in messages] == \
        [[(c["index"], c["text"], c["finish_reason"], _http_completion_logprobs(c["logprobs"]))
          for c in e["choices"]] for e in events]
    assert not messages[-1].choices and _usage(messages[-1].usage) == _usage(events[-1]["usage"])
    assert all(not m.HasField("usage") for m in messages[:-1])
    assert len({m.id for m in messages}) == 1


@pytest.mark.parametrize("name,request_pb,body", CHATS, ids=[c[0] for c in CHATS])
def test_chat_equals_http(name: str, request_pb: pb.ChatRequest, body: dict[str, Any]) -> None:
    async def http(gw: Gateway) -> dict[str, Any]:
        response = await gw.http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        return dict(response.json())

    async def rpc(gw: Gateway) -> pb.ChatResponse:
        return await gw.stub.Chat(request_pb)

    out_http, out_grpc, backend_http, backend_grpc = asyncio.run(_pair(http, rpc))
    assert backend_grpc.seen_params == backend_http.seen_params and backend_http.seen_params
    assert [(c.index, c.role, c.content, FINISH[c.finish_reason], _logprob_rows(c.logprobs))
            for c in out_grpc.choices] == \
        [(c["index"], c["message"]["role"], c["message"]["content"], c["finish_reason"],
          _http_chat_logprobs(c["logprobs"])) for c in out_http["choices"]]
    assert _usage(out_grpc.usage) == _usage(out_http["usage"])


@pytest.mark.parametrize("name,request_pb,body", CHATS, ids=[c[0] for c in CHATS])
def test_stream_chat_equals_http(name: str, request_pb: pb.ChatRequest, body: dict[str, Any]) -> None:
    async def http(gw: Gateway) -> list[dict[str, Any]]:
        response = await gw.http.post("/v1/chat/completions",
                                      json={**body, "stream": True, "stream_options": {"include_usage": True}})
        assert response.status_code == 200, response.text
        return sse_events(response.text)

    async def rpc(gw: Gateway) -> list[pb.ChatResponse]:
        return [m async for m in gw.stub.StreamChat(request_pb)]

    events, messages, backend_http, backend_grpc = asyncio.run(_pair(http, rpc))
    assert backend_grpc.seen_params == backend_http.seen_params
    assert [[(c.index, c.role, c.content, FINISH[c.finish_reason], _logprob_rows(c.logprobs)) for c in m.choices]
            for m in messages] == \
        [[(c["index"], c["delta"].get("role", ""), c["delta"].get("content", ""), c["finish_reason"],
           _http_chat_logprobs(c["logprobs"])) for c in e["choices"]] for e in events]
    assert _usage(messages[-1].usage) == _usage(events[-1]["usage"])
    streamed = {}
    for m in messages:
        for c in m.choices:
            streamed.setdefault(c.index, []).extend(c.token_ids)
    assert all(ids == [i % 26 for i in range(len(ids))] and ids for ids in streamed.values())


BAD_REQUESTS: list[tuple[str, pb.CompleteRequest, dict[str, Any], grpc.StatusCode, int]] = [
    ("negative-temperature", pb.CompleteRequest(text="a", options=pb.GenerationOptions(temperature=-1)),
     {"prompt": "a", "temperature": -1.0}, grpc.StatusCode.INVALID_ARGUMENT, 400),
    ("unknown-model", pb.CompleteRequest(model="gpt-9", text="a"), {"model": "gpt-9", "prompt": "a"},
     grpc.StatusCode.NOT_FOUND, 404),
    ("max-tokens-beyond-context", pb.CompleteRequest(text="a", options=pb.GenerationOptions(max_tokens=1000)),
     {"prompt": "a", "max_tokens": 1000}, grpc.StatusCode.INVALID_ARGUMENT, 400),
    ("too-many-top-logprobs", pb.CompleteRequest(text="a", options=pb.GenerationOptions(logprobs=True,
                                                                                        top_logprobs=30)),
     {"prompt": "a", "logprobs": 30}, grpc.StatusCode.INVALID_ARGUMENT, 400),
    ("prompt-too-long", pb.CompleteRequest(text="a" * 80), {"prompt": "a" * 80}, grpc.StatusCode.INVALID_ARGUMENT, 400),
    ("logit-bias-out-of-range", pb.CompleteRequest(text="a", options=pb.GenerationOptions(logit_bias={1: 500})),
     {"prompt": "a", "logit_bias": {"1": 500.0}}, grpc.StatusCode.INVALID_ARGUMENT, 400),
]


@pytest.mark.parametrize("name,request_pb,body,status,http_status", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_errors_equal_http(name: str, request_pb: pb.CompleteRequest, body: dict[str, Any], status: grpc.StatusCode,
                           http_status: int) -> None:
    async def run() -> None:
        async with gateway() as gw:
            response = await gw.http.post("/v1/completions", json=body)
            assert response.status_code == http_status, response.text
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await gw.stub.Complete(request_pb)
            assert caught.value.code() == status
            error = response.json()["error"]
            assert caught.value.details() == error["message"]
            detail = error_detail(caught.value)
            assert detail.param == (error["param"] or "") and detail.service == "gateway"
            assert gw.app.state.gateway.dispatcher.num_in_flight == 0

    asyncio.run(run())


def test_shape_errors_name_the_field() -> None:
    async def run() -> None:
        async with gateway() as gw:
            cases = [(gw.stub.Complete(pb.CompleteRequest()), "prompt"),
                     (gw.stub.Chat(pb.ChatRequest()), "messages"),
                     (gw.stub.Chat(pb.ChatRequest(messages=[pb.ChatTurn(role="tool", content="x")])), "messages"),
                     (gw.stub.Complete(pb.CompleteRequest(text="a", options=pb.GenerationOptions(top_logprobs=2))),
                      "top_logprobs")]
            for call, param in cases:
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await call
                assert caught.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNIMPLEMENTED)
                assert error_detail(caught.value).param == param, caught.value.details()

    asyncio.run(run())


def test_overload_is_resource_exhausted() -> None:
    async def run() -> None:
        backend = FakeBackend(delay_s=0.2, max_running_requests=1)  # the first streams for 4 s: a loaded machine
        async with gateway(backend, GatewayConfig(grpc_port=0, max_queued_requests=0)) as gw:
            first = gw.stub.StreamComplete(pb.CompleteRequest(text="a", options=pb.GenerationOptions(max_tokens=20)))
            await first.read()  # admitted and streaming
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await gw.stub.Complete(pb.CompleteRequest(text="b"))
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            first.cancel()

    asyncio.run(run())


def test_cancelled_stream_aborts_and_frees_admission() -> None:
    async def run() -> None:
        backend = FakeBackend(delay_s=0.1)  # the branches run 4 s: the cancellation reaches them first, even loaded
        async with gateway(backend) as gw:
            call = gw.stub.StreamChat(pb.ChatRequest(messages=[pb.ChatTurn(role="user", content="hi")],
                                                     options=pb.GenerationOptions(max_tokens=40, n=2)))
            for _ in range(4):
                await call.read()
            call.cancel()
            dispatcher = gw.app.state.gateway.dispatcher
            for _ in range(500):
                if dispatcher.num_in_flight == 0 and len(backend.aborted) == 2:
                    break
                await asyncio.sleep(0.02)
            assert dispatcher.num_in_flight == 0 and not dispatcher.active
            assert len(backend.aborted) == 2, backend.aborted  # both branches stopped early

    asyncio.run(run())


def test_list_models() -> None:
    async def run() -> None:
        async with gateway() as gw:
            reply = await gw.stub.ListModels(pb.ListModelsRequest())
            http = (await gw.http.get("/v1/models")).json()["data"]
            assert [(m.id, m.created, m.owned_by, m.root, m.max_model_len) for m in reply.models] == \
                [(m["id"], m["created"], m["owned_by"], m["root"], m["max_model_len"]) for m in http]

    asyncio.run(run())


def test_health_follows_readiness_and_calls_wait() -> None:
    async def run() -> None:
        async with gateway(attach=False) as gw:
            health = health_pb2_grpc.HealthStub(gw.channel)
            reply = await health.Check(health_pb2.HealthCheckRequest(service=""))
            assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
            live = await health.Check(health_pb2.HealthCheckRequest(service="liveness"))
            assert live.status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await gw.stub.Complete(pb.CompleteRequest(text="a"))
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            gw.server.attach(gw.app.state.gateway)
            for service in ("", "radixmesh.v1.InferenceService"):
                reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            assert (await gw.stub.Complete(pb.CompleteRequest(text="a"))).choices

    asyncio.run(run())


async def list_services(channel: grpc.aio.Channel, metadata: tuple[tuple[str, str], ...] = ()) -> list[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    call = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                     metadata=metadata)
    names = []
    async for reply in call:
        names += [s.name for s in reply.list_services_response.service]
    return names


def test_reflection_lists_the_public_service() -> None:
    async def run() -> None:
        async with gateway() as gw:
            services = await list_services(gw.channel)
            assert "radixmesh.v1.InferenceService" in services and "grpc.health.v1.Health" in services
            stub = reflection_pb2_grpc.ServerReflectionStub(gw.channel)
            call = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
                file_containing_symbol="radixmesh.v1.InferenceService")]))
            replies = [r async for r in call]
            assert replies[0].file_descriptor_response.file_descriptor_proto  # grpcurl can describe it

    asyncio.run(run())
