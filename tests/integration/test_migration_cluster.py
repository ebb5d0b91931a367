"""kill -9 of a worker mid-stream with real processes (default model, CPU): the stream moves to the other
worker and the client gets the same answer as a run without the fault.

Two unified workers, a router (round-robin, so the two choices of an n = 2 request land on both workers), a
tokenizer and a gateway. Each case first runs its request undisturbed (the reference), then again while the
worker running it is killed (process group, SIGKILL) after a given number of streamed frames: at the first
token or in the middle, greedy, seeded, with a JSON schema, with n = 2. The killed worker is restarted on
its port in the background; the next case waits until the router sees both workers again. Last, SIGTERM on a
worker mid-stream (drain with a short timeout) hands its stream over the same way.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import httpx
import jsonschema
import pytest

from radixmesh.protocol import router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.integration.service_procs import ServiceProc, start_service, stop_all, wait_all_ready

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ENGINE = ["--device", "cpu", "--max-total-tokens", "4096", "--max-running-requests", "8"]
THREADS = {"OMP_NUM_THREADS": "1"}
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "population": {"type": "integer"}},
          "required": ["city", "population"]}


@dataclass
class Cluster:
    workers: list[ServiceProc]
    router: ServiceProc
    gateway: ServiceProc
    others: list[ServiceProc]
    restarts: list[threading.Thread] = field(default_factory=list)

    def all(self) -> list[ServiceProc]:
        return [self.gateway, self.router, *self.workers, *self.others]


def start_worker(drain_timeout_s: float = 30.0, port: int | None = None) -> ServiceProc:
    return start_service("worker", [*ENGINE, "--metrics-port", "-1", "--drain-timeout-s", str(drain_timeout_s)],
                         env=THREADS, wait_ready=False, port=port, new_session=True)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    workers = [start_worker(), start_worker()]
    tokenizer = start_service("tokenizer", ["--metrics-port", "-1"], wait_ready=False)
    router = start_service("router", ["--workers", ",".join(w.address for w in workers), "--policy", "round-robin",
                                      "--health-interval-s", "0.3", "--wait-for-worker-s", "120",
                                      "--metrics-port", "-1"], wait_ready=False)
    gateway = start_service("gateway", ["--router", router.address, "--tokenizer", tokenizer.address,
                                        "--graceful-shutdown-s", "120"], http=True, wait_ready=False)
    state = Cluster(workers, router, gateway, [tokenizer])
    try:
        wait_all_ready(state.all())
        wait_for(lambda: healthy_workers(router.address) == 2, 120, "the router to see both workers")
        yield state
    finally:
        for thread in state.restarts:
            thread.join(timeout=300)
        stop_all(state.all(), 20)


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if condition():
                return
        except grpc.RpcError:
            pass
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def healthy_workers(router_address: str) -> int:
    with grpc.insecure_channel(router_address) as channel:
        reply = router_pb2_grpc.RouterServiceStub(channel).ListWorkers(router_pb2.ListWorkersRequest(), timeout=5)
    return sum(1 for w in reply.workers if w.healthy)


def running(worker: ServiceProc) -> int:
    with grpc.insecure_channel(worker.address) as channel:
        reply = worker_pb2_grpc.WorkerServiceStub(channel).GetLoad(worker_pb2.GetLoadRequest(), timeout=10)
    return int(reply.load.num_running_reqs)


@dataclass
class Answer:
    texts: dict[int, str] = field(default_factory=dict)
    num_logprobs: dict[int, int] = field(default_factory=dict)
    usage: dict[str, Any] = field(default_factory=dict)
    finish: dict[int, str] = field(default_factory=dict)


def stream(cluster: Cluster, body: dict[str, Any], on_frame: Callable[[int], None] | None = None) -> Answer:
    """A streamed /v1/completions call; `on_frame(n)` after the n-th frame with text."""
    answer, frames = Answer(), 0
    request = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{cluster.gateway.address}/v1/completions", json=request, timeout=300) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            payload = json.loads(line[6:])
            assert "error" not in payload, payload
            if payload.get("usage"):
                answer.usage = payload["usage"]
            for choice in payload.get("choices") or []:
                index = choice["index"]
                answer.texts[index] = answer.texts.get(index, "") + choice.get("text", "")
                logprobs = choice.get("logprobs") or {}
                answer.num_logprobs[index] = answer.num_logprobs.get(index, 0) + len(logprobs.get("tokens") or [])
                if choice.get("finish_reason"):
                    answer.finish[index] = choice["finish_reason"]
                if choice.get("text") and on_frame is not None:
                    frames += 1
                    on_frame(frames)
    return answer


def kill_at(cluster: Cluster, frame: int, how: str = "kill") -> tuple[Callable[[int], None], list[ServiceProc]]:
    """An `on_frame` that, at frame `frame`, kills (or SIGTERMs) a worker running the request and restarts it."""
    hit: list[ServiceProc] = []

    def on_frame(n: int) -> None:
        if n != frame:
            return
        index = next(i for i, w in enumerate(cluster.workers) if running(w) > 0)
        victim = cluster.workers[index]
        hit.append(victim)
        if how == "kill":
            victim.kill_group()
        else:
            victim.terminate()
        thread = threading.Thread(target=restart, args=(cluster, index, victim), daemon=True)
        thread.start()
        cluster.restarts.append(thread)

    return on_frame, hit


def restart(cluster: Cluster, index: int, old: ServiceProc) -> None:
    old.proc.wait(timeout=120)
    port = int(old.address.rsplit(":", 1)[1])
    cluster.workers[index] = start_worker(port=port)


def settle(cluster: Cluster) -> None:
    """Restarted workers up and seen healthy by the router, nothing running."""
    for thread in cluster.restarts:
        thread.join(timeout=300)
    cluster.restarts.clear()
    wait_all_ready(cluster.workers)
    wait_for(lambda: healthy_workers(cluster.router.address) == 2, 120, "the router to see both workers again")
    wait_for(lambda: all(running(w) == 0 for w in cluster.workers), 60, "idle workers")
    # the gateway checks the router on its own schedule (every 0.2-2 s while the router was not ready)
    wait_for(lambda: gateway_ready(cluster), 30, "the gateway to see the router ready again")


def gateway_ready(cluster: Cluster) -> bool:
    return httpx.get(f"{cluster.gateway.address}/ready", timeout=5).status_code == 200


GREEDY = {"prompt": "The history of the city of Rome began", "max_tokens": 40, "temperature": 0.0,
          "ignore_eos": True, "logprobs": 1}
SEEDED = {"prompt": "Once upon a time, in a small village,", "max_tokens": 40, "temperature": 1.0, "seed": 1234,
          "ignore_eos": True}
N2 = {"prompt": "List three fruits:", "max_tokens": 32, "temperature": 0.8, "seed": 7, "n": 2, "ignore_eos": True}
JSON_BODY = {"prompt": "A JSON record of a big city:", "max_tokens": 60, "temperature": 0.0,
             "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}}

CASES = {
    "greedy-first-token": (GREEDY, 1),
    "greedy-middle": (GREEDY, 20),
    "seeded-middle": (SEEDED, 15),
    "json-schema-middle": (JSON_BODY, 6),
    "n2-middle": (N2, 10),
}


@pytest.mark.parametrize("case", list(CASES))
def test_kill_9_mid_stream_gives_the_unmigrated_answer(cluster: Cluster, case: str) -> None:
    body, frame = CASES[case]
    settle(cluster)
    reference = stream(cluster, body)
    on_frame, hit = kill_at(cluster, frame)
    migrated = stream(cluster, body, on_frame)
    assert hit, "no worker was killed (the stream ended first)"
    assert migrated.texts == reference.texts
    assert migrated.usage["completion_tokens"] == reference.usage["completion_tokens"]
    assert migrated.usage["prompt_tokens"] == reference.usage["prompt_tokens"]
    assert migrated.finish == reference.finish
    if "logprobs" in body:
        assert migrated.num_logprobs == {0: body["max_tokens"]}, "one log-prob per token, none lost or repeated"
    if "response_format" in body:
        jsonschema.validate(json.loads(migrated.texts[0]), SCHEMA)
    if body.get("ignore_eos"):
        assert migrated.usage["completion_tokens"] == body["max_tokens"] * body.get("n", 1)


def test_sigterm_mid_stream_drains_and_hands_the_stream_over(cluster: Cluster) -> None:
    """A worker with --drain-timeout-s 30 (the default) would finish the request; these get 0.5 s (both: which one
    the round-robin router picks depends on the calls before)."""
    settle(cluster)
    for index, old in enumerate(list(cluster.workers)):
        old.stop(30)
        cluster.workers[index] = start_worker(drain_timeout_s=0.5, port=int(old.address.rsplit(":", 1)[1]))
    settle(cluster)
    body = {**GREEDY, "max_tokens": 64}
    reference = stream(cluster, body)
    on_frame, hit = kill_at(cluster, 5, how="term")
    migrated = stream(cluster, body, on_frame)
    assert hit
    assert migrated.texts == reference.texts
    assert migrated.usage["completion_tokens"] == 64
    (drained,) = hit
    assert drained.proc.wait(timeout=60) == 0, drained.log()
    assert "drain cut 1 streams" in drained.log(), "the stream outlived the drain timeout and was handed over"


def test_a_draining_gateway_finishes_its_streams_and_takes_no_new_ones(cluster: Cluster) -> None:
    """SIGTERM on the gateway mid-stream (stops the module's gateway: keep last): it stops listening at once (the
    Service drops it), finishes the stream it relays within its --graceful-shutdown-s, and exits 0."""
    settle(cluster)
    refused: list[bool] = []

    def on_frame(n: int) -> None:
        if n != 3:
            return
        cluster.gateway.terminate()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not refused:
            try:
                httpx.get(f"{cluster.gateway.address}/health", timeout=1)
            except httpx.TransportError:
                refused.append(True)
            time.sleep(0.05)

    answer = stream(cluster, {**GREEDY, "max_tokens": 48}, on_frame)
    assert refused, "the draining gateway still accepted connections"
    assert answer.usage["completion_tokens"] == 48 and answer.finish == {0: "length"}
    assert cluster.gateway.proc.wait(timeout=60) == 0, cluster.gateway.log()
