"""`radixmesh bench front-end`: serve's front end over the stub scheduler answers every kind of prompt, each
reaches the stub once with its token ids, and the summary reads per kind and length. `bench front-end-load`: the
streaming stub sends every request's tokens, and the front end's CPU per 1,000 tokens is read and summarized."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from loadtests.front_end import Sample, summarize
from loadtests.front_end_load import StreamStats, process_cpu_s
from loadtests.front_end_load import summarize as summarize_load

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


def test_the_load_bench_streams_every_token_and_reads_the_front_ends_cpu(tmp_path: Path,
                                                                        default_model_dir: Path) -> None:
    out = tmp_path / "front-end-load.json"
    run = subprocess.run([sys.executable, "-m", "radixmesh.cli", "bench", "front-end-load", "--model",
                          str(default_model_dir), "--streams", "3", "--output-tokens", "7", "--itl-ms", "2",
                          "--duration-s", "1", "--output-file", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    summary = json.loads(out.read_text())["summary"]
    assert summary["requests"] >= 3 and summary["tokens"] == 7 * summary["requests"]  # the stub streams them all
    assert summary["cpu_s"] > 0 and summary["cpu_ms_per_1k_tokens"] > 0 and summary["itl_ms_median"] > 0
    assert "ms per 1,000 tokens" in run.stdout


def test_load_summary_per_1k_tokens_and_medians() -> None:
    streams = StreamStats(ttft_s=[0.010, 0.020, 0.030], itl_s=[0.005] * 99 + [0.050], tokens=2000, requests=10)
    summary = summarize_load(streams, cpu_s=0.5, elapsed_s=2.0)
    assert summary["cpu_ms_per_1k_tokens"] == 250.0 and summary["cpu_share_of_one_core"] == 0.25
    assert (summary["ttft_ms_median"], summary["itl_ms_median"], summary["itl_ms_p99"]) == (20.0, 5.0, 50.0)
    assert summary["tokens_per_s"] == 1000.0
    assert process_cpu_s(os.getpid()) > 0
