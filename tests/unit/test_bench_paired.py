"""`bench paired`: two serving results of one seeded workload, compared request by request."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from loadtests.paired import FIRST_REQUESTS, cmd_paired, compare, pair_requests


def _run(ttft_ms: list[float], prompt_lens: list[int], itl_ms: float = 7.0, label: str = "x",
         failed: tuple[int, ...] = ()) -> dict[str, Any]:
    return {"label": label, "requests": [
        {"session_id": i, "turn_index": 0, "success": i not in failed, "prompt_len": n, "output_len": 4,
         "start_s": float(i), "latency_s": 1.0, "ttft_s": t / 1e3, "itl_s": [itl_ms / 1e3] * 3}
        for i, (t, n) in enumerate(zip(ttft_ms, prompt_lens))]}


def _write(path: Path, run: dict[str, Any], seed: int = 1) -> Path:
    path.write_text(json.dumps({"workload": {"name": "random-ids", "params": {}}, "load": {"seed": seed},
                                "runs": [run]}))
    return path


PROMPTS = [100 * (i + 1) for i in range(40)]  # 100 .. 4,000 tokens
BASE = [50.0 + i for i in range(40)]


def test_a_uniform_shift_shows_in_every_row() -> None:
    twins, warnings = pair_requests(_run(BASE, PROMPTS), _run([t + 2.5 for t in BASE], PROMPTS, itl_ms=6.5))
    result = compare(twins)
    assert warnings == [] and result["requests"] == 40
    assert result["ttft_diff"] == {"n": 40, "median_ms": 2.5, "mean_ms": 2.5}
    assert result["mean_itl_diff"]["median_ms"] == -0.5
    buckets = result["ttft_diff_by_prompt_len"]
    assert list(buckets) == ["0-1535", "1536-2999", "3000+"]
    assert [b["n"] for b in buckets.values()] == [15, 14, 11]  # 100-1,500; 1,600-2,900; 3,000-4,000
    assert result[f"ttft_diff_first_{FIRST_REQUESTS}"]["n"] == 20 and result["ttft_diff_rest"]["n"] == 20


def test_medians_can_move_while_no_request_does() -> None:
    """Two runs whose requests are equal pair by pair show 0 per request whatever their order in the file."""
    a = _run(BASE, PROMPTS)
    b = _run(BASE, PROMPTS)
    b["requests"].reverse()
    result = compare(pair_requests(a, b)[0])
    assert result["ttft_diff"]["median_ms"] == 0.0 and result["median_ttft_ms"][0] == result["median_ttft_ms"][1]


def test_failed_and_mismatched_requests_are_reported() -> None:
    a = _run(BASE, PROMPTS, failed=(3,))
    b = _run(BASE, [*PROMPTS[:5], 999, *PROMPTS[6:]])
    twins, warnings = pair_requests(a, b)
    assert len(twins) == 39
    assert any("(5, 0): prompt of 600 vs 999" in w for w in warnings)
    assert any("1 requests succeeded in one run only" in w for w in warnings)


def test_command_refuses_different_workloads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    a = _write(tmp_path / "a.json", _run(BASE, PROMPTS))
    b = _write(tmp_path / "b.json", _run(BASE, PROMPTS), seed=2)
    args = argparse.Namespace(a=a, b=b, label_a=None, label_b=None, output_file=None)
    assert cmd_paired(args) == 2
    assert "different workloads or seeds" in capsys.readouterr().err
    b = _write(tmp_path / "b.json", _run([t - 1 for t in BASE], PROMPTS))
    out = tmp_path / "cmp.json"
    assert cmd_paired(argparse.Namespace(a=a, b=b, label_a=None, label_b=None, output_file=out)) == 0
    printed = capsys.readouterr().out
    assert "median    -1.00" in printed
    assert json.loads(out.read_text())["ttft_diff"]["median_ms"] == -1.0
    assert cmd_paired(argparse.Namespace(a=a, b=b, label_a="missing", label_b=None, output_file=None)) == 2


def test_slope_difference_over_each_runs_own_lengths() -> None:
    """B's TTFT grows 1.5 ms more per 1k tokens of its own (10% longer) prompts; residuals shared by the twins leave
    the difference's spread small, and a run with its own noise widens it."""
    from loadtests.paired import slope_difference

    wobble = [(-1) ** i * (i % 7) for i in range(40)]  # the same in both runs (the load each request met)
    a = _run([20 + 15 * n / 1000 + w for n, w in zip(PROMPTS, wobble)], PROMPTS)
    b_lens = [int(n * 1.1) for n in PROMPTS]
    b = _run([22 + 16.5 * n / 1000 + w for n, w in zip(b_lens, wobble)], b_lens)
    twins, warnings = pair_requests(a, b, lengths_may_differ=True)
    assert warnings == [] and twins[3].prompt_len == 400 and twins[3].prompt_len_b == 440
    fit = slope_difference(twins)
    assert abs(fit["a_per_1k_ms"] - 15) < 0.6 and abs(fit["diff_per_1k_ms"] - 1.5) < 0.3, fit
    assert fit["diff_se_ms"] < 0.3 and fit["diff_95_ms"][0] < fit["diff_per_1k_ms"] < fit["diff_95_ms"][1]
    own = [((-1) ** (i // 2)) * (i % 5) * 3 for i in range(40)]  # B's own noise: not shared with A
    b_noisy = _run([22 + 16.5 * n / 1000 + w + o for n, w, o in zip(b_lens, wobble, own)], b_lens)
    assert slope_difference(pair_requests(a, b_noisy, True)[0])["diff_se_ms"] > 2 * fit["diff_se_ms"]
    assert slope_difference(twins[:2]) == {"n": 2}


def test_text_and_ids_runs_of_one_seed_pair(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    a = _write(tmp_path / "ids.json", _run(BASE, PROMPTS))
    text = _run([t + 3 for t in BASE], [n + 5 for n in PROMPTS])
    b = tmp_path / "text.json"
    b.write_text(json.dumps({"workload": {"name": "random", "params": {}}, "load": {"seed": 1}, "runs": [text]}))
    assert cmd_paired(argparse.Namespace(a=a, b=b, label_a=None, label_b=None, output_file=None)) == 0
    captured = capsys.readouterr()
    assert "text against ids" in captured.out and "TTFT per 1k prompt tokens" in captured.out
    assert "prompt of" not in captured.err  # lengths differ by design: no warning per request
    b.write_text(json.dumps({"workload": {"name": "random", "params": {"x": 1}}, "load": {"seed": 1},
                             "runs": [text]}))
    assert cmd_paired(argparse.Namespace(a=a, b=b, label_a=None, label_b=None, output_file=None)) == 2


def test_text_against_text_ids_pairs_equal_lengths_and_warns_when_they_differ(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`random-text-ids` sends the server's own tokens of `random`'s text: a twin of another length means the
    client's tokenization left the server's."""
    import argparse

    def write(path: Path, name: str, run: dict[str, Any]) -> Path:
        path.write_text(json.dumps({"workload": {"name": name, "params": {}}, "load": {"seed": 1}, "runs": [run]}))
        return path

    a = write(tmp_path / "text-ids.json", "random-text-ids", _run(BASE, PROMPTS))
    b = write(tmp_path / "text.json", "random", _run([t + 3 for t in BASE], PROMPTS))
    assert cmd_paired(argparse.Namespace(a=a, b=b, label_a=None, label_b=None, output_file=None)) == 0
    captured = capsys.readouterr()
    assert "twins' prompts are equal" in captured.out and "B - A +0.00" in captured.out
    assert "warning" not in captured.err
    b = write(tmp_path / "text.json", "random", _run(BASE, [n + 1 for n in PROMPTS]))  # e.g. a BOS left out
    assert cmd_paired(argparse.Namespace(a=a, b=b, label_a=None, label_b=None, output_file=None)) == 0
    assert capsys.readouterr().err.count("prompt of") == 40
