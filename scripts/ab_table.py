"""The headline figures of `scripts/gpu_ab.sh`'s trees side by side: 8B batch-1 decode, offline output
throughput, and the online workloads' median / p99 TTFT, ITL and TTFT slope per 1k prompt tokens; then, per online
run, each tree against the first tree on the same prompts (`radixmesh bench paired`'s comparison: the runs share a
seed, so each request has a twin): the per-request differences of TTFT and ITL, steadier than the medians'
difference when the machine drifts between the servers.

    python3 scripts/ab_table.py OUT NAME [NAME ...]     (OUT/<NAME>/ as gpu_ab.sh leaves them)
"""

from __future__ import annotations

import glob
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from loadtests.paired import compare, format_result, load_run, pair_requests


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


def figures(root: Path, name: str) -> dict[str, Any]:
    """The figures one tree's directory holds (missing runs are left out)."""
    out: dict[str, Any] = {}
    for row in _jsonl(root / name / "one-batch.jsonl"):
        out[f"batch-1 {row['model']} tok/s"] = row.get("decode_throughput_tok_s")
    for row in _jsonl(root / name / "offline.jsonl"):
        out["offline out tok/s"] = row.get("output_throughput_tok_s")
    for path in sorted(glob.glob(str(root / name / f"online-{name}-*.json"))):
        workload = Path(path).stem.removeprefix(f"online-{name}-")
        summary = json.loads(Path(path).read_text())["runs"][0]["summary"]
        out[f"online {workload} requests"] = summary["num_completed"]
        out[f"online {workload} TTFT median ms"] = round(summary["ttft"]["median_ms"], 1)
        out[f"online {workload} TTFT p99 ms"] = round(summary["ttft"]["p99_ms"], 1)
        out[f"online {workload} ITL median ms"] = round(summary["itl"]["median_ms"], 2)
        fit = summary.get("ttft_fit") or {}
        if fit.get("per_1k_ms") is not None:
            out[f"online {workload} TTFT ms per 1k tokens"] = round(fit["per_1k_ms"], 1)
    return out


def paired(root: Path, names: list[str]) -> list[tuple[str, str, dict[str, Any]]]:
    """(run, other tree, `bench paired`'s comparison) per online run of the first tree (`online-<first>-<run>.json`)
    and each other tree's run of the same name (loadtests/paired.py: per-request differences of TTFT and mean ITL,
    overall, by prompt length, first requests apart)."""
    first, out = names[0], []
    for path in sorted(glob.glob(str(root / first / f"online-{first}-*.json"))):
        run = Path(path).stem.removeprefix(f"online-{first}-")
        for other in names[1:]:
            other_path = root / other / f"online-{other}-{run}.json"
            if other_path.exists():
                twins, _ = pair_requests(load_run(Path(path), None)[1], load_run(other_path, None)[1])
                if twins:
                    out.append((run, other, compare(twins)))
    return out


def main(argv: list[str]) -> int:
    root, names = Path(argv[1]), argv[2:]
    table = {name: figures(root, name) for name in names}
    keys = list(dict.fromkeys(k for figs in table.values() for k in figs))
    print(f"{'figure':<40}" + "".join(f"{n:>14}" for n in names))
    for key in keys:
        print(f"{key:<40}" + "".join(f"{table[n].get(key, '-')!s:>14}" for n in names))
    pairs = paired(root, names)
    for run, other, result in pairs:
        print(f"\nonline {run}, per request:\n" + format_result(result, names[0], other))
    saved = {f"{run} {other} - {names[0]}": result for run, other, result in pairs}
    (root / "ab.json").write_text(json.dumps({**table, "paired_ttft": saved}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
