"""Prefill/decode disaggregation with real processes on 127.0.0.1: a prefill worker, a decode worker
and a router (default model, CPU), with the grpc KV transport and with --kv-transport auto, which picks
nixl between two CPU workers when NIXL is installed (its UCX over TCP on the loopback interface: the
stand-in for a link between nodes; tests/integration/test_nixl_faults.py has its faults mid-READ).

One set of processes per transport; its tests run in order. The fault tests stop and kill the
prefill worker, so they come last. Reference answers come from an in-process engine (the same
engine a unified worker runs), computed while the services start.
"""

from __future__ import annotations

import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from radixmesh.protocol import (
    common_pb2,
    router_pb2,
    router_pb2_grpc,
    sampling_pb2,
    worker_pb2,
    worker_pb2_grpc,
)
from tests.integration.greedy import greedy_ids
from tests.integration.service_procs import ServiceProc, start_service, stop_all, wait_all_ready

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ENGINE = ["--device", "cpu", "--max-total-tokens", "4096", "--max-running-requests", "8"]
PROMPTS = ["The capital of France is Paris. The capital of Germany is", "def fibonacci(n):\n    \"\"\"Return the",
           "Three primary colors are red, yellow and"]
MAX_NEW_TOKENS = 8
PREFILL_TIMEOUT_S = 20.0
"""Generous: on a loaded 2-core machine a 700-token prefill queued behind another took over 6 s, and each such
timeout is a fallback the tests count (the stopped-prefill test waits this long once)."""
LONG_PROMPT_LEN = 700


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path) -> Any:
    from radixmesh.engine.hf_tokenizer import load_tokenizer

    return load_tokenizer(default_model_dir)


def long_ids(seed: int, length: int = LONG_PROMPT_LEN) -> list[int]:
    return [1] + [300 + (i * 71 + seed * 977) % 9000 for i in range(length - 1)]


def reference_answers(engine: Any) -> dict[str, list[int]]:
    """Greedy output ids of a unified engine for PROMPTS and the long prompts of the fault tests."""
    prompts: list[str | list[int]] = [*PROMPTS, long_ids(0), long_ids(1)]
    return {str(p): ids for p, ids in zip(prompts, greedy_ids(engine, prompts, MAX_NEW_TOKENS))}


TRANSPORTS = {"grpc": "grpc", "auto": "nixl"}
"""--kv-transport of both workers -> the transport their transfers use."""


@pytest.fixture(scope="module", params=list(TRANSPORTS))
def kv_transport(request: pytest.FixtureRequest) -> str:
    if request.param == "auto":
        from radixmesh.engine.disagg.transport.nixl_lib import nixl_available

        if not nixl_available():
            pytest.skip("NIXL is not installed (radixmesh[nixl]): auto would pick grpc")
    return str(request.param)


@pytest.fixture(scope="module")
def used_transport(kv_transport: str) -> str:
    return TRANSPORTS[kv_transport]


