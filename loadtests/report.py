"""The printed summary table (one column per endpoint) and the JSON file with every request."""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtests.metrics import Summary
from loadtests.runner import LoadConfig, RunRecord
from loadtests.workloads.base import Workload

JSON_FORMAT_VERSION = 1
"""Bumped when the JSON file's layout changes."""
TITLE = " Serving Benchmark Result "
LABEL_WIDTH = 34
COLUMN_WIDTH = 16
MAX_ERRORS_SHOWN = 3
"""Distinct error messages listed under the table, per endpoint."""


@dataclass(frozen=True)
class RunReport:
    """One endpoint's run of the workload."""

    label: str
    base_url: str
    backend: str
    model: str | None
    record: RunRecord
    summary: Summary


Row = tuple[str, Callable[[RunReport], str]]


def _num(value: float | None, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value:.{digits}f}"


def _latency_rows(title: str, attr: str) -> list[Row]:
    def stat(field: str) -> Callable[[RunReport], str]:
        return lambda run: _num(getattr(getattr(run.summary, attr), field))

    return [(f"Mean {title} (ms)", stat("mean_ms")), (f"Median {title} (ms)", stat("median_ms")),
            (f"P90 {title} (ms)", stat("p90_ms")), (f"P99 {title} (ms)", stat("p99_ms"))]


def _hit_rate(run: RunReport) -> str:
    rate = run.summary.cache_hit_rate
    return "n/a" if rate is None else f"{rate * 100:.2f}%"


def _ttft_fit(run: RunReport) -> str:
    fit = run.summary.ttft_fit
    return "n/a" if fit is None else f"{fit.intercept_ms:.1f}+{fit.per_1k_ms:.2f}/1k"


def _tokenize(field: str) -> Callable[[RunReport], str]:
    return lambda run: "n/a" if run.summary.tokenize is None else _num(getattr(run.summary.tokenize, field))


def _tokenize_share(run: RunReport) -> str:
    share = run.summary.tokenize_share
    return "n/a" if share is None else f"{share * 100:.1f}%"


SECTIONS: list[tuple[str, list[Row]]] = [
    ("", [
        ("Backend", lambda run: run.backend),
        ("Successful requests", lambda run: str(run.summary.num_completed)),
        ("Failed requests", lambda run: str(run.summary.num_failed)),
        ("Benchmark duration (s)", lambda run: _num(run.summary.duration_s)),
        ("Total input tokens", lambda run: str(run.summary.total_input_tokens)),
        ("Total generated tokens", lambda run: str(run.summary.total_output_tokens)),
        ("Request throughput (req/s)", lambda run: _num(run.summary.request_throughput)),
        ("Input token throughput (tok/s)", lambda run: _num(run.summary.input_throughput)),
        ("Output token throughput (tok/s)", lambda run: _num(run.summary.output_throughput)),
        ("Total token throughput (tok/s)", lambda run: _num(run.summary.total_throughput)),
        ("Concurrency", lambda run: _num(run.summary.concurrency)),
        ("Cache hit rate", _hit_rate),
    ]),
    ("Time to First Token", [*_latency_rows("TTFT", "ttft"),
                             ("TTFT fit (ms + ms per 1k prompt)", _ttft_fit),
                             ("Median tokenize, server (ms)", _tokenize("median_ms")),
                             ("P99 tokenize, server (ms)", _tokenize("p99_ms")),
                             ("Tokenize share of TTFT (median)", _tokenize_share)]),
    ("Inter-Token Latency", _latency_rows("ITL", "itl")),
    ("Time per Output Token (excl. 1st)", _latency_rows("TPOT", "tpot")),
    ("End-to-End Latency", _latency_rows("E2E", "e2e")),
]


def format_table(runs: Sequence[RunReport], workload: Workload, load: LoadConfig) -> str:
    """The summary table: one value column per run."""
    width = LABEL_WIDTH + COLUMN_WIDTH * len(runs)
    rate = "inf" if math.isinf(load.request_rate) else f"{load.request_rate:g}"
    lines = [TITLE.center(width, "="),
             f"{'Workload':<{LABEL_WIDTH}}{workload.name} ({workload.num_requests} requests)",
             f"{'Request rate (sessions/s)':<{LABEL_WIDTH}}{rate}",
             f"{'Max concurrency':<{LABEL_WIDTH}}{load.max_concurrency or 'none'}"]
    if len(runs) > 1 or runs[0].label != "default":
        lines.append(f"{'Endpoint':<{LABEL_WIDTH}}" + "".join(f"{r.label:>{COLUMN_WIDTH}}" for r in runs))
    for title, rows in SECTIONS:
        if title:
            lines.append(title.center(width, "-"))
        for label, render in rows:
            lines.append(f"{label:<{LABEL_WIDTH}}" + "".join(f"{render(r):>{COLUMN_WIDTH}}" for r in runs))
    lines.append("=" * width)
    for run in runs:
        lines += [f"errors ({run.label}): {n} x {msg}" for msg, n in error_counts(run.record)[:MAX_ERRORS_SHOWN]]
        if run.record.warmup_errors:
            lines.append(f"warm-up failed ({run.label}): {run.record.warmup_errors[0]}")
        if run.record.flush_error:
            lines.append(f"flush_cache failed ({run.label}): {run.record.flush_error}")
    return "\n".join(lines)


def error_counts(record: RunRecord) -> list[tuple[str, int]]:
    """Distinct error messages of the failed requests, most frequent first."""
    return Counter(r.error for r in record.results if not r.success).most_common()


def to_json(runs: Sequence[RunReport], workload: Workload, load: LoadConfig, with_text: bool = False) -> dict[str, Any]:
    return {
        "version": JSON_FORMAT_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "workload": {"name": workload.name, "params": workload.params, "num_sessions": len(workload.sessions),
                     "num_requests": workload.num_requests},
        "load": load.to_dict(),
        "runs": [{
            "label": run.label, "base_url": run.base_url, "backend": run.backend, "model": run.model,
            "summary": run.summary.to_dict(),
            "warmup_errors": run.record.warmup_errors,
            "flush_error": run.record.flush_error,
            "clock_origin_s": run.record.clock_origin_s,
            "requests": [r.to_dict(with_text=with_text) for r in run.record.results],
        } for run in runs],
    }


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    tmp.replace(path)

