"""`radixmesh bench goodput`: good requests per second of `bench serving` files, counted by hand."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from loadtests.__main__ import main as bench_main
from loadtests.goodput import LatencyObjective, goodput_rows
from loadtests.metrics import summarize
from loadtests.records import RequestResult
from loadtests.report import RunReport, to_json, write_json
from loadtests.runner import LoadConfig, RunRecord
from loadtests.workloads.base import Session, Turn, Workload

OBJECTIVE = LatencyObjective(ttft_ms=500, itl_p99_ms=50)


def request(i: int, ttft_ms: float | None, itl_ms: list[float], output_len: int | None = None,
            success: bool = True) -> dict[str, Any]:
    """One request as `bench serving` stores it (seconds)."""
    return {"session_id": i, "turn_index": 0, "success": success, "prompt_len": 100,
            "output_len": len(itl_ms) + 1 if output_len is None else output_len, "start_s": float(i),
            "latency_s": 1.0, "max_output_len": 16, "ttft_s": None if ttft_ms is None else ttft_ms / 1000,
            "itl_s": [gap / 1000 for gap in itl_ms], "cached_len": None, "error": "" if success else "boom",
            "status": 200 if success else 500, "group_id": None}


def hand_made_file(rate: float | str, duration_s: float, requests: list[dict[str, Any]]) -> dict[str, Any]:
    """The parts of a `bench serving` file that goodput reads."""
    return {"version": 1, "load": {"request_rate": rate},
            "runs": [{"label": "default", "summary": {"duration_s": duration_s}, "requests": requests}]}


# ten gaps of 10 ms and one of 100 ms: p99 = 10 + 0.9 * 90 = 91 ms; one in a hundred: p99 < 50 ms
SLOW_TAIL = [10.0] * 10 + [100.0]
RARE_STALL = [10.0] * 99 + [100.0]
RATE_4 = [
    request(0, 100, [20.0, 30.0, 40.0]),  # good
    request(1, 600, [20.0]),  # TTFT too long
    request(2, 100, SLOW_TAIL),  # its own p99 ITL too long
    request(3, 100, RARE_STALL),  # good: p99 = 10 + 0.01 * 90 = 10.9 ms
    request(4, 400, [], output_len=1),  # good: one token, TTFT only
    request(5, 100, [20.0], success=False),  # failed
    request(6, None, [], output_len=0),  # completed without a first token: not good
    request(7, 500, [50.0, 50.0]),  # good: both limits are inclusive
]


def test_a_request_is_good_when_it_completed_within_both_limits() -> None:
    (row,) = goodput_rows(hand_made_file(4, 2.0, RATE_4), OBJECTIVE, "rate-4.json")
    assert (row.num_requests, row.num_completed, row.num_good) == (8, 7, 4)
    assert row.goodput == pytest.approx(2.0) and row.request_rate == 4
    assert row.request_throughput == pytest.approx(3.5)
    # TTFTs (ms) of completed requests with one: 100 600 100 100 400 500 -> median 250, p99 595
    assert (row.ttft_median_ms, row.ttft_p99_ms) == pytest.approx((250, 595))
    assert row.itl_median_ms == pytest.approx(10.0)


def test_cli_sorts_by_rate_prints_the_best_and_appends_json_lines(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    files = {"6": hand_made_file(6, 2.0, [request(i, 900, [20.0]) for i in range(3)] + [request(3, 100, [20.0])]),
             "2": hand_made_file(2, 4.0, [request(i, 100, [20.0]) for i in range(6)]),
             "4": hand_made_file(4, 2.0, RATE_4)}
    paths = []
    for rate, data in files.items():
        paths.append(tmp_path / f"pd-{rate}.json")
        paths[-1].write_text(json.dumps(data))
    result_file = tmp_path / "goodput.jsonl"
    result_file.write_text('{"earlier": true}\n')
    argv = ["goodput", *map(str, paths), "--ttft-ms", "500", "--itl-p99-ms", "50", "--label", "b",
            "--result-file", str(result_file)]
    assert bench_main(argv) == 0
    out = capsys.readouterr().out
    table = [line for line in out.splitlines() if line.split() and line.split()[0] in ("2", "4", "6")]
    assert [line.split()[:3] for line in table] == [["2", "6/6", "1.50"], ["4", "4/8", "2.00"],
                                                    ["6", "1/4", "0.50"]]
    assert "best goodput: 2.00 req/s at request rate 4" in out
    lines = [json.loads(line) for line in result_file.read_text().splitlines()]
    assert lines[0] == {"earlier": True}
    assert [(r["label"], r["request_rate"], r["num_good"], r["best"]) for r in lines[1:]] == [
        ("b", 2, 6, False), ("b", 4, 4, True), ("b", 6, 1, False)]
    assert lines[2]["goodput"] == 2.0 and lines[2]["ttft_limit_ms"] == 500 and lines[2]["itl_p99_limit_ms"] == 50


def test_a_file_from_the_serving_report(tmp_path: Path) -> None:
    results = [RequestResult.from_dict(r) for r in RATE_4]
    workload = Workload(name="random-ids", sessions=tuple(
        Session(session_id=i, turns=(Turn(prompt=[1, 2], prompt_len=2, output_len=4),)) for i in range(8)))
    run = RunReport(label="default", base_url="http://x", backend="sglang", model=None,
                    record=RunRecord(results=results, duration_s=2.0), summary=summarize(results, 2.0))
    path = tmp_path / "serving.json"
    write_json(path, to_json([run], workload, LoadConfig(request_rate=math.inf)))
    (row,) = goodput_rows(json.loads(path.read_text()), OBJECTIVE, str(path))
    assert math.isinf(row.request_rate) and row.to_dict()["request_rate"] == "inf"
    assert (row.num_good, row.goodput, row.duration_s) == (4, 2.0, 2.0)


def test_unreadable_files_and_bad_limits_are_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"runs": []}))
    assert bench_main(["goodput", str(bad)]) == 2
    assert "bad.json: not a `bench serving` result file" in capsys.readouterr().err
    assert bench_main(["goodput", str(tmp_path / "missing.json")]) == 2
    good = tmp_path / "ok.json"
    good.write_text(json.dumps(hand_made_file(1, 1.0, [request(0, 100, [])])))
    assert bench_main(["goodput", str(good), "--ttft-ms", "0"]) == 2
    assert "--ttft-ms and --itl-p99-ms must be > 0" in capsys.readouterr().err


def test_no_good_request_has_no_best(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "slow.json"
    path.write_text(json.dumps(hand_made_file("inf", 1.0, [request(0, 5000, [20.0])])))
    assert bench_main(["goodput", str(path)]) == 0
    assert "best goodput: none" in capsys.readouterr().out