@pytest.fixture(scope="module")
def started(default_engine: Any, kv_transport: str) -> Iterator[tuple[dict[str, ServiceProc], dict[str, list[int]]]]:
    """The services, and the reference answers, computed by the session's in-process engine while they start."""
    common = [*ENGINE, "--kv-transport", kv_transport, "--kv-lease-s", "60"]
    specs = {"prefill": [*common, "--role", "prefill", "--worker-id", "prefill-0", "--metrics-port", "0"],
             "decode": [*common, "--role", "decode", "--worker-id", "decode-0", "--metrics-port", "0",
                        "--prefill-timeout-s", str(PREFILL_TIMEOUT_S)]}
    threads = {"OMP_NUM_THREADS": "1",  # two engines share the machine's cores
               "UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}  # nixl's UCX: TCP on 127.0.0.1 only
    procs = {name: start_service("worker", args, env=threads, wait_ready=False) for name, args in specs.items()}
    workers = f"{procs['prefill'].address},{procs['decode'].address}"
    procs["router"] = start_service("router", ["--workers", workers, "--pd-min-prefill-tokens", "8",
                                               "--health-interval-s", "0.3", "--metrics-port", "-1"],
                                    wait_ready=False)
    try:
        answers = reference_answers(default_engine)
        wait_all_ready(list(procs.values()))
        wait_for(lambda: roles_seen(procs["router"].address) == {"prefill", "decode"}, 60, "the router to see roles")
        yield procs, answers
    finally:
        stop_all(list(procs.values()), 20)


@pytest.fixture(scope="module")
def services(started: tuple[dict[str, ServiceProc], dict[str, list[int]]]) -> dict[str, ServiceProc]:
    return started[0]


@pytest.fixture(scope="module")
def reference(started: tuple[dict[str, ServiceProc], dict[str, list[int]]]) -> dict[str, list[int]]:
    return started[1]


def roles_seen(router_address: str) -> set[str]:
    with grpc.insecure_channel(router_address) as channel:
        reply = router_pb2_grpc.RouterServiceStub(channel).ListWorkers(router_pb2.ListWorkersRequest(), timeout=5)
    return {common_pb2.WorkerRole.Name(w.role).removeprefix("WORKER_ROLE_").lower() for w in reply.workers
            if w.healthy}


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def stub(address: str) -> worker_pb2_grpc.WorkerServiceStub:
    return worker_pb2_grpc.WorkerServiceStub(grpc.insecure_channel(address))


def router(services: dict[str, ServiceProc]) -> router_pb2_grpc.RouterServiceStub:
    return router_pb2_grpc.RouterServiceStub(grpc.insecure_channel(services["router"].address))


def greedy(max_new_tokens: int = MAX_NEW_TOKENS, **kwargs: Any) -> sampling_pb2.SamplingParams:
    return sampling_pb2.SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, **kwargs)


def generate(services: dict[str, ServiceProc], ids: list[int], params: sampling_pb2.SamplingParams | None = None,
             rid: str = "") -> list[worker_pb2.GenerateResponse]:
    request = worker_pb2.GenerateRequest(request_id=rid, token_ids=ids, sampling_params=params or greedy())
    return list(router(services).Generate(request, timeout=120))


def tokens(msgs: list[worker_pb2.GenerateResponse]) -> list[int]:
    return [t for m in msgs for t in m.token_ids]


def load(services: dict[str, ServiceProc], name: str) -> worker_pb2.GetLoadResponse:
    # generous: the scheduler answers between forward passes, and a loaded machine's 700-token pass takes seconds
    reply: worker_pb2.GetLoadResponse = stub(services[name].address).GetLoad(worker_pb2.GetLoadRequest(), timeout=60)
    return reply


def busy_counters(services: dict[str, ServiceProc], name: str) -> dict[str, int]:
    """The load counters of worker `name` that are not zero (an idle worker has none)."""
    reply = load(services, name)
    load_, disagg = reply.load, reply.disagg
    counters = {"kv_used_tokens": load_.kv_used_tokens, "num_running_reqs": load_.num_running_reqs,
                "num_waiting_reqs": load_.num_waiting_reqs,
                "num_reservations_active": disagg.num_reservations_active,
                "num_reservations_pending": disagg.num_reservations_pending,
                "num_transfers_held": disagg.num_transfers_held}
    return {key: value for key, value in counters.items() if value}


def is_idle(services: dict[str, ServiceProc], name: str) -> bool:
    return not busy_counters(services, name)


def wait_both_idle(services: dict[str, ServiceProc], timeout_s: float, what: str) -> None:
    """Waits for both workers to be idle; on a timeout the message names what each still holds."""
    try:
        wait_for(lambda: is_idle(services, "decode") and is_idle(services, "prefill"), timeout_s, what)
    except AssertionError as exc:
        held = {name: busy_counters(services, name) for name in ("prefill", "decode")}
        raise AssertionError(f"{exc}; still held: {held}") from None


