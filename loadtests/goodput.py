"""`radixmesh bench goodput`: the requests per second that met a latency objective, from `bench serving` files.

A request is good when it completed, its time to first token is at most --ttft-ms and the 99th
percentile of its own inter-token gaps is at most --itl-p99-ms (a request with fewer than two
output tokens, or no measured gap, is held to the TTFT limit only). Goodput is the good requests
over the run's duration (DistServe's measure). Each file is one request rate of a sweep; the table
lists them by rate, with the best goodput under it.

Example:
    for rate in 2 4 6; do radixmesh bench serving ... --request-rate $rate --output-file pd-$rate.json; done
    radixmesh bench goodput pd-*.json --ttft-ms 1000 --itl-p99-ms 50 --label pd --result-file goodput.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from loadtests.metrics import percentile, summarize
from loadtests.records import RequestResult


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("goodput", help="goodput (requests meeting TTFT and ITL limits per second) of "
                            "`bench serving` result files", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", type=Path, metavar="FILE",
                        help="JSON files of `radixmesh bench serving --output-file`, one per request rate")
    parser.add_argument("--ttft-ms", type=float, default=1000.0, help="most time to first token of a good request")
    parser.add_argument("--itl-p99-ms", type=float, default=50.0,
                        help="most 99th-percentile inter-token latency of a good request (over its own gaps)")
    parser.add_argument("--label", default="", help="names these runs (e.g. the configuration) in --result-file")
    parser.add_argument("--result-file", type=Path, default=None, help="append one JSON line per run to this file")
    parser.set_defaults(func=cmd_goodput)


@dataclass(frozen=True)
class LatencyObjective:
    """What a good request meets."""

    ttft_ms: float
    """Most time to first token."""
    itl_p99_ms: float
    """Most 99th percentile of the request's own inter-token gaps."""

    def __post_init__(self) -> None:
        if not (self.ttft_ms > 0 and self.itl_p99_ms > 0):
            raise ValueError(f"--ttft-ms and --itl-p99-ms must be > 0 (got {self.ttft_ms}, {self.itl_p99_ms})")

    def is_met_by(self, result: RequestResult) -> bool:
        if not result.success or result.ttft_s is None or result.ttft_s * 1000.0 > self.ttft_ms:
            return False
        if result.output_len < 2 or not result.itl_s:
            return True
        return percentile(result.itl_s, 99) * 1000.0 <= self.itl_p99_ms


@dataclass(frozen=True)
class GoodputRow:
    """One run (one endpoint of one file) against the objective; latencies over its completed requests."""

    file: str
    endpoint: str
    request_rate: float
    """Offered sessions per second (inf: all at once)."""
    duration_s: float
    num_requests: int
    num_completed: int
    num_good: int
    goodput: float
    """Good requests per second of the run."""
    request_throughput: float
    """Completed requests per second."""
    output_throughput: float
    """Generated tokens per second."""
    ttft_median_ms: float
    ttft_p99_ms: float
    itl_median_ms: float

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["request_rate"] = "inf" if math.isinf(self.request_rate) else self.request_rate
        return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in data.items()}


def goodput_rows(data: dict[str, Any], objective: LatencyObjective, file: str) -> list[GoodputRow]:
    """A row per run of one parsed `bench serving` JSON file."""
    rate = float(data["load"]["request_rate"])
    rows = []
    for run in data["runs"]:
        results = [RequestResult.from_dict(r) for r in run["requests"]]
        duration_s = float(run["summary"]["duration_s"])
        summary = summarize(results, duration_s)
        num_good = sum(1 for r in results if objective.is_met_by(r))
        rows.append(GoodputRow(
            file=file, endpoint=run.get("label", "default"), request_rate=rate, duration_s=duration_s,
            num_requests=len(results), num_completed=summary.num_completed, num_good=num_good,
            goodput=num_good / duration_s if duration_s > 0 else math.nan,
            request_throughput=summary.request_throughput, output_throughput=summary.output_throughput,
            ttft_median_ms=summary.ttft.median_ms, ttft_p99_ms=summary.ttft.p99_ms,
            itl_median_ms=summary.itl.median_ms))
    return rows


