"""Summarise a scheduler step trace (RADIXMESH_STEP_TRACE): where each request's time before its first token
went, from its arrival at the scheduler to its first token's results on the host.

    python scripts/step_trace_summary.py TRACE.jsonl [--json OUT.json]

Per request (the server's warm-up requests left out unless --with-warmup; medians by prompt length,
milliseconds): `queue` arrival -> the start of the step that admits it; `schedule` that step's host scheduling;
`launch` its prefill's launch on the host; `device_wait` the device still busy with earlier work after scheduling;
`device` the prefill's device time (first chunk's start to last chunk's end); `results` device end -> results read
on the host; `total` arrival -> results. Decode steps: median device and host launch times. The JSON's
per-request rows also carry the request id and the arrival and results times (seconds, the host's monotonic
clock) for `scripts/request_timeline.py`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from typing import Any

BUCKETS = ((0, 1000), (1000, 2000), (2000, 3000), (3000, 10**9))
PARTS = ("queue", "schedule", "launch", "device_wait", "device", "results", "total")


def load(path: str) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    arrivals: dict[str, dict[str, Any]] = {}
    batches: list[dict[str, Any]] = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            rec = json.loads(line)
            if rec["ev"] == "arrive":
                arrivals.setdefault(rec["rid"], rec)
            elif rec["ev"] == "batch":
                batches.append(rec)
    batches.sort(key=lambda b: b["id"])
    return arrivals, batches


WARMUP_PREFIX = "warmup-"
"""Request ids of the server's own warm-up (scheduler/warmup.py), left out unless --with-warmup."""


def per_request(arrivals: dict[str, dict[str, Any]], batches: list[dict[str, Any]],
                with_warmup: bool = False) -> list[dict[str, Any]]:
    firsts: dict[str, dict[str, Any]] = {}
    starts: dict[str, dict[str, Any]] = {}
    for b in batches:
        for rid in b.get("rids", []):
            starts.setdefault(rid, b)
        for rid in b.get("first", []):
            firsts.setdefault(rid, b)
    rows = []
    for rid, arrive in arrivals.items():
        if rid.startswith(WARMUP_PREFIX) and not with_warmup:
            continue
        first, start = firsts.get(rid), starts.get(rid)
        if first is None or start is None or "t_results" not in first or "t_launched" not in start:
            continue
        t_a = arrive["t"]
        row = {"rid": rid, "t_arrive": t_a, "t_results": first["t_results"], "prompt": arrive["prompt"],
               "chunks": sum(1 for b in batches if rid in b.get("rids", [])),
               "queue": start["t_step"] - t_a, "schedule": start["t_sched"] - start["t_step"],
               "launch": start["t_launched"] - start["t_sched"], "total": first["t_results"] - t_a}
        if start.get("t_dev_start") is not None and first.get("t_dev_end") is not None:
            row["device_wait"] = max(0.0, start["t_dev_start"] - start["t_sched"])
            row["device"] = first["t_dev_end"] - start["t_dev_start"]
            row["results"] = first["t_results"] - first["t_dev_end"]
        rows.append({k: (v * 1000 if k in PARTS else v) for k, v in row.items()})
    return rows


def bucket_medians(rows: list[dict[str, Any]], parts: tuple[str, ...],
                   extra: Callable[[list[dict[str, Any]]], dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Per prompt-length bucket (all requests first): its count, `extra(rows of the bucket)`, and the median of each
    of `parts` over the rows that have it (milliseconds, two decimals)."""
    cells = []
    for lo, hi in ((0, 10**9), *BUCKETS):
        sel = [r for r in rows if lo <= r["prompt"] < hi]
        if not sel:
            continue
        cell: dict[str, Any] = {"prompt": f"{lo}-{hi if hi < 10**9 else ''}", "count": len(sel),
                                **(extra(sel) if extra is not None else {})}
        for part in parts:
            vals = [r[part] for r in sel if part in r]
            if vals:
                cell[part] = round(statistics.median(vals), 2)
        cells.append(cell)
    return cells


def summarise(rows: list[dict[str, Any]], batches: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"requests": len(rows), "buckets": bucket_medians(rows, PARTS, lambda sel: {
        "prompt_median": statistics.median(r["prompt"] for r in sel), "chunks_max": max(r["chunks"] for r in sel)})}
    decode = [b for b in batches if b["kind"] == "decode" and b.get("t_dev_end") is not None]
    if decode:
        out["decode_device_ms"] = round(statistics.median((b["t_dev_end"] - b["t_dev_start"]) * 1000
                                                          for b in decode), 3)
        out["decode_launch_ms"] = round(statistics.median((b["t_launched"] - b["t_sched"]) * 1000
                                                          for b in decode if "t_launched" in b), 3)
        out["decode_steps"] = len(decode)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--json", help="also write the summary here")
    ap.add_argument("--with-warmup", action="store_true", help="count the server's warm-up requests too")
    args = ap.parse_args(argv)
    arrivals, batches = load(args.trace)
    rows = per_request(arrivals, batches, args.with_warmup)
    if not rows:
        print("no request with a complete record in the trace", file=sys.stderr)
        return 1
    summary = summarise(rows, batches)
    header = ["prompt", "count", "prompt_median", "chunks_max", *PARTS]
    print(" | ".join(header))
    for cell in summary["buckets"]:
        print(" | ".join(str(cell.get(h, "-")) for h in header))
    for key in ("decode_steps", "decode_device_ms", "decode_launch_ms"):
        if key in summary:
            print(f"{key}: {summary[key]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "requests": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
