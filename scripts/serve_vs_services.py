"""Put `radixmesh serve` and the services side by side on the same online workloads (gpu_suite.sh's
serve-vs-services stage writes the inputs): per workload, both paths' medians, the services' extra time to
first token (of the medians, and request by request: the same seeded prompts at the same offsets), the ITL
difference, and the router's own added latency under that load (its histogram, scraped before and after).

    python3 scripts/serve_vs_services.py DIR NAME [NAME ...] --out OUT.json
reads DIR/serve-NAME.json, DIR/services-NAME.json, DIR/router-NAME-before.txt and DIR/router-NAME-after.txt,
and DIR/ARM-NAME.json for the EXTRA_ARMS present (a gateway straight to the worker; a gateway with the router in
its process; a second router process), with DIR/rt-ARM-NAME-before.txt and -after.txt for an arm's own router.
Where DIR/gw-ARM-NAME-before.txt and -after.txt exist (ARM: serve, services or an extra arm), it also reads the
front end's `radixmesh_ttft_overhead_seconds` histogram: each request's TTFT less the engine's own time, so the
paths compare without the engine's run-to-run noise (queue waits, batch boundaries).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

TTFT_TARGET_MS = 3.0
ITL_TARGET_MS = 0.2
ROUTER_P50_TARGET_MS = 1.0
EXTRA_ARMS = {"direct": "gateway straight to the worker", "embedded": "gateway routing in its own process",
              "embedded-async": "gateway routing in its own process, index lookups awaited",
              "embedded-approx": "gateway routing in its own process, approx-tree",
              "router-async": "gateway -> a router whose index lookups are awaited -> worker",
              "router-grpc": "gateway -> a second router -> worker, both hops over gRPC (no lanes)",
              "direct-grpc": "gateway straight to the worker over gRPC (no lane)"}
"""More front ends over the same cluster (gpu_suite.sh: SVS_EXTRA), when their files exist."""
KEPT = ("num_completed", "num_failed", "duration_s", "output_throughput", "concurrency")


def _run(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    run: dict[str, Any] = data["runs"][0]
    return {"workload": data["workload"], "load": data["load"], "summary": run["summary"],
            "requests": run.get("requests", [])}


def _medians(summary: dict[str, Any]) -> dict[str, Any]:
    out = {k: summary[k] for k in KEPT if k in summary}
    for metric in ("ttft", "itl", "e2e"):
        out[f"{metric}_median_ms"] = summary[metric]["median_ms"]
        out[f"{metric}_p90_ms"] = summary[metric]["p90_ms"]
    return out


def paired_ttft_ms(serve: list[dict[str, Any]], services: list[dict[str, Any]]) -> dict[str, float] | None:
    """Services minus serve, request by request (matched by session id; both answered)."""
    by_id = {r["session_id"]: r for r in serve if r.get("ttft_s") is not None}
    diffs = [(r["ttft_s"] - by_id[r["session_id"]]["ttft_s"]) * 1e3 for r in services
             if r.get("ttft_s") is not None and r["session_id"] in by_id]
    if not diffs:
        return None
    return {"median": statistics.median(diffs), "mean": statistics.fmean(diffs), "pairs": len(diffs)}


def _median_of(paired: dict[str, float] | None) -> float:
    return paired["median"] if paired else float("nan")


def router_p50_ms(before: Path, after: Path) -> dict[str, float]:
    from radixmesh.cluster.bench_cluster import histogram_quantile

    base, now = before.read_text(), after.read_text()
    return {"overhead_p50_ms": histogram_quantile(now, "radixmesh_router_overhead_seconds", 0.5, base) * 1e3,
            "decision_p50_ms": histogram_quantile(now, "radixmesh_router_decision_seconds", 0.5, base) * 1e3}


def compare(directory: Path, name: str) -> dict[str, Any]:
    serve, services = _run(directory / f"serve-{name}.json"), _run(directory / f"services-{name}.json")
    a, b = _medians(serve["summary"]), _medians(services["summary"])
    ttft_diff = b["ttft_median_ms"] - a["ttft_median_ms"]
    itl_diff = b["itl_median_ms"] - a["itl_median_ms"]
    result: dict[str, Any] = {
        "workload": serve["workload"], "load": serve["load"], "serve": a, "services": b,
        "ttft_median_diff_ms": ttft_diff, "ttft_paired_diff_ms": paired_ttft_ms(serve["requests"],
                                                                                services["requests"]),
        "itl_median_diff_ms": itl_diff,
        "targets": {"ttft_diff_ms": TTFT_TARGET_MS, "itl_diff_ms": ITL_TARGET_MS,
                    "router_overhead_p50_ms": ROUTER_P50_TARGET_MS},
    }
    before, after = directory / f"router-{name}-before.txt", directory / f"router-{name}-after.txt"
    if before.is_file() and after.is_file():
        result["router"] = router_p50_ms(before, after)
    for arm in EXTRA_ARMS:
        if (directory / f"{arm}-{name}.json").is_file():
            run = _run(directory / f"{arm}-{name}.json")
            result[arm] = _medians(run["summary"])
            result[f"{arm}_ttft_paired_diff_ms"] = paired_ttft_ms(serve["requests"], run["requests"])
            result[f"{arm}_itl_median_diff_ms"] = result[arm]["itl_median_ms"] - a["itl_median_ms"]
            before, after = directory / f"rt-{arm}-{name}-before.txt", directory / f"rt-{arm}-{name}-after.txt"
            if before.is_file() and after.is_file():  # the arm's own router process
                result[f"{arm}_router"] = router_p50_ms(before, after)
    found = {arm: _overhead_p50_ms(directory, arm, name) for arm in ("serve", "services", *EXTRA_ARMS)}
    overhead = {arm: ms for arm, ms in found.items() if ms is not None}
    if overhead:
        result["ttft_overhead_p50_ms"] = overhead
        if "serve" in overhead:
            result["ttft_overhead_diff_ms"] = {arm: ms - overhead["serve"] for arm, ms in overhead.items()
                                               if arm != "serve"}
    return result


def _overhead_p50_ms(directory: Path, arm: str, name: str) -> float | None:
    """Median of the TTFT less the engine's share over one run, from the front end's histogram scrapes."""
    from radixmesh.cluster.bench_cluster import histogram_quantile

    before, after = directory / f"gw-{arm}-{name}-before.txt", directory / f"gw-{arm}-{name}-after.txt"
    if not (before.is_file() and after.is_file()):
        return None
    p50 = histogram_quantile(after.read_text(), "radixmesh_ttft_overhead_seconds", 0.5, before.read_text())
    return None if p50 != p50 else p50 * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", type=Path)
    parser.add_argument("names", nargs="+", help="workload names (rate1, rate8, ...)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    results = {name: compare(args.directory, name) for name in args.names}
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    for name, r in results.items():
        paired = r["ttft_paired_diff_ms"]
        router = r.get("router", {})
        print(f"{name}: TTFT median serve {r['serve']['ttft_median_ms']:.2f} ms, services "
              f"{r['services']['ttft_median_ms']:.2f} ms (+{r['ttft_median_diff_ms']:.2f}; paired "
              f"{paired['median'] if paired else float('nan'):+.2f}); ITL {r['serve']['itl_median_ms']:.3f} vs "
              f"{r['services']['itl_median_ms']:.3f} ms ({r['itl_median_diff_ms']:+.3f}); router overhead p50 "
              f"{router.get('overhead_p50_ms', float('nan')):.3f} ms")
        if "ttft_overhead_p50_ms" in r:
            arms = ", ".join(f"{arm} {ms:.3f}" for arm, ms in r["ttft_overhead_p50_ms"].items())
            diffs = ", ".join(f"{arm} {ms:+.3f}" for arm, ms in r.get("ttft_overhead_diff_ms", {}).items())
            print(f"{name}: TTFT outside the engine, p50 (ms): {arms}; over serve: {diffs}")
        for arm in EXTRA_ARMS:
            if arm in r:
                print(f"{name}: {EXTRA_ARMS[arm]}: TTFT median {r[arm]['ttft_median_ms']:.2f} ms, paired vs serve "
                      f"{_median_of(r[f'{arm}_ttft_paired_diff_ms']):+.2f}; ITL {r[arm]['itl_median_ms']:.3f} ms "
                      f"({r[f'{arm}_itl_median_diff_ms']:+.3f})")
            if f"{arm}_router" in r:
                print(f"{name}: {arm}: router overhead p50 {r[f'{arm}_router']['overhead_p50_ms']:.3f} ms, decision "
                      f"p50 {r[f'{arm}_router']['decision_p50_ms']:.3f} ms")


if __name__ == "__main__":
    main()
