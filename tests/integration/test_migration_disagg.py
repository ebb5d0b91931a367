"""Disaggregation: kill -9 of the decode worker mid-stream moves the stream to the other decode worker, which
computes prompt and generated tokens itself, and the answer is the one a unified engine gives (default model,
CPU, grpc KV transport: one prefill worker, two decode workers, a router)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from radixmesh.protocol import common_pb2, router_pb2_grpc, sampling_pb2, worker_pb2
from tests.integration.greedy import greedy_ids
from tests.integration.service_procs import ServiceProc, start_service, stop_all, wait_all_ready
from tests.integration.test_disaggregation import long_ids, roles_seen, wait_for
from tests.integration.test_migration_cluster import running

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ENGINE = ["--device", "cpu", "--max-total-tokens", "4096", "--max-running-requests", "8", "--metrics-port", "-1",
          "--kv-transport", "grpc", "--kv-lease-s", "20"]
MAX_NEW_TOKENS = 32


@pytest.fixture(scope="module")
def disagg_cluster(default_engine: Any) -> Iterator[tuple[dict[str, ServiceProc], list[int]]]:
    threads = {"OMP_NUM_THREADS": "1"}
    procs = {"prefill": start_service("worker", [*ENGINE, "--role", "prefill"], env=threads, wait_ready=False),
             **{f"decode-{i}": start_service("worker", [*ENGINE, "--role", "decode", "--prefill-timeout-s", "6"],
                                             env=threads, wait_ready=False, new_session=True) for i in range(2)}}
    workers = ",".join(p.address for p in procs.values())
    procs["router"] = start_service("router", ["--workers", workers, "--pd-min-prefill-tokens", "8",
                                               "--health-interval-s", "0.3", "--metrics-port", "-1"], wait_ready=False)
    try:
        (reference,) = greedy_ids(default_engine, [long_ids(5)], MAX_NEW_TOKENS)
        wait_all_ready(list(procs.values()))
        wait_for(lambda: roles_seen(procs["router"].address) == {"prefill", "decode"}, 60, "the router to see roles")
        yield procs, reference
    finally:
        stop_all(list(procs.values()), 20)


def test_a_decode_worker_killed_mid_stream_hands_the_stream_to_the_other(
        disagg_cluster: tuple[dict[str, ServiceProc], list[int]]) -> None:
    procs, reference = disagg_cluster
    request = worker_pb2.GenerateRequest(request_id="disagg-mig", token_ids=long_ids(5), sampling_params=sampling_pb2.
                                         SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=0.0))
    got: list[int] = []
    routing: list[common_pb2.RoutingInfo] = []
    killed = ""
    with grpc.insecure_channel(procs["router"].address) as channel:
        for msg in router_pb2_grpc.RouterServiceStub(channel).Generate(request, timeout=600):
            got.extend(msg.token_ids)
            if msg.HasField("routing"):
                routing.append(msg.routing)
            if len(got) >= 6 and not killed:
                killed = next(n for n in ("decode-0", "decode-1") if running(procs[n]) > 0)
                procs[killed].kill_group()
            last = msg
    assert killed, "the stream ended before a decode worker could be killed"
    assert got == reference
    assert last.completion_tokens == MAX_NEW_TOKENS and last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert routing[0].pd_reason == "prefill-tier" and routing[0].prefill_worker_id, routing[0]
    assert len(routing) == 2 and routing[1].worker_id != routing[0].worker_id
    assert routing[1].worker_id == procs[next(n for n in ("decode-0", "decode-1") if n != killed)].address
