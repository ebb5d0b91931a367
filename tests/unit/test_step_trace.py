"""The scheduler's step trace (RADIXMESH_STEP_TRACE): a record per batch and per request, on CPU without device
times, and its summary script."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from radixmesh.engine.scheduler.step_trace import StepTraceHook

from .scheduler_factory import make_requests, make_scheduler, run_until_idle

ROOT = Path(__file__).resolve().parents[2]


def test_off_unless_the_variable_names_a_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RADIXMESH_STEP_TRACE", raising=False)
    sched, _ = make_scheduler()
    assert sched.hooks.get(StepTraceHook) is None


def test_every_batch_and_request_is_recorded_and_summarised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trace = tmp_path / "trace-{pid}.jsonl"
    monkeypatch.setenv("RADIXMESH_STEP_TRACE", str(trace))
    sched, col = make_scheduler(chunked_prefill_size=16)
    reqs = make_requests(4, prompt_len=(10, 40), max_new_tokens=5)
    for req in reqs:
        sched.add_request(req)
    run_until_idle(sched)
    files = list(tmp_path.glob("trace-*.jsonl"))
    assert len(files) == 1 and "{pid}" not in files[0].name
    records = [json.loads(line) for line in files[0].read_text().splitlines()]
    arrivals = [r for r in records if r["ev"] == "arrive"]
    batches = [r for r in records if r["ev"] == "batch"]
    assert sorted(a["rid"] for a in arrivals) == sorted(r.rid for r in reqs)
    assert {a["rid"]: a["prompt"] for a in arrivals} == {r.rid: len(r.origin_input_ids) for r in reqs}
    assert len(batches) == sched.counters.num_forward_passes
    extend = [b for b in batches if b["kind"] == "extend"]
    assert sum(b["tokens"] for b in extend) == sum(len(r.origin_input_ids) for r in reqs)
    assert sorted(rid for b in extend for rid in b["first"]) == sorted(r.rid for r in reqs)
    long_prompt = max(reqs, key=lambda r: len(r.origin_input_ids))
    assert sum(long_prompt.rid in b["rids"] for b in extend) == -(-len(long_prompt.origin_input_ids) // 16)
    for b in batches:
        assert b["t_step"] <= b["t_sched"] <= b["t_launched"] <= b["t_results"]
    assert all(len(col.tokens[r.rid]) == 5 for r in reqs)

    out = tmp_path / "summary.json"
    run = subprocess.run([sys.executable, str(ROOT / "scripts/step_trace_summary.py"), str(files[0]), "--json",
                          str(out)], capture_output=True, text=True, check=True)
    assert "prompt | count" in run.stdout
    summary = json.loads(out.read_text())
    assert summary["summary"]["requests"] == 4
    per_req = summary["requests"]
    assert max(r["chunks"] for r in per_req) == -(-len(long_prompt.origin_input_ids) // 16)
    assert all(r["total"] >= r["queue"] >= 0 and "device" not in r for r in per_req)


def test_the_summary_leaves_out_the_servers_warm_up(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import step_trace_summary as summary
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    arrivals = {rid: {"ev": "arrive", "rid": rid, "t": 1.0, "prompt": 10} for rid in ("warmup-1", "r1")}
    batch = {"ev": "batch", "id": 1, "kind": "extend", "rows": 2, "tokens": 20, "t_step": 1.1, "t_sched": 1.2,
             "t_launched": 1.3, "t_results": 1.5, "rids": ["warmup-1", "r1"], "first": ["warmup-1", "r1"]}
    assert len(summary.per_request(arrivals, [batch])) == 1
    assert len(summary.per_request(arrivals, [batch], with_warmup=True)) == 2
