"""scripts/ab_table.py: gpu_ab.sh's table and each online run's per-request differences (files made up here)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .script_loader import load_script


def _online(path: Path, ttfts_ms: list[float | None], median_ms: float) -> None:
    requests = [{"session_id": i, "turn_index": 0, "prompt_len": 100 + i, "start_s": float(i), "itl_s": [0.005],
                 "success": t is not None, "ttft_s": None if t is None else t / 1000} for i, t in enumerate(ttfts_ms)]
    summary = {"num_completed": sum(t is not None for t in ttfts_ms), "ttft": {"median_ms": median_ms, "p99_ms": 90.0},
               "itl": {"median_ms": 5.0}, "ttft_fit": {"per_1k_ms": 17.0}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"runs": [{"summary": summary, "requests": requests}]}))


def test_paired_differences_per_run(tmp_path: Path, capsys: Any) -> None:
    ab = load_script("ab_table")
    _online(tmp_path / "base" / "online-base-random.json", [50.0, 60.0, 70.0, 80.0], 65.0)
    _online(tmp_path / "new" / "online-new-random.json", [49.0, 58.0, 67.0, None], 58.0)
    # a repeated stage (gpu_ab.sh tags it -r2); the new tree's repeat is missing: no pair for it
    _online(tmp_path / "base" / "online-base-r2-random.json", [55.0, 65.0], 60.0)
    pairs = ab.paired(tmp_path, ["base", "new"])
    # request 3 failed on the new tree: the pairs are (-1, -2, -3)
    assert [(run, other) for run, other, _ in pairs] == [("random", "new")]
    result = pairs[0][2]
    assert result["requests"] == 3 and result["ttft_diff"] == {"n": 3, "median_ms": -2.0, "mean_ms": -2.0}
    assert ab.main(["ab_table.py", str(tmp_path), "base", "new"]) == 0
    out = capsys.readouterr().out
    assert "online random, per request:" in out and "(A: base; B: new)" in out
    saved = json.loads((tmp_path / "ab.json").read_text())
    assert saved["paired_ttft"] == {"random new - base": result}
    assert saved["base"]["online random TTFT median ms"] == 65.0
    assert saved["new"]["online random requests"] == 3
    assert saved["base"]["online r2-random TTFT median ms"] == 60.0
