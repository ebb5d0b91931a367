"""`radixmesh bench paired A.json B.json`: two `bench serving` runs of one seeded workload, request by request.

With the same workload seed the two runs send the same prompts at the same times, so each request of B has a twin
in A. The difference of a run-wide median between two runs mixes the change under test with where requests fall
near the median: on an H100 at 1 req/s two runs of one server on one machine differed by 9.4 ms in median TTFT
and by 2.05 ms in the median of their per-request differences (docs/benchmarks/README.md, twelfth session). This
command reports the per-request differences (B minus A) of TTFT and of each request's mean inter-token latency:
their median and mean, by prompt length, and for the first requests of the run apart (a fresh server's first
requests pay for what it loads or compiles on first use); and each run's TTFT slope over its own prompt lengths with
the difference of the two slopes, whose spread comes from resampling the twins together (a paired bootstrap: the two
runs' residuals move together, so the difference is known about twice as well as from two separate fits).

`random` (text) against `random-ids` of one seed pairs too: the text prompts are the ids decoded, re-tokenized by
the server into a few percent more tokens, so each run's slope is taken over its own prompt lengths. TTFT is convex in
prompt length, so two lines fitted over different lengths differ by themselves: for the cost of the text path alone,
pair `random` with `random-text-ids`, the same text sent as the ids the server makes of it. Those twins' prompts are
equal token for token; a length that differs there is warned about (the client's tokenization left the server's).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtests.metrics import LengthFit

FIRST_REQUESTS = 20
BOOTSTRAP_RESAMPLES = 2000
TEXT_AND_IDS = {frozenset({"random", "random-ids"}): True, frozenset({"random", "random-text-ids"}): False}
"""Workloads whose runs of one seed send the same prompts, as text and as token ids -> whether twins' prompt lengths
may differ (the sampled ids are fewer than the server's tokens of their text; `random-text-ids` sends those tokens)."""
LENGTH_EDGES = (1536, 3000)
"""Prompt-length buckets: below 1,536 tokens, 1,536-2,999, 3,000 and more."""


@dataclass(frozen=True)
class Twin:
    prompt_len: int
    ttft_ms: tuple[float, float]
    itl_ms: tuple[float | None, float | None]
    prompt_len_b: int = 0
    """B's prompt length (differs from A's where one run sent text and the other ids); 0: A's."""


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


def pair_requests(run_a: dict[str, Any], run_b: dict[str, Any], lengths_may_differ: bool = False
                  ) -> tuple[list[Twin], list[str]]:
    """Successful requests of both runs matched by (session, turn), in order of arrival; and warnings (a prompt
    length that differs between twins is one, unless `lengths_may_differ`: text against ids)."""
    def index(run: dict[str, Any]) -> dict[tuple[int, int], dict[str, Any]]:
        return {(r["session_id"], r["turn_index"]): r for r in run["requests"]
                if r.get("success") and r.get("ttft_s") is not None}

    a, b = index(run_a), index(run_b)
    warnings = []
    twins = []
    for key in sorted(a.keys() & b.keys(), key=lambda k: a[k]["start_s"]):
        ra, rb = a[key], b[key]
        if ra["prompt_len"] != rb["prompt_len"] and not lengths_may_differ:
            warnings.append(f"request {key}: prompt of {ra['prompt_len']} vs {rb['prompt_len']} tokens")
        twins.append(Twin(ra["prompt_len"], (1e3 * ra["ttft_s"], 1e3 * rb["ttft_s"]),
                          (_mean_itl_ms(ra), _mean_itl_ms(rb)), rb["prompt_len"]))
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


def _slope(points: list[tuple[int, float]]) -> float | None:
    """`LengthFit`'s ms per 1,000 tokens of (prompt_len, ms) points; None when every length is the same."""
    fit = LengthFit.of([n for n, _ in points], [ms / 1e3 for _, ms in points])
    return fit.per_1k_ms if fit is not None else None


def slope_difference(twins: list[Twin], resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0) -> dict[str, Any]:
    """Each run's TTFT per 1,000 prompt tokens (over its own lengths), B's minus A's, and that difference's standard
    error and 95% interval from resampling the twins together."""
    def fits(sample: list[Twin]) -> tuple[float | None, float | None]:
        return (_slope([(t.prompt_len, t.ttft_ms[0]) for t in sample]),
                _slope([(t.prompt_len_b or t.prompt_len, t.ttft_ms[1]) for t in sample]))

    slope_a, slope_b = fits(twins) if len(twins) >= 3 else (None, None)
    if slope_a is None or slope_b is None:
        return {"n": len(twins)}
    rng = random.Random(seed)
    diffs = []
    for _ in range(resamples):
        a, b = fits(rng.choices(twins, k=len(twins)))
        if a is not None and b is not None:
            diffs.append(b - a)
    diffs.sort()
    return {"n": len(twins), "a_per_1k_ms": round(slope_a, 2), "b_per_1k_ms": round(slope_b, 2),
            "diff_per_1k_ms": round(slope_b - slope_a, 2), "diff_se_ms": round(statistics.pstdev(diffs), 2),
            "diff_95_ms": [round(diffs[int(0.025 * len(diffs))], 2), round(diffs[int(0.975 * len(diffs)) - 1], 2)]}


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
        "ttft_slope": slope_difference(twins),
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
    fit = result["ttft_slope"]
    if "diff_per_1k_ms" in fit:
        low, high = fit["diff_95_ms"]
        lines.append(f"{'TTFT per 1k prompt tokens':<34} A {fit['a_per_1k_ms']}   B {fit['b_per_1k_ms']}   B - A "
                     f"{fit['diff_per_1k_ms']:+.2f} +- {fit['diff_se_ms']:.2f} (95%: {low:+.2f} .. {high:+.2f}; "
                     "twins resampled together)")
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


def _text_and_ids(a: Any, b: Any) -> frozenset[str] | None:
    """The pair of `TEXT_AND_IDS` that two workload headers are, with the same parameters and sizes; else None."""
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return None
    names = frozenset({a.get("name"), b.get("name")})
    same_rest = {k: v for k, v in a.items() if k != "name"} == {k: v for k, v in b.items() if k != "name"}
    return names if names in TEXT_AND_IDS and same_rest else None


def cmd_paired(args: argparse.Namespace) -> int:
    try:
        head_a, run_a = load_run(args.a, args.label_a)
        head_b, run_b = load_run(args.b, args.label_b)
    except (OSError, ValueError, KeyError) as exc:
        print(f"bench paired: error: {exc}", file=sys.stderr)
        return 2
    text_and_ids = _text_and_ids(head_a.get("workload"), head_b.get("workload"))
    if (head_a.get("workload") != head_b.get("workload") and text_and_ids is None) or (head_a.get("load") or {}).get(
            "seed") != (head_b.get("load") or {}).get("seed"):
        print("bench paired: error: the two files ran different workloads or seeds; requests have no twins",
              file=sys.stderr)
        return 2
    lengths_may_differ = text_and_ids is not None and TEXT_AND_IDS[text_and_ids]
    if lengths_may_differ:
        print("bench paired: text against ids of one seed: each run's prompt lengths are its own")
    elif text_and_ids is not None:
        print("bench paired: text against the server's ids of that text, one seed: twins' prompts are equal")
    twins, warnings = pair_requests(run_a, run_b, lengths_may_differ=lengths_may_differ)
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
