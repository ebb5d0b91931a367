"""Summarise `radixmesh bench kv-transfer` result lines: each run's GB/s against the plain device copy, against
grpc at the same size (from a grpc run in the same files) and against the bare NIXL READ of its own run.

    python3 scripts/kv_transfer_summary.py out/kv-transfer-nixl.jsonl [more.jsonl ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(paths: list[str]) -> int:
    rows = [json.loads(line) for path in paths for line in Path(path).read_text().splitlines() if line.strip()]
    grpc = {r["num_tokens"]: r["transfer_gbps"] for r in rows if r["transport"] == "grpc"}
    print(f"{'transport':<10}{'mode':<9}{'UCX_TLS':<16}{'slots':<12}{'tokens':>8}{'total ms':>10}{'GB/s':>9}"
          f"{'vs copy':>9}{'vs grpc':>9}{'vs bare':>9}")
    for r in rows:
        tls = r.get("ucx", {}).get("UCX_TLS", "(default)") if r["transport"] == "nixl" else ""
        vs_grpc = r["transfer_gbps"] / grpc[r["num_tokens"]] if grpc.get(r["num_tokens"]) else None
        cells = [f"{r['transport']:<10}", f"{r.get('mode') or '':<9}", f"{tls:<16}", f"{r.get('slots', 'random'):<12}",
                 f"{r['num_tokens']:>8}", f"{r['total_ms_median']:>10.2f}", f"{r['transfer_gbps']:>9.2f}",
                 f"{r['bandwidth_ratio']:>9.3f}", f"{vs_grpc:>9.1f}" if vs_grpc else f"{'-':>9}",
                 f"{r['bare_ratio']:>9.3f}" if "bare_ratio" in r else f"{'-':>9}"]
        print("".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
