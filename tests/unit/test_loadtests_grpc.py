"""`bench serving --backend grpc|grpc-chat` against the gateway's gRPC API over the fake backend: streams timed
per message, usage read from the last one, the API key sent as metadata, failures recorded."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from loadtests.client import make_backend
from loadtests.compare import parse_endpoint
from loadtests.fakes import WordTokenizer
from loadtests.runner import LoadConfig, run_load
from loadtests.serving import add_serving_args
from loadtests.workloads import get_workload
from loadtests.workloads.base import Workload
from radixmesh.gateway.config import GatewayConfig
from tests.unit.grpc_api_harness import gateway
from tests.unit.test_gateway_api import FakeBackend

QUIET = LoadConfig(num_warmup=0, show_progress=False, request_timeout_s=20)
KEY = "sk-bench-grpc"


def _workload(num_prompts: int = 3) -> Workload:
    parser = argparse.ArgumentParser()
    add_serving_args(parser)
    args = parser.parse_args(["--workload", "random", "--random-input-len", "4", "--random-output-len", "5",
                              "--random-range-ratio", "1"])
    return get_workload("random").build(args, WordTokenizer(), num_prompts, 1)


@pytest.mark.parametrize("backend", ["grpc", "grpc-chat"])
def test_grpc_backends_stream_and_report_usage(backend: str) -> None:
    async def run() -> None:
        async with gateway(FakeBackend(delay_s=0.001), GatewayConfig(grpc_port=0, api_key=KEY)) as gw:
            client = make_backend(backend, "http://unused", model="fake-model",
                                  headers={"Authorization": f"Bearer {KEY}"}, grpc_target=gw.address)
            record = await run_load(_workload(), client, QUIET, lambda text: len(text))
            assert not record.warmup_errors and len(record.results) == 3
            for r in record.results:
                assert r.success, r.error
                assert r.output_len == 5 and r.output_text == "abcde"  # usage from the stream's last message
                assert r.ttft_s is not None and 0 < r.ttft_s <= r.latency_s and len(r.itl_s) == 4
                assert r.prompt_len > 0 and r.cached_len is not None
            seen = gw.backend.seen_params[-1]
            assert (seen.max_new_tokens, seen.temperature, seen.ignore_eos) == (5, 0.0, True)

    asyncio.run(run())


def test_grpc_failures_are_recorded() -> None:
    async def run() -> None:
        async with gateway(config=GatewayConfig(grpc_port=0, api_key=KEY)) as gw:
            client = make_backend("grpc", "http://unused", grpc_target=gw.address)  # no key
            record = await run_load(_workload(1), client, QUIET, len)
            assert not record.results[0].success
            assert record.results[0].error.startswith("gRPC UNAUTHENTICATED: Missing API key")

    asyncio.run(run())


def test_grpc_target_is_required_and_parsed() -> None:
    with pytest.raises(ValueError, match="--grpc-target"):
        make_backend("grpc", "http://127.0.0.1:8000")
    spec = parse_endpoint("g=http://127.0.0.1:8000,backend=grpc,grpc=127.0.0.1:50051", "openai")
    assert (spec.backend, spec.grpc_target) == ("grpc", "127.0.0.1:50051")
    assert parse_endpoint("h=http://127.0.0.1:8000", "grpc", None, "127.0.0.1:9").grpc_target == "127.0.0.1:9"


def test_grpc_vs_http_pairs_and_differences() -> None:
    from loadtests.api_overhead import Sample, _prompt, summarize

    samples = []
    for pair in range(4):
        samples.append(Sample("http", pair, True, 100.0 + pair, 10.0, 400.0, 32))
        samples.append(Sample("grpc", pair, True, 101.0 + pair, 10.5, 402.0, 32))
    samples.append(Sample("http", 4, True, 50.0, 5.0, 100.0, 32))
    samples.append(Sample("grpc", 4, False, 0.0, 0.0, 0.0, 0, error="gRPC UNAVAILABLE"))  # an unpaired pair is left out
    summary = summarize(samples)
    assert summary["num_pairs"] == 4 and summary["num_failed"] == 1
    assert summary["added_median_ttft_ms"] == pytest.approx(1.0)
    assert summary["added_median_itl_ms"] == pytest.approx(0.5)
    assert summary["http_median_ttft_ms"] == pytest.approx(101.5)
    assert len({_prompt(i, 8).split()[0] for i in range(100)}) == 100  # every prompt opens differently
    assert len({_prompt(i, 8)[0] for i in range(10)}) == 10  # consecutive ones from the first character on