def metric(proc: ServiceProc, name: str, **labels: str) -> float:
    port = re.search(r"metrics on :(\d+)", proc.log())
    assert port is not None, proc.log()
    text = httpx.get(f"http://127.0.0.1:{port.group(1)}/metrics", timeout=10).text
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def test_prefill_and_decode_give_the_unified_greedy_tokens(services: dict[str, ServiceProc], tokenizer: Any,
                                                           reference: dict[str, list[int]]) -> None:
    before = load(services, "decode").disagg
    for prompt in PROMPTS:
        msgs = generate(services, tokenizer.encode(prompt))
        assert tokens(msgs) == reference[prompt], prompt
        routing = msgs[0].routing
        assert (routing.pd_reason, routing.prefill_worker_id) == ("prefill-tier", services["prefill"].address)
        assert routing.worker_id == services["decode"].address and msgs[0].worker_id == "decode-0"
        assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    after = load(services, "decode").disagg
    assert after.num_committed - before.num_committed == len(PROMPTS) and after.num_fallbacks == 0
    assert load(services, "prefill").disagg.num_exports >= len(PROMPTS)
    short = generate(services, tokenizer.encode("Hi"))  # under --pd-min-prefill-tokens: decode computes it
    assert short[0].routing.pd_reason == "short-prompt" and not short[0].routing.prefill_worker_id
    assert load(services, "decode").disagg.num_committed == after.num_committed
    wait_both_idle(services, 30, "both workers idle")


def test_the_transport_used_is_reported(services: dict[str, ServiceProc], kv_transport: str,
                                        used_transport: str) -> None:
    decode, prefill = load(services, "decode").disagg, load(services, "prefill").disagg
    assert decode.kv_transport == prefill.kv_transport == kv_transport
    assert set(decode.transfers_received_by_transport) == set(prefill.transfers_sent_by_transport) == {used_transport}
    assert decode.transfers_received_by_transport[used_transport] >= len(PROMPTS)
    assert metric(services["decode"], "radixmesh_kv_transfer_seconds_count", direction="receive",
                  transport=used_transport) >= len(PROMPTS)

    def router_view() -> worker_pb2.DisaggStats:  # what the gateway's /server_info shows
        return router(services).GetLoad(worker_pb2.GetLoadRequest(), timeout=10).disagg

    wait_for(lambda: router_view().transfers_received_by_transport[used_transport]
             == decode.transfers_received_by_transport[used_transport], 30, "the router's probe to see the transfers")
    assert router_view().kv_transport == kv_transport
    for tier in ("prefill", "decode"):  # each says at start what it uses (auto: what it can pick here)
        assert f"KV transport {kv_transport}" in services[tier].log()


def test_second_turn_transfers_only_the_new_suffix(services: dict[str, ServiceProc], tokenizer: Any,
                                                    used_transport: str) -> None:
    decode = services["decode"]
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Name three large cities in Europe."}],
                                         tokenize=False, add_generation_prompt=True)
    turn1 = tokenizer.encode(text, add_special_tokens=False)
    bytes_0 = load(services, "decode").disagg.kv_bytes_received
    metric_0 = metric(decode, "radixmesh_kv_transfer_bytes_total", direction="receive", transport=used_transport)
    answer = tokens(generate(services, turn1, greedy(12)))
    bytes_1 = load(services, "decode").disagg.kv_bytes_received
    turn2 = turn1 + answer + tokenizer.encode("<|im_end|>\n<|im_start|>user\nAnd in Asia?<|im_end|>\n"
                                              "<|im_start|>assistant\n", add_special_tokens=False)
    msgs = generate(services, turn2, greedy(4))
    assert msgs[0].routing.pd_reason == "prefill-tier"
    bytes_2 = load(services, "decode").disagg.kv_bytes_received
    first, second = bytes_1 - bytes_0, bytes_2 - bytes_1
    per_token = first // len(turn1)
    assert per_token * len(turn1) == first and per_token == 30 * 2 * 3 * 64 * 4  # layers, K+V, heads, dim, fp32
    held = len(turn1) + len(answer) - 1  # the decode worker's cache: turn 1 and its answer but the last token
    assert second == per_token * (len(turn2) - held), (first, second, len(turn1), len(turn2))
    assert second < first / 2
    sent = metric(decode, "radixmesh_kv_transfer_bytes_total", direction="receive", transport=used_transport) - metric_0
    assert sent == first + second
    print(f"\nKV bytes transferred: turn 1 {first} ({len(turn1)} tokens), turn 2 {second} "
          f"({len(turn2) - held} new of {len(turn2)} tokens)")


