"""Where each request's time to first token went, end to end: a `bench serving` result file joined with the
front end's request trace (RADIXMESH_REQUEST_TRACE) and, when given, the scheduler's step trace
(RADIXMESH_STEP_TRACE), all on one host's monotonic clock.

    python scripts/request_timeline.py RESULT.json --front REQUEST_TRACE.jsonl [--steps STEP_TRACE.jsonl]
        [--json OUT.json]

Per request (milliseconds; they add up to the client's TTFT):
  client_to_app  the client's send -> the app has the request (connection, HTTP parsing)
  body           -> its body read
  tokenize       the prompt's tokenization (the server's own figure)
  admit          -> admitted with its ids (parsing, validation, the rest of the handler)
  start          -> handed to the engine client (`serve`: the request's message sent)
  to_scheduler   -> the scheduler took it (the hop, and its loop not listening)        [--steps]
  scheduler      -> its first token's results on the scheduler's host                  [--steps]
  to_front       -> that output reached the front end                                  [--steps]
  engine         handed to the engine -> its first output at the front end (the three above, without --steps)
  detokenize     -> the first token's text out of the detokenizer
  to_wire        -> the first bytes handed to the HTTP server (SSE formatting, the stream's task)
  to_client      -> the client read the first text (the socket, the client's own loop)
Client requests are matched to the trace by prompt tokens among the requests that reached the app within
`--window-ms` of the send; the scheduler's records by request id. Medians by prompt length are printed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # (with PYTHONSAFEPATH set, as gpu_suite.sh runs it)
from step_trace_summary import bucket_medians, load, per_request

PHASES = ("client_to_app", "body", "tokenize", "admit", "start", "to_scheduler", "scheduler", "to_front", "engine",
          "detokenize", "to_wire", "to_client", "ttft")
GENERATION_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")


def client_requests(path: Path, label: str | None = None) -> list[dict[str, Any]]:
    """The successful requests of one run, with absolute send and first-text times."""
    data = json.loads(path.read_text())
    runs = [r for r in data["runs"] if label is None or r["label"] == label]
    if not runs:
        raise SystemExit(f"{path}: no run{f' labelled {label!r}' if label else ''}")
    run = runs[0]
    origin = run.get("clock_origin_s")
    if origin is None:
        raise SystemExit(f"{path}: no clock_origin_s (written by bench serving from this version on)")
    out = []
    for r in run["requests"]:
        if r["success"] and r.get("ttft_s") is not None:
            send = origin + r["start_s"]
            out.append({"send": send, "first_text": send + r["ttft_s"], "prompt": r["prompt_len"],
                        "ttft": r["ttft_s"]})
    return sorted(out, key=lambda r: r["send"])


def front_records(paths: list[Path]) -> list[dict[str, Any]]:
    records = []
    for path in paths:
        for line in path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                if rec.get("path") in GENERATION_PATHS and "rid" in rec:
                    records.append(rec)
    return sorted(records, key=lambda r: r["t_http"])


def match(clients: list[dict[str, Any]], fronts: list[dict[str, Any]], window_s: float) -> list[tuple[dict, dict]]:
    """Each client request with the earliest unused trace record of its prompt length inside the window."""
    used: set[int] = set()
    pairs = []
    for c in clients:
        for i, f in enumerate(fronts):
            if i in used or f["t_http"] < c["send"] - 0.001:
                continue
            if f["t_http"] > c["send"] + window_s:
                break
            if f.get("prompt_tokens") == c["prompt"]:
                used.add(i)
                pairs.append((c, f))
                break
    return pairs


def timeline(c: dict[str, Any], f: dict[str, Any], step: dict[str, Any] | None) -> dict[str, Any]:
    """One request's phases in milliseconds (a phase whose ends are missing is left out)."""
    tokenize = f.get("tokenize_s") or 0.0
    points = {"send": c["send"], "http": f.get("t_http"), "body": f.get("t_body"), "open": f.get("t_open"),
              "submit": f.get("t_submit", f.get("t_open")), "first_out": f.get("t_first_out"),
              "first_chunk": f.get("t_first_chunk"), "first_body": f.get("t_first_body"), "first_text": c["first_text"]}

    def span(a: str, b: str, less: float = 0.0) -> float | None:
        if points[a] is None or points[b] is None:
            return None
        return (points[b] - points[a] - less) * 1000

    row: dict[str, Any] = {"rid": f["rid"], "prompt": c["prompt"], "client_to_app": span("send", "http"),
                           "body": span("http", "body"), "tokenize": tokenize * 1000,
                           "admit": span("body", "open", tokenize), "engine": span("submit", "first_out"),
                           "detokenize": span("first_out", "first_chunk"), "to_wire": span("first_chunk", "first_body"),
                           "to_client": span("first_body", "first_text"), "ttft": c["ttft"] * 1000}
    if "t_submit" in f:
        row["start"] = span("open", "submit")
    if step is not None:
        points["arrive"], points["results"] = step["t_arrive"], step["t_results"]
        row.update(to_scheduler=span("submit", "arrive"), scheduler=span("arrive", "results"),
                   to_front=span("results", "first_out"))
        row.update({f"sched_{k}": v for k, v in step.items() if k in ("queue", "device_wait", "device")})
    return {k: v for k, v in row.items() if v is not None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("result", type=Path, help="a `bench serving --output-file` JSON")
    ap.add_argument("--front", type=Path, nargs="+", required=True, help="the front end's request trace file(s)")
    ap.add_argument("--steps", type=Path, help="the scheduler's step trace")
    ap.add_argument("--label", help="the run of RESULT to use (default: its first)")
    ap.add_argument("--window-ms", type=float, default=500.0,
                    help="how long after its send a request may reach the app and still be matched")
    ap.add_argument("--json", type=Path, help="also write the summary and every request's phases here")
    args = ap.parse_args(argv)
    clients = client_requests(args.result, args.label)
    pairs = match(clients, front_records(args.front), args.window_ms / 1000)
    steps: dict[str, dict[str, Any]] = {}
    if args.steps is not None:
        steps = {r["rid"]: r for r in per_request(*load(str(args.steps)))}
    rows = [timeline(c, f, steps.get(f["rid"]) if args.steps is not None else None) for c, f in pairs]
    if not rows:
        print("no client request matched a traced one", file=sys.stderr)
        return 1
    cells = bucket_medians(rows, PHASES)
    print(f"{len(rows)} of {len(clients)} requests matched; medians in ms")
    shown = ["prompt", "count", *[p for p in PHASES if any(p in c for c in cells)]]
    print(" | ".join(shown))
    for cell in cells:
        print(" | ".join(str(cell.get(h, "-")) for h in shown))
    if args.json is not None:
        args.json.write_text(json.dumps({"summary": cells, "requests": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
