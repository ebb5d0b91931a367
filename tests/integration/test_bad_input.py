"""The malformed-request tables against real processes on the default model: `radixmesh serve` for the
HTTP API (OpenAI and native) and `radixmesh worker` for the gRPC Generate.

Every case must get its clear 4xx (or INVALID_ARGUMENT) naming the field; afterwards both services are
healthy, still answer well-formed requests, and hold no KV slots and no requests.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import pytest

from radixmesh.common.grpc_errors import from_rpc_error
from radixmesh.protocol import common_pb2, sampling_pb2, worker_pb2, worker_pb2_grpc
from tests.integration.service_procs import ServiceProc, grpc_serving, start_service, stop_all, wait_all_ready
from tests.unit.bad_input_cases import GOOD_REQUESTS, GRPC_CASES, HTTP_CASES, GrpcCase, HttpCase, check_http_error

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SMALL_ENGINE = ["--device", "cpu", "--max-total-tokens", "4096", "--max-running-requests", "4"]


@pytest.fixture(scope="module")
def services() -> Iterator[dict[str, ServiceProc]]:
    """`serve` and a worker, started together."""
    procs = {"serve": start_service("serve", SMALL_ENGINE, http=True, wait_ready=False),
             "worker": start_service("worker", [*SMALL_ENGINE, "--worker-id", "bad-input-worker"], wait_ready=False)}
    wait_all_ready(list(procs.values()))
    yield procs
    stop_all(list(procs.values()))


@pytest.fixture(scope="module")
def serve_svc(services: dict[str, ServiceProc]) -> ServiceProc:
    return services["serve"]


@pytest.fixture(scope="module")
def worker_svc(services: dict[str, ServiceProc]) -> ServiceProc:
    return services["worker"]


@pytest.fixture(scope="module")
def http(serve_svc: ServiceProc) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=serve_svc.address, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def context_len(http: httpx.Client) -> int:
    length: int = http.get("/v1/models").json()["data"][0]["max_model_len"]
    return length


@pytest.fixture(scope="module")
def worker(worker_svc: ServiceProc) -> Iterator[worker_pb2_grpc.WorkerServiceStub]:
    with grpc.insecure_channel(worker_svc.address) as channel:
        yield worker_pb2_grpc.WorkerServiceStub(channel)


@pytest.fixture(scope="module")
def worker_context_len(worker: worker_pb2_grpc.WorkerServiceStub) -> int:
    length: int = worker.GetModelInfo(worker_pb2.GetModelInfoRequest(), timeout=60).context_len
    return length


@pytest.mark.parametrize("case", HTTP_CASES, ids=lambda case: case.id)
def test_malformed_http_request_is_a_clear_4xx(http: httpx.Client, context_len: int, case: HttpCase) -> None:
    response = http.post(case.path, content=case.payload(context_len), headers={"Content-Type": "application/json"})
    check_http_error(case, response.status_code, response.json())


def _wait_idle(http: httpx.Client, timeout_s: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        info: dict[str, Any] = http.get("/server_info").json()
        busy = [info[key] for key in ("kv_used_tokens", "num_running_reqs", "num_waiting_reqs", "num_gateway_requests")]
        if busy == [0, 0, 0, 0] or time.monotonic() > deadline:
            return info
        time.sleep(0.1)


def test_serve_is_healthy_and_clean_after_every_malformed_request(http: httpx.Client, serve_svc: ServiceProc,
                                                                 context_len: int) -> None:
    for case in HTTP_CASES:  # all of them again, back to back, in this test's own state
        assert http.post(case.path, content=case.payload(context_len),
                         headers={"Content-Type": "application/json"}).status_code == case.status, case.id
    assert serve_svc.proc.poll() is None
    assert http.get("/health").status_code == 200
    for path, body in GOOD_REQUESTS:
        response = http.post(path, json=body)
        assert response.status_code == 200, (path, response.text)
    info = _wait_idle(http)
    assert (info["kv_used_tokens"], info["num_running_reqs"], info["num_gateway_requests"]) == (0, 0, 0), info
    assert "Traceback" not in serve_svc.log(), serve_svc.log()[-4000:]


# ---- gRPC: the worker's Generate ---------------------------------------------------------------------------
def _generate(worker: worker_pb2_grpc.WorkerServiceStub, rid: str, ids: list[int],
              params: sampling_pb2.SamplingParams) -> list[worker_pb2.GenerateResponse]:
    request = worker_pb2.GenerateRequest(request_id=rid, token_ids=ids, sampling_params=params)
    return list(worker.Generate(request, timeout=120))


@pytest.mark.parametrize("case", GRPC_CASES, ids=lambda case: case.id)
def test_malformed_grpc_generate_is_invalid_argument(worker: worker_pb2_grpc.WorkerServiceStub,
                                                     worker_context_len: int, case: GrpcCase) -> None:
    with pytest.raises(grpc.RpcError) as info:
        _generate(worker, case.id, case.ids(worker_context_len), case.params)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT, (case.id, info.value)
    error = from_rpc_error(info.value)
    assert error.param == case.param, (case.id, error)
    assert (case.mention or case.param) in error.message, (case.id, error)


def _wait_worker_idle(worker: worker_pb2_grpc.WorkerServiceStub, timeout_s: float = 30.0) -> common_pb2.WorkerLoad:
    deadline = time.monotonic() + timeout_s
    while True:
        load = worker.GetLoad(worker_pb2.GetLoadRequest(), timeout=30).load
        if (load.num_running_reqs, load.num_waiting_reqs, load.kv_used_tokens) == (0, 0, 0) \
                or time.monotonic() > deadline:
            return load
        time.sleep(0.1)


def test_worker_is_healthy_and_clean_after_every_malformed_request(worker: worker_pb2_grpc.WorkerServiceStub,
                                                                  worker_svc: ServiceProc,
                                                                  worker_context_len: int) -> None:
    for case in GRPC_CASES:
        with pytest.raises(grpc.RpcError):
            _generate(worker, f"again-{case.id}", case.ids(worker_context_len), case.params)
    assert worker_svc.proc.poll() is None and grpc_serving(worker_svc.address)
    out = _generate(worker, "good", [1, 2, 3, 4], sampling_pb2.SamplingParams(max_new_tokens=3, temperature=0.0))
    assert out[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert sum(len(msg.token_ids) for msg in out) == 3
    load = _wait_worker_idle(worker)
    assert (load.num_running_reqs, load.num_waiting_reqs, load.kv_used_tokens) == (0, 0, 0), load
    assert "Traceback" not in worker_svc.log(), worker_svc.log()[-4000:]
