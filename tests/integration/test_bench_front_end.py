"""`radixmesh bench front-end`: serve's front end over the stub scheduler answers every kind of prompt, each
reaches the stub once with its token ids, and the summary reads per kind and length."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loadtests.front_end import Sample, summarize

pytestmark = pytest.mark.integration


def test_the_bench_measures_every_kind_through_the_stub(tmp_path: Path, default_model_dir: Path) -> None:
    out = tmp_path / "front-end.json"
    run = subprocess.run([sys.executable, "-m", "radixmesh.cli", "bench", "front-end", "--model",
                          str(default_model_dir), "--lengths", "128", "512", "--num-prompts", "3",
                          "--warmup-requests", "1", "--gap-ms", "0", "--output-file", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(out.read_text())
    cells = result["summary"]["cells"]
    assert set(cells) == {f"{kind}@{length}" for kind in ("text", "chat", "ids") for length in (128, 512)}
    assert cells["ids@512"]["input_ids_median"] == 512  # ids arrive as sent
    assert cells["text@512"]["input_ids_median"] > 400 and cells["chat@512"]["tokenize_ms_median"] is not None
    assert all(s["front_end_ms"] > 0 and s["response_ms"] >= s["front_end_ms"] for s in result["samples"])
    assert set(result["summary"]["front_end_ms_per_1k_tokens"]) == {"text", "chat", "ids"}


def test_summary_medians_and_per_1k_slope() -> None:
    samples = [Sample("ids", n, front, front + 1, None, n) for n, front in ((1000, 2.0), (1000, 4.0), (1000, 3.0),
                                                                           (3000, 9.0), (3000, 7.0), (3000, 8.0))]
    summary = summarize(samples, [1000, 3000])
    assert summary["cells"]["ids@1000"]["front_end_ms_median"] == 3.0
    assert summary["cells"]["ids@3000"]["front_end_ms_median"] == 8.0
    assert summary["front_end_ms_per_1k_tokens"] == {"ids": 2.5}
