"""The malformed-request table in process: the HTTP app over a fake backend that validates exactly as the
engine does (`validate_request`), and the worker's Generate servicer over a fake engine client.

The same tables run against real processes in tests/integration/test_bad_input.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Iterator
from typing import Any

import grpc
import pytest
from fastapi.testclient import TestClient

from radixmesh.common.errors import RadixMeshError
from radixmesh.common.grpc_errors import ERROR_METADATA_KEY, from_grpc_status
from radixmesh.engine.sampling.validation import validate_request
from radixmesh.gateway.app import create_app
from radixmesh.gateway.config import GatewayConfig
from radixmesh.gateway.limits import BodySizeLimitMiddleware, RequestLimits
from radixmesh.protocol import sampling_pb2, worker_pb2
from radixmesh.wire.messages import TokenOut
from radixmesh.wire.sampling import SamplingParams
from radixmesh.worker.config import WorkerConfig
from radixmesh.worker.service import WorkerServicer
from tests.unit.bad_input_cases import GOOD_REQUESTS, GRPC_CASES, HTTP_CASES, GrpcCase, HttpCase, check_http_error
from tests.unit.test_gateway_api import CONTEXT_LEN, VOCAB, FakeBackend


class EngineRulesBackend(FakeBackend):
    """The fake backend with the engine's own admission checks."""

    def validate(self, input_ids: list[int], params: SamplingParams) -> None:
        validate_request(input_ids, params, VOCAB, CONTEXT_LEN)


@pytest.fixture(scope="module")
def backend() -> EngineRulesBackend:
    return EngineRulesBackend()


@pytest.fixture(scope="module")
def http(backend: EngineRulesBackend) -> Iterator[TestClient]:
    with TestClient(create_app(backend, GatewayConfig())) as client:
        yield client


def test_the_tables_are_large_enough() -> None:
    assert len(HTTP_CASES) >= 40 and len(GRPC_CASES) >= 20
    assert len({case.id for case in HTTP_CASES + GRPC_CASES}) == len(HTTP_CASES) + len(GRPC_CASES)  # type: ignore[operator]


@pytest.mark.parametrize("case", HTTP_CASES, ids=lambda case: case.id)
def test_malformed_http_request_is_a_clear_4xx(http: TestClient, backend: EngineRulesBackend, case: HttpCase) -> None:
    seen = len(backend.seen_params)
    response = http.post(case.path, content=case.payload(CONTEXT_LEN), headers={"Content-Type": "application/json"})
    check_http_error(case, response.status_code, response.json())
    assert len(backend.seen_params) == seen, "a refused request reached the backend"


def test_the_app_still_serves_after_the_table(http: TestClient) -> None:
    for case in HTTP_CASES:
        http.post(case.path, content=case.payload(CONTEXT_LEN), headers={"Content-Type": "application/json"})
    assert http.get("/health").status_code == 200
    for path, body in GOOD_REQUESTS:
        response = http.post(path, json=body)
        assert response.status_code == 200, (path, response.text)
    info = http.get("/server_info").json()
    assert info["num_gateway_requests"] == 0


# ---- the body-size limit ----------------------------------------------------------------------------------
def _chunked(total: int, piece: int = 64 << 10) -> Iterator[bytes]:
    yield b'{"prompt": "'
    for _ in range(total // piece):
        yield b"a" * piece
    yield b'", "max_tokens": 2}'


def test_a_streamed_body_over_the_limit_is_413_without_content_length(http: TestClient) -> None:
    response = http.post("/v1/completions", content=_chunked(5 << 20), headers={"Content-Type": "application/json"})
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
    response = http.post("/v1/completions", content=_chunked(16 << 10), headers={"Content-Type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"  # too long, but read


def test_body_limit_middleware_hands_small_bodies_on_unchanged() -> None:
    received: list[bytes] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        message = await receive()
        received.append(message["body"])
        while message.get("more_body"):
            message = await receive()
            received.append(message["body"])

    async def run() -> None:
        messages = [{"type": "http.request", "body": b"ab", "more_body": True},
                    {"type": "http.request", "body": b"cd", "more_body": False}]

        async def receive() -> dict[str, Any]:
            return messages.pop(0)

        middleware = BodySizeLimitMiddleware(app, RequestLimits(max_request_bytes=1024))
        await middleware({"type": "http", "method": "POST", "headers": []}, receive, lambda message: None)

    asyncio.run(run())
    assert b"".join(received) == b"abcd"
    with pytest.raises(RadixMeshError):
        RequestLimits(max_request_bytes=10)


# ---- gRPC: the worker servicer ------------------------------------------------------------------------------
class _FakeEngineClient:
    """Admission exactly as EngineClient does it; a valid request produces one finished token."""

    async def generate_tokens(self, input_ids: list[int], params: SamplingParams, rid: str | None = None,
                              prefill_only: bool = False) -> AsyncGenerator[TokenOut, None]:
        validate_request(input_ids, params, VOCAB, CONTEXT_LEN, generates=not prefill_only)
        yield TokenOut(rid=rid or "", token_ids=[7], prompt_tokens=len(input_ids), cached_tokens=0,
                       completion_tokens=1, finish_reason="length")


class _Aborted(Exception):
    pass


class _FakeContext:
    def __init__(self) -> None:
        self.trailing: Any = ()
        self.status: grpc.StatusCode | None = None
        self.details = ""

    def set_trailing_metadata(self, trailing: Any) -> None:
        self.trailing = trailing

    async def abort(self, status: grpc.StatusCode, details: str) -> None:
        self.status, self.details = status, details
        raise _Aborted(details)


def _call_generate(request: worker_pb2.GenerateRequest) -> tuple[_FakeContext, list[worker_pb2.GenerateResponse]]:
    servicer = WorkerServicer(_FakeEngineClient(), WorkerConfig(peer_fetch="off"))  # type: ignore[arg-type]
    context = _FakeContext()

    async def run() -> list[worker_pb2.GenerateResponse]:
        return [msg async for msg in servicer.Generate(request, context)]  # type: ignore[arg-type]

    try:
        return context, asyncio.run(run())
    except _Aborted:
        return context, []


@pytest.mark.parametrize("case", GRPC_CASES, ids=lambda case: case.id)
def test_malformed_grpc_generate_is_invalid_argument(case: GrpcCase) -> None:
    request = worker_pb2.GenerateRequest(request_id=case.id, token_ids=case.ids(CONTEXT_LEN),
                                         sampling_params=case.params)
    context, out = _call_generate(request)
    assert context.status is grpc.StatusCode.INVALID_ARGUMENT, (case.id, out)
    assert any(key == ERROR_METADATA_KEY for key, _ in context.trailing)
    error = from_grpc_status(context.status, context.details, context.trailing)
    assert error.param == case.param, (case.id, error)
    assert (case.mention or case.param) in error.message, (case.id, error)


def test_a_valid_grpc_generate_still_streams() -> None:
    context, out = _call_generate(worker_pb2.GenerateRequest(token_ids=[1, 2, 3],
                                                             sampling_params=sampling_pb2.SamplingParams(max_new_tokens=4)))
    assert context.status is None and out[-1].token_ids == [7]
