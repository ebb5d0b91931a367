"""The client and runner against a local fake server: each backend, histories, failures, load control."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtests.client import BACKENDS, RequestInput, make_backend, render_history_text
from loadtests.compare import EndpointSpec, parse_endpoint, run_endpoints
from loadtests.fakes import FakeServer, WordTokenizer, running_fake_server
from loadtests.runner import SKIPPED_ERROR, LoadConfig, arrival_times_s, run_load
from loadtests.serving import add_serving_args
from loadtests.workloads import get_workload
from loadtests.workloads.base import Session, Turn, Workload

TOKENIZER = WordTokenizer()
QUIET = LoadConfig(num_warmup=0, show_progress=False, request_timeout_s=20)


def count_words(text: str) -> int:
    return len(text.split())


def build(name: str, *argv: str, num_prompts: int = 4) -> Workload:
    parser = argparse.ArgumentParser()
    add_serving_args(parser)
    return get_workload(name).build(parser.parse_args(["--workload", name, *argv]), TOKENIZER, num_prompts, 1)


@pytest.fixture()
def fake() -> Iterator[tuple[FakeServer, str]]:
    server = FakeServer()
    with running_fake_server(server) as url:
        yield server, url


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_each_backend_streams_and_reports_usage(fake: tuple[FakeServer, str], backend: str) -> None:
    server, url = fake
    w = build("random", "--random-input-len", "20", "--random-output-len", "5", "--random-range-ratio", "1")
    record = asyncio.run(run_load(w, make_backend(backend, url), QUIET, count_words))
    assert len(record.results) == 4 and all(r.success for r in record.results)
    for r in record.results:
        assert (r.prompt_len, r.output_len, r.cached_len, r.status) == (20, 5, 0, 200)
        assert r.ttft_s is not None and 0 < r.ttft_s <= r.latency_s and len(r.itl_s) == 4
        assert r.output_text.split() == ["t"] * 5
    assert 0 < record.duration_s == max(r.end_s for r in record.results)
    assert all(b.get("ignore_eos") or b.get("sampling_params", {}).get("ignore_eos") for b in server.bodies)


def test_token_ids_go_as_ids(fake: tuple[FakeServer, str]) -> None:
    server, url = fake
    w = build("random-ids", "--random-input-len", "9", "--random-range-ratio", "1", "--random-output-len", "2")
    record = asyncio.run(run_load(w, make_backend("sglang", url), QUIET, count_words))
    assert all(r.success and r.prompt_len == 9 for r in record.results)
    assert all(isinstance(b["input_ids"], list) for b in server.bodies)
    with pytest.raises(ValueError, match="token ids"):
        run_endpoints(w, [EndpointSpec("chat", url, "openai-chat")], QUIET, count_words)


@pytest.mark.parametrize("backend", ["openai-chat", "sglang"])
def test_multi_turn_resends_history_and_hits_cache(fake: tuple[FakeServer, str], backend: str) -> None:
    server, url = fake
    w = build("multi-turn", "--multi-turn-num-turns", "3", "--multi-turn-input-len", "6",
              "--multi-turn-output-len", "2", num_prompts=2)
    record = asyncio.run(run_load(w, make_backend(backend, url), QUIET, count_words))
    assert len(record.results) == 6 and all(r.success for r in record.results)
    by_turn = sorted(record.results, key=lambda r: (r.session_id, r.turn_index))
    # turn k's prompt: k earlier messages of 6 words and replies of 2, plus the new message
    assert [r.prompt_len for r in by_turn[:3]] == [6, 14, 22]
    assert all((r.cached_len or 0) >= 6 for r in by_turn if r.turn_index > 0)
    last = server.bodies[-1]
    if backend == "openai-chat":
        assert [m["role"] for m in last["messages"]] == ["user", "assistant", "user", "assistant", "user"]


def test_render_history_text_keeps_replies_after_prompts() -> None:
    req = RequestInput(turn=Turn(prompt="c", prompt_len=1, output_len=1), history=(("a", " x"), ("b", " y")))
    assert render_history_text(req) == "a x\n\nb y\n\nc"


def test_json_schema_failures_keep_their_messages(fake: tuple[FakeServer, str]) -> None:
    _, url = fake
    w = build("json-schema", num_prompts=3)
    runs = run_endpoints(w, [EndpointSpec("fake", url, "openai")], QUIET, count_words)
    results = runs[0].record.results
    assert [r.success for r in results] == [False] * 3
    assert all(r.status == 400 and "response_format is not supported" in r.error for r in results)
    assert runs[0].summary.num_failed == 3


def test_failed_turn_skips_the_rest_of_its_session() -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    turns = (Turn("w5 w6", 2, 2), Turn("w7", 1, 2, response_format=fmt), Turn("w8", 1, 2))
    w = Workload(name="t", sessions=(Session(session_id=0, turns=turns),))
    server = FakeServer()
    with running_fake_server(server) as url:
        record = asyncio.run(run_load(w, make_backend("openai", url), QUIET, count_words))
    assert [r.success for r in record.results] == [True, False, False]
    assert record.results[2].error == SKIPPED_ERROR and len(server.bodies) == 2


def test_connection_errors_are_recorded() -> None:
    w = build("random", "--random-input-len", "3", "--random-output-len", "1", num_prompts=2)
    record = asyncio.run(run_load(w, make_backend("sglang", "http://127.0.0.1:9"), QUIET, count_words))
    assert all(not r.success and r.status is None and r.error for r in record.results)


def test_concurrency_cap_and_warmup(fake: tuple[FakeServer, str]) -> None:
    server, url = fake
    w = build("random", "--random-input-len", "4", "--random-output-len", "4", num_prompts=6)
    load = LoadConfig(max_concurrency=2, num_warmup=2, show_progress=False)
    record = asyncio.run(run_load(w, make_backend("openai", url), load, count_words))
    assert len(server.bodies) == 8 and len(record.results) == 6  # warm-up requests are not recorded
    events = sorted([(r.start_s, 1) for r in record.results] + [(r.end_s, -1) for r in record.results])
    in_flight = peak = 0
    for _, step in events:
        in_flight += step
        peak = max(peak, in_flight)
    assert peak <= 2


def test_poisson_arrivals() -> None:
    assert arrival_times_s(3, math.inf, 0) == [0.0, 0.0, 0.0]
    times = arrival_times_s(2000, 50.0, seed=7)
    assert times == arrival_times_s(2000, 50.0, seed=7) and times[0] == 0.0
    assert times == sorted(times)
    assert times[-1] / 1999 == pytest.approx(1 / 50, rel=0.1)
    with pytest.raises(ValueError):
        LoadConfig(request_rate=0)


def test_parse_endpoint() -> None:
    spec = parse_endpoint("lb=http://127.0.0.1:8000/,backend=openai,header=X-Policy: cache-aware", "sglang")
    assert spec == EndpointSpec("lb", "http://127.0.0.1:8000", "openai", None, {"X-Policy": "cache-aware"})
    for bad in ("http://x", "a=ftp://x", "a=http://x,color=red"):
        with pytest.raises(ValueError):
            parse_endpoint(bad, "sglang")


def test_cli_compare_writes_table_json_and_plots(tmp_path: Path, default_model_dir: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from loadtests.__main__ import main

    with running_fake_server(FakeServer()) as url_a, running_fake_server(FakeServer()) as url_b:
        out = tmp_path / "run.json"
        code = main(["serving", "--endpoint", f"a={url_a}", "--endpoint", f"b={url_b},backend=openai-chat",
                     "--tokenizer", str(default_model_dir), "--workload", "generated-shared-prefix",
                     "--gsp-num-groups", "2", "--gsp-prompts-per-group", "3", "--gsp-system-prompt-len", "40",
                     "--gsp-question-len", "5", "--gsp-output-len", "3", "--request-rate", "200",
                     "--output-file", str(out), "--plot", "--disable-tqdm"])
    assert code == 0
    table = capsys.readouterr().out
    assert "Serving Benchmark Result" in table and "Cache hit rate" in table and "P99 TTFT (ms)" in table
    data = json.loads(out.read_text())
    assert [run["label"] for run in data["runs"]] == ["a", "b"]
    assert data["runs"][1]["model"] == "fake-model"  # from GET /v1/models
    for run in data["runs"]:
        assert run["summary"]["num_completed"] == 6 and len(run["requests"]) == 6
        assert run["summary"]["cache_hit_rate"] > 0.3
    assert (tmp_path / "run-latency-cdf.png").stat().st_size > 0
    assert (tmp_path / "run-throughput.png").stat().st_size > 0


def test_server_tokenization_time_is_recorded_for_text_prompts(fake: tuple[FakeServer, str]) -> None:
    from loadtests.fakes import TOKENIZE_MS_PER_WORD
    from loadtests.metrics import summarize

    _, url = fake
    for name, reported in (("random", True), ("random-ids", False)):
        w = build(name, "--random-input-len", "50", "--random-output-len", "2", num_prompts=6)
        record = asyncio.run(run_load(w, make_backend("sglang", url), QUIET, count_words))
        summary = summarize(record.results, record.duration_s)
        if reported:
            assert all(r.tokenize_s == pytest.approx(TOKENIZE_MS_PER_WORD * r.prompt_len / 1e3) for r in record.results)
            assert summary.tokenize is not None and summary.tokenize.count == 6
            assert summary.tokenize_share is not None and 0 < summary.tokenize_share < 1
            assert summary.ttft_fit is not None and summary.ttft_fit.count == 6
        else:  # (the same prompts as ids: the fake server now reports them cached)
            assert all(r.tokenize_s is None for r in record.results)
            assert summary.tokenize is None and summary.tokenize_share is None