def start_in_thread(services: dict[str, ServiceProc], ids: list[int], params: sampling_pb2.SamplingParams,
                    rid: str = "") -> tuple[Any, dict[str, Any], threading.Thread]:
    """A routed Generate call read by a thread; returns (call, result, thread); result gets msgs or error."""
    call = router(services).Generate(worker_pb2.GenerateRequest(request_id=rid, token_ids=ids,
                                                                sampling_params=params), timeout=120)
    result: dict[str, Any] = {}

    def read() -> None:
        try:
            result["msgs"] = list(call)
        except grpc.RpcError as exc:
            result["error"] = exc.code()

    thread = threading.Thread(target=read)
    thread.start()
    return call, result, thread


def queued_on_prefill(services: dict[str, ServiceProc]) -> int:
    """Prompt tokens the prefill worker's front end has in flight and not prefilled yet (from its metrics,
    which answer while its scheduler computes; GetLoad waits for the scheduler)."""
    return int(metric(services["prefill"], "radixmesh_num_queued_prefill_tokens"))


def prefill_busy(services: dict[str, ServiceProc]) -> bool:
    return queued_on_prefill(services) > 0


def test_burst_with_aborts_leaves_both_kv_pools_empty(services: dict[str, ServiceProc]) -> None:
    long = greedy(48, ignore_eos=True)
    calls = [start_in_thread(services, long_ids(100 + i, 40 + 8 * i), long, rid=f"burst-{i}") for i in range(6)]
    time.sleep(0.5)
    calls[0][0].cancel()  # the client goes away
    # found once burst-1 reached the router and its worker (a loaded machine may take longer than the sleep above);
    # an abort that finds nothing changes nothing
    abort = worker_pb2.AbortRequest(request_id="burst-1")
    wait_for(lambda: router(services).Abort(abort, timeout=10).found, 30, "burst-1 to be in flight")
    time.sleep(0.5)
    calls[2][0].cancel()
    for _, _, thread in calls:
        thread.join(120)
    assert [calls[i][1]["msgs"][-1].finish_reason for i in (1, 3, 4, 5)] == [
        common_pb2.FINISH_REASON_ABORT, *[common_pb2.FINISH_REASON_LENGTH] * 3]
    assert [len(tokens(calls[i][1]["msgs"])) for i in (3, 4, 5)] == [48] * 3
    wait_both_idle(services, 30, "both KV pools empty")


def start_queued_behind(services: dict[str, ServiceProc], seed: int, rid: str, busy_len: int = LONG_PROMPT_LEN
                        ) -> tuple[dict[str, Any], threading.Thread, dict[str, Any], threading.Thread]:
    """A long prompt keeps the prefill worker's scheduler busy; `rid` waits behind it there (its scheduler
    takes messages between steps, so an abort lands before `rid` runs). Returns both calls' results.

    `busy_len`: the busy prompt's length, which sets how long `rid` waits."""
    _, busy, busy_thread = start_in_thread(services, long_ids(seed, busy_len), greedy(2))
    wait_for(lambda: queued_on_prefill(services) >= busy_len, 30, "the prefill worker to start")
    _, result, thread = start_in_thread(services, long_ids(seed + 1), greedy(), rid=rid)
    wait_for(lambda: queued_on_prefill(services) >= busy_len + LONG_PROMPT_LEN, 30,
             f"{rid} queued on the prefill worker")
    return busy, busy_thread, result, thread