def best_row(rows: Sequence[GoodputRow]) -> GoodputRow | None:
    """The row of the highest goodput (the lowest rate among equals); None when no request was good."""
    good = [row for row in rows if row.num_good and not math.isnan(row.goodput)]
    return max(good, key=lambda row: (row.goodput, -row.request_rate)) if good else None


COLUMNS = (("rate", 6), ("good/all", 10), ("goodput", 9), ("req/s", 8), ("out tok/s", 10), ("TTFT p50", 10),
           ("TTFT p99", 10), ("ITL p50", 9))


def format_table(rows: Sequence[GoodputRow], objective: LatencyObjective, label: str = "") -> str:
    """The runs sorted by request rate, one line each, then the best goodput."""
    with_endpoint = any(row.endpoint != "default" for row in rows)
    head = [f"{'endpoint':<12}"] if with_endpoint else []
    lines = [f"Goodput{f' ({label})' if label else ''}: requests with TTFT <= {objective.ttft_ms:g} ms and "
             f"p99 ITL <= {objective.itl_p99_ms:g} ms, per second",
             " ".join([*head, *(f"{name:>{width}}" for name, width in COLUMNS), " file"])]
    for row in sorted(rows, key=lambda r: (r.request_rate, r.endpoint)):
        cells = [_rate(row.request_rate), f"{row.num_good}/{row.num_requests}", _num(row.goodput),
                 _num(row.request_throughput), _num(row.output_throughput, 1), _num(row.ttft_median_ms, 1),
                 _num(row.ttft_p99_ms, 1), _num(row.itl_median_ms, 2)]
        lines.append(" ".join([*([f"{row.endpoint:<12}"] if with_endpoint else []),
                               *(f"{cell:>{width}}" for cell, (_, width) in zip(cells, COLUMNS)), f" {row.file}"]))
    best = best_row(rows)
    if best is None:
        lines.append("best goodput: none (no request met the objective)")
    else:
        where = f", {best.endpoint}" if with_endpoint else ""
        lines.append(f"best goodput: {best.goodput:.2f} req/s at request rate {_rate(best.request_rate)}{where} "
                     f"({best.file})")
    return "\n".join(lines)


def cmd_goodput(args: argparse.Namespace) -> int:
    try:
        objective = LatencyObjective(ttft_ms=args.ttft_ms, itl_p99_ms=args.itl_p99_ms)
        rows = [row for path in args.files for row in _file_rows(path, objective)]
    except ValueError as exc:
        print(f"bench goodput: error: {exc}", file=sys.stderr)
        return 2
    print(format_table(rows, objective, args.label))
    if args.result_file is not None:
        best = best_row(rows)
        args.result_file.parent.mkdir(parents=True, exist_ok=True)
        with args.result_file.open("a", encoding="utf-8") as out:
            for row in sorted(rows, key=lambda r: (r.request_rate, r.endpoint)):
                out.write(json.dumps({"label": args.label, **row.to_dict(), "ttft_limit_ms": objective.ttft_ms,
                                      "itl_p99_limit_ms": objective.itl_p99_ms, "best": row is best}) + "\n")
        print(f"appended {len(rows)} lines to {args.result_file}")
    return 0


def _file_rows(path: Path, objective: LatencyObjective) -> list[GoodputRow]:
    """goodput_rows of one file; ValueError naming the file when it is unreadable or lacks what they need."""
    try:
        return goodput_rows(json.loads(path.read_text(encoding="utf-8")), objective, str(path))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not a `bench serving` result file ({type(exc).__name__}: {exc})") from exc


def _rate(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _num(value: float, digits: int = 2) -> str:
    return "n/a" if math.isnan(value) else f"{value:.{digits}f}"
