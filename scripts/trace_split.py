"""Where a request's time to first token goes, from its OpenTelemetry spans.

    python scripts/trace_split.py collect --port P --out spans.json
        an OTLP/gRPC receiver on 127.0.0.1:P (point services at --otlp-endpoint http://127.0.0.1:P);
        on SIGTERM/SIGINT it writes every span it received to spans.json
    python scripts/trace_split.py summarize spans.json [--json out.json]
        per span name (service/name): how many, median start offset from the trace's root span and
        median duration, in ms, so the path gateway -> tokenizer -> router -> worker reads top to bottom
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import threading
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def collect(port: int, out: Path) -> None:
    from tests.otlp_receiver import OtlpReceiver

    receiver = OtlpReceiver(port=port)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    with receiver:
        print(f"collecting spans at {receiver.endpoint}", flush=True)
        done.wait()
        spans = receiver.spans
    out.write_text(json.dumps([asdict(s) for s in spans]))
    print(f"wrote {len(spans)} spans to {out}", flush=True)


def summarize(spans: list[dict[str, Any]]) -> list[dict[str, Any]]:
    traces: dict[str, list[dict[str, Any]]] = {}
    for span in spans:
        traces.setdefault(span["trace_id"], []).append(span)
    offsets: dict[str, list[float]] = {}
    durations: dict[str, list[float]] = {}
    for members in traces.values():
        roots = [s for s in members if not s["parent_span_id"]]
        if len(roots) != 1:
            continue  # a trace whose root was not exported (or several roots): not comparable
        start = roots[0]["start_ns"]
        for s in members:
            key = f"{s['service'].removeprefix('radixmesh-')}/{s['name']}"
            offsets.setdefault(key, []).append((s["start_ns"] - start) / 1e6)
            durations.setdefault(key, []).append((s["end_ns"] - s["start_ns"]) / 1e6)
    rows = [{"span": key, "count": len(durations[key]), "median_start_ms": round(statistics.median(offsets[key]), 3),
             "median_duration_ms": round(statistics.median(durations[key]), 3)} for key in durations]
    return sorted(rows, key=lambda r: (r["median_start_ms"], -r["median_duration_ms"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("collect")
    c.add_argument("--port", type=int, required=True)
    c.add_argument("--out", type=Path, required=True)
    s = sub.add_parser("summarize")
    s.add_argument("spans", type=Path)
    s.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.cmd == "collect":
        collect(args.port, args.out)
        return
    rows = summarize(json.loads(args.spans.read_text()))
    print(f"{'span':<40} {'count':>6} {'start ms':>10} {'duration ms':>12}")
    for row in rows:
        print(f"{row['span']:<40} {row['count']:>6} {row['median_start_ms']:>10.3f} {row['median_duration_ms']:>12.3f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
