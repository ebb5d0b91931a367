"""The front end's request trace (RADIXMESH_REQUEST_TRACE) and `scripts/request_timeline.py`, which joins it with
a benchmark's result file and the scheduler's step trace into each request's time to first token, phase by phase."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from radixmesh.engine.hf_tokenizer import load_tokenizer
from radixmesh.engine.loader import prepare_model
from radixmesh.gateway import request_trace
from radixmesh.gateway.app import create_app
from radixmesh.gateway.config import GatewayConfig
from radixmesh.gateway.local_backend import LocalEngineBackend
from tests.unit.test_serve_tokenize import ScriptedEngineClient
from tests.unit.test_tokenize_pool import random_text

ROOT = Path(__file__).resolve().parents[2]
ORDER = ("t_http", "t_body", "t_open", "t_submit", "t_first_out", "t_first_chunk", "t_first_body", "t_end")


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path) -> Any:
    return load_tokenizer(default_model_dir)


def _serve(default_model_dir: Path, tokenizer: Any) -> TestClient:
    prepared = prepare_model(str(default_model_dir), need_weights=False)
    backend = LocalEngineBackend(ScriptedEngineClient(prepared, tokenizer), tokenizer_workers=2)
    return TestClient(create_app(backend, GatewayConfig()))


@pytest.fixture
def traced(default_model_dir: Path, tokenizer: Any, tmp_path: Path,
           monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[TestClient, Path]]:
    monkeypatch.setenv(request_trace.ENV, str(tmp_path / "requests-{pid}.jsonl"))
    with _serve(default_model_dir, tokenizer) as http:
        yield http, tmp_path


def _records(folder: Path) -> list[dict[str, Any]]:
    files = list(folder.glob("requests-*.jsonl"))
    assert len(files) == 1, files  # {pid} was filled in
    return [json.loads(line) for line in files[0].read_text().splitlines()]


def test_each_request_writes_its_timeline_in_order(traced: Any, tokenizer: Any) -> None:
    http, folder = traced
    text = random_text(tokenizer, 800, seed=5)
    streamed = http.post("/generate", json={"text": text, "sampling_params": {"max_new_tokens": 1}, "stream": True})
    assert streamed.status_code == 200, streamed.text
    first = json.loads(streamed.text.split("data: ", 2)[1].split("\n")[0])
    ids = http.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 1})
    assert ids.status_code == 200, ids.text
    assert http.get("/health").status_code == 200
    gen, comp, health = _records(folder)
    assert gen["path"] == "/generate" and gen["rid"] == first["meta_info"]["id"]
    assert gen["prompt_tokens"] == first["meta_info"]["prompt_tokens"] and gen["tokenize_s"] > 0
    times = [gen[k] for k in ORDER]
    assert times == sorted(times), dict(zip(ORDER, times))
    assert gen["t_open"] - gen["t_body"] >= gen["tokenize_s"]  # the tokenization lies inside the handler's time
    assert comp["path"] == "/v1/completions" and comp["prompt_tokens"] == 3 and comp["tokenize_s"] is None
    assert comp["t_http"] <= comp["t_open"] <= comp["t_first_chunk"] <= comp["t_end"]
    assert health["path"] == "/health" and "rid" not in health and health["t_http"] <= health["t_end"]


def test_no_trace_without_the_variable(default_model_dir: Path, tokenizer: Any, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(request_trace.ENV, raising=False)
    with _serve(default_model_dir, tokenizer) as http:
        assert not any(m.cls is request_trace.RequestTraceMiddleware for m in http.app.user_middleware)
        assert http.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 1}).status_code == 200
    request_trace.mark("t_open")  # outside a traced request: nothing to set, nothing raised


def _timeline_module() -> Any:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import request_timeline
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    return request_timeline


def test_the_phases_add_up_to_the_clients_ttft(traced: Any, tokenizer: Any) -> None:
    """A real traced request, a client record around it and a step trace of its id: every phase is there, and
    together they are the client's TTFT."""
    http, folder = traced
    text = random_text(tokenizer, 600, seed=9)
    send = time.perf_counter()
    reply = http.post("/generate", json={"text": text, "sampling_params": {"max_new_tokens": 1}, "stream": True})
    first_text = time.perf_counter()
    assert reply.status_code == 200
    (rec,) = _records(folder)
    origin = send - 3.0
    result = {"runs": [{"label": "default", "clock_origin_s": origin, "requests": [
        {"success": True, "start_s": send - origin, "ttft_s": first_text - send, "prompt_len": rec["prompt_tokens"]},
        {"success": False, "start_s": 0.5, "ttft_s": None, "prompt_len": 7}]}]}
    (folder / "result.json").write_text(json.dumps(result))
    arrive = rec["t_submit"] + (rec["t_first_out"] - rec["t_submit"]) / 3
    results = rec["t_submit"] + 2 * (rec["t_first_out"] - rec["t_submit"]) / 3
    steps = [{"ev": "arrive", "rid": rec["rid"], "t": arrive, "prompt": rec["prompt_tokens"]},
             {"ev": "batch", "id": 1, "kind": "extend", "rows": 1, "tokens": rec["prompt_tokens"], "t_step": arrive,
              "t_sched": arrive, "t_launched": arrive, "t_results": results, "rids": [rec["rid"]],
              "first": [rec["rid"]]}]
    (folder / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    out = folder / "timeline.json"
    timeline = _timeline_module()
    code = timeline.main([str(folder / "result.json"), "--front", *map(str, folder.glob("requests-*.jsonl")),
                          "--steps", str(folder / "steps.jsonl"), "--json", str(out)])
    assert code == 0
    (row,) = json.loads(out.read_text())["requests"]
    parts = ("client_to_app", "body", "tokenize", "admit", "start", "to_scheduler", "scheduler", "to_front",
             "detokenize", "to_wire", "to_client")
    assert set(parts) <= set(row) and row["rid"] == rec["rid"]
    assert sum(row[p] for p in parts) == pytest.approx(row["ttft"], abs=1e-6)
    # (differences of clock readings near 1e5 s: equal to within a nanosecond, not to a relative 1e-6)
    assert row["to_scheduler"] == pytest.approx(row["scheduler"], abs=1e-6) == pytest.approx(row["to_front"], abs=1e-6)
    assert row["engine"] == pytest.approx(row["to_scheduler"] + row["scheduler"] + row["to_front"], abs=1e-6)


def test_requests_match_by_prompt_length_inside_the_window() -> None:
    timeline = _timeline_module()
    clients = [{"send": 10.0, "prompt": 100}, {"send": 10.001, "prompt": 200}, {"send": 20.0, "prompt": 100}]
    fronts = [{"t_http": 10.0015, "prompt_tokens": 200, "rid": "b"}, {"t_http": 10.002, "prompt_tokens": 100,
                                                                          "rid": "a"},
              {"t_http": 25.0, "prompt_tokens": 100, "rid": "late"}]
    pairs = timeline.match(clients, fronts, window_s=0.5)
    assert [(c["prompt"], f["rid"]) for c, f in pairs] == [(100, "a"), (200, "b")]  # the third had no match


def test_a_result_file_without_the_clock_origin_is_refused(tmp_path: Path) -> None:
    timeline = _timeline_module()
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"runs": [{"label": "default", "requests": []}]}))
    with pytest.raises(SystemExit, match="clock_origin_s"):
        timeline.client_requests(path)