def test_aborts_on_either_side_reach_the_other(services: dict[str, ServiceProc]) -> None:
    exports = load(services, "prefill").disagg.num_exports
    # on the decode worker (through the router): its Prefill call is cancelled, the prefill worker drops it
    # (an abort through the router travels router -> decode worker -> a cancelled Prefill call -> the prefill
    # worker's scheduler: behind a 700-token prompt it once came after `rid` was prefilled and exported)
    busy, busy_thread, result, thread = start_queued_behind(services, 20, "abort-on-decode", 3 * LONG_PROMPT_LEN)
    assert router(services).Abort(worker_pb2.AbortRequest(request_id="abort-on-decode"), timeout=10).found
    thread.join(300)
    busy_thread.join(300)
    assert result["msgs"][-1].finish_reason == common_pb2.FINISH_REASON_ABORT and tokens(result["msgs"]) == []
    assert busy["msgs"][-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert load(services, "prefill").disagg.num_exports == exports + 1  # the busy one's only
    # on the prefill worker: its ABORT result ends the sequence on the decode worker too
    busy, busy_thread, result, thread = start_queued_behind(services, 30, "abort-on-prefill")
    prefill = stub(services["prefill"].address)
    assert prefill.Abort(worker_pb2.AbortRequest(request_id="abort-on-prefill"), timeout=10).found
    thread.join(300)
    busy_thread.join(300)
    assert result["msgs"][-1].finish_reason == common_pb2.FINISH_REASON_ABORT and tokens(result["msgs"]) == []
    assert load(services, "prefill").disagg.num_exports == exports + 2
    wait_both_idle(services, 30, "both KV pools empty")


def answer_despite(services: dict[str, ServiceProc], ids: list[int],
                   fault: Callable[[], None]) -> list[worker_pb2.GenerateResponse]:
    """Route `ids`, apply `fault` once the prefill worker has the request, and return the answer; the decode
    worker must have fallen back to computing the prompt itself exactly once."""
    fallbacks = load(services, "decode").disagg.num_fallbacks
    _, result, thread = start_in_thread(services, ids, greedy())
    wait_for(lambda: prefill_busy(services), 30, "the prefill worker to start")
    fault()
    thread.join(PREFILL_TIMEOUT_S + 120)
    assert load(services, "decode").disagg.num_fallbacks == fallbacks + 1
    msgs: list[worker_pb2.GenerateResponse] = result["msgs"]
    return msgs


def test_prefill_timeout_falls_back_and_the_prefill_worker_cleans_up(services: dict[str, ServiceProc],
                                                                      reference: dict[str, list[int]]) -> None:
    prefill = services["prefill"].proc
    timeouts = metric(services["decode"], "radixmesh_kv_transfer_fallbacks_total", reason="prefill_timeout")
    try:
        msgs = answer_despite(services, long_ids(0), lambda: prefill.send_signal(signal.SIGSTOP))  # never answers
    finally:
        prefill.send_signal(signal.SIGCONT)
    assert tokens(msgs) == reference[str(long_ids(0))]
    assert metric(services["decode"], "radixmesh_kv_transfer_fallbacks_total", reason="prefill_timeout") == timeouts + 1
    # the decode worker cancelled the call: the prefill worker aborted or released it, and holds nothing
    wait_both_idle(services, 30, "both KV pools empty")
    wait_for(lambda: roles_seen(services["router"].address) == {"prefill", "decode"}, 30, "the prefill worker back")


def test_prefill_worker_killed_mid_transfer_the_request_completes(services: dict[str, ServiceProc],
                                                                 reference: dict[str, list[int]]) -> None:
    msgs = answer_despite(services, long_ids(1), services["prefill"].proc.kill)  # its scheduler then exits too
    assert tokens(msgs) == reference[str(long_ids(1))]
    assert msgs[0].routing.prefill_worker_id == services["prefill"].address
    assert metric(services["decode"], "radixmesh_kv_transfer_fallbacks_total", reason="prefill_unavailable") == 1
    wait_for(lambda: is_idle(services, "decode"), 30, "the decode worker's KV pool empty")
