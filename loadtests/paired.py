"""`radixmesh bench paired A.json B.json`: two `bench serving` runs of one seeded workload, request by request.

With the same workload seed the two runs send the same prompts at the same times, so each request of B has a twin
in A. The difference of a run-wide median between two runs mixes the change under test with where requests fall
near the median: on an H100 at 1 req/s two runs of one server on one machine differed by 9.4 ms in median TTFT
and by 2.05 ms in the median of their per-request differences (docs/benchmarks/README.md, twelfth session). This
command reports the per-request differences (B minus A) of TTFT and of each request's mean inter-token latency:
their median and mean, by prompt length, and for the first requests of the run apart (a fresh server's first
requests pay for what it loads or compiles on first use).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FIRST_REQUESTS = 20
LENGTH_EDGES = (1536, 3000)
"""Prompt-length buckets: below 1,536 tokens, 1,536-2,999, 3,000 and more."""


@dataclass(frozen=True)
class Twin:
    prompt_len: int
    ttft_ms: tuple[float, float]
    itl_ms: tuple[float | None, float | None]


def load_run(path: Path, label: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The file's header and the run named `label` (the only one when None)."""
    data = json.loads(path.read_text(encoding="utf-8"))
    runs = data.get("runs") or []
    if label is not None:
        runs = [r for r in runs if r.get("label") == label]
    if len(runs) != 1:
        names = [r.get("label") for r in data.get("runs") or []]
        raise ValueError(f"{path}: expected one run{f' labelled {label!r}' if label else ''}, found {names}")
    return data, runs[0]


def _mean_itl_ms(request: dict[str, Any]) -> float | None:
    gaps = request.get("itl_s") or []
    return 1e3 * sum(gaps) / len(gaps) if gaps else None


def pair_requests(run_a: dict[str, Any], run_b: dict[str, Any]) -> tuple[list[Twin], list[str]]:
    """Successful requests of both runs matched by (session, turn), in order of arrival; and warnings."""
    def index(run: dict[str, Any]) -> dict[tuple[int, int], dict[str, Any]]:
        return {(r["session_id"], r["turn_index"]): r for r in run["requests"]
                if r.get("success") and r.get("ttft_s") is not None}

    a, b = index(run_a), index(run_b)
    warnings = []
    twins = []
    for key in sorted(a.keys() & b.keys(), key=lambda k: a[k]["start_s"]):
        ra, rb = a[key], b[key]
        if ra["prompt_len"] != rb["prompt_len"]:
            warnings.append(f"request {key}: prompt of {ra['prompt_len']} vs {rb['prompt_len']} tokens")
        twins.append(Twin(ra["prompt_len"], (1e3 * ra["ttft_s"], 1e3 * rb["ttft_s"]),
                          (_mean_itl_ms(ra), _mean_itl_ms(rb))))
    unmatched = len(a.keys() ^ b.keys())
    if unmatched:
        warnings.append(f"{unmatched} requests succeeded in one run only (left out)")
    return twins, warnings


def _stats(diffs: list[float]) -> dict[str, Any]:
    if not diffs:
        return {"n": 0}
    return {"n": len(diffs), "median_ms": round(statistics.median(diffs), 2),
            "mean_ms": round(statistics.fmean(diffs), 2)}


BUCKETS = [f"{lo}-{hi - 1}" for lo, hi in zip((0, *LENGTH_EDGES), LENGTH_EDGES)] + [f"{LENGTH_EDGES[-1]}+"]


def _bucket(prompt_len: int) -> str:
    return BUCKETS[sum(prompt_len >= edge for edge in LENGTH_EDGES)]


def compare(twins: list[Twin]) -> dict[str, Any]:
    """B minus A per request: TTFT overall, by prompt length, first requests and the rest; mean ITL."""
    ttft = [b - a for a, b in (t.ttft_ms for t in twins)]
    itl = [b - a for a, b in (t.itl_ms for t in twins) if a is not None and b is not None]
    by_length: dict[str, list[float]] = {name: [] for name in BUCKETS}
    for twin, diff in zip(twins, ttft):
        by_length[_bucket(twin.prompt_len)].append(diff)
    return {
        "requests": len(twins),
        "median_ttft_ms": [round(statistics.median([t.ttft_ms[i] for t in twins]), 2) if twins else None
                           for i in (0, 1)],
        "ttft_diff": _stats(ttft),
        "ttft_diff_by_prompt_len": {k: _stats(v) for k, v in by_length.items() if v},
        f"ttft_diff_first_{FIRST_REQUESTS}": _stats(ttft[:FIRST_REQUESTS]),
        "ttft_diff_rest": _stats(ttft[FIRST_REQUESTS:]),
        "mean_itl_diff": _stats(itl),
    }


def format_result(result: dict[str, Any], name_a: str, name_b: str) -> str:
    def line(title: str, s: dict[str, Any]) -> str:
        if not s["n"]:
            return f"{title:<34} (no requests)"
        return f"{title:<34} median {s['median_ms']:+8.2f}   mean {s['mean_ms']:+8.2f}   ({s['n']} requests)"

    med_a, med_b = result["median_ttft_ms"]
    lines = [f"B minus A, per request (A: {name_a}; B: {name_b}), ms",
             f"{'run medians of TTFT':<34} A {med_a}   B {med_b}",
             line("TTFT", result["ttft_diff"])]
    lines += [line(f"  prompt {k} tokens", v) for k, v in result["ttft_diff_by_prompt_len"].items()]
    lines += [line(f"  first {FIRST_REQUESTS} requests", result[f"ttft_diff_first_{FIRST_REQUESTS}"]),
              line("  the rest", result["ttft_diff_rest"]),
              line("mean ITL of each request", result["mean_itl_diff"])]
    return "\n".join(lines)


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("paired", help="two `bench serving` results of one seeded workload, request by request",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a", type=Path, help="result file of the baseline (A)")
    parser.add_argument("b", type=Path, help="result file of the change (B)")
    parser.add_argument("--label-a", default=None, help="the run to take from A when it holds several")
    parser.add_argument("--label-b", default=None, help="the run to take from B when it holds several")
    parser.add_argument("--output-file", type=Path, default=None, help="write the comparison as JSON")
    parser.set_defaults(func=cmd_paired)


def cmd_paired(args: argparse.Namespace) -> int:
    try:
        head_a, run_a = load_run(args.a, args.label_a)
        head_b, run_b = load_run(args.b, args.label_b)
    except (OSError, ValueError, KeyError) as exc:
        print(f"bench paired: error: {exc}", file=sys.stderr)
        return 2
    if head_a.get("workload") != head_b.get("workload") or (head_a.get("load") or {}).get("seed") != (
            head_b.get("load") or {}).get("seed"):
        print("bench paired: error: the two files ran different workloads or seeds; requests have no twins",
              file=sys.stderr)
        return 2
    twins, warnings = pair_requests(run_a, run_b)
    for warning in warnings:
        print(f"bench paired: warning: {warning}", file=sys.stderr)
    if not twins:
        print("bench paired: error: no request succeeded in both runs", file=sys.stderr)
        return 2
    result = compare(twins)
    print(format_result(result, str(args.a), str(args.b)))
    if args.output_file:
        args.output_file.write_text(json.dumps({"a": str(args.a), "b": str(args.b), **result}, indent=1) + "\n")
        print(f"wrote {args.output_file}")
    return 0
