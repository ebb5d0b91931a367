"""The table of gpu_suite's `moe` stage (issue 48's targets), from its result files in OUT:

    python3 scripts/moe_table.py OUT      # reads moe-one-batch.jsonl, moe-offline.jsonl, moe-mixtral.jsonl

Prints each figure beside its target and one JSON line with all of them (moe-summary).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

FLOOR_TARGET = 0.80


def _lines(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip().startswith("{")]


def moe_kernel_share(profile: dict[str, Any]) -> float | None:
    """The MoE kernels' share of the device time of the traced windows (bench offline --profile)."""
    totals: dict[str, float] = {}
    for window in profile.get("kernel_windows", []):
        for kind, ms in window.get("kernel_ms_by_kind", {}).items():
            totals[kind] = totals.get(kind, 0.0) + ms
    all_ms = sum(totals.values())
    return round(totals.get("moe", 0.0) / all_ms, 4) if all_ms else None


def summarize(out: Path) -> dict[str, Any]:
    summary: dict[str, Any] = {"bench": "moe-summary"}
    one = [r for r in _lines(out / "moe-one-batch.jsonl") if r.get("batch_size") == 1]
    if one:
        r = one[-1]
        summary["qwen3_30b_a3b_batch1"] = {k: r.get(k) for k in (
            "decode_throughput_tok_s", "bandwidth_floor_tok_s", "of_bandwidth_floor", "copy_bandwidth_tb_s",
            "graph_replay_ms", "decode_read_bytes")}
        summary["qwen3_30b_a3b_batch1"]["meets_80pct"] = (r.get("of_bandwidth_floor") or 0) >= FLOOR_TARGET
    offline = {r["model"]: r for r in _lines(out / "moe-offline.jsonl")}
    moe, dense = offline.get("qwen3-30b-a3b"), offline.get("qwen3-8b")
    if moe is not None:
        summary["offline_qwen3_30b_a3b_out_tok_s"] = moe["output_throughput_tok_s"]
        summary["offline_moe_kernel_share"] = moe_kernel_share(moe.get("profile", {}))
    if dense is not None:
        summary["offline_qwen3_8b_out_tok_s"] = dense["output_throughput_tok_s"]
    if moe is not None and dense is not None:
        summary["offline_moe_over_dense"] = round(moe["output_throughput_tok_s"] / dense["output_throughput_tok_s"], 3)
    mixtral: dict[str, float] = {}
    for r in _lines(out / "moe-mixtral.jsonl"):
        mode = "ep2" if r.get("moe_ep_size") == 2 else "tp2"
        mode += "_dp" if r.get("dp_attention") else ""
        mixtral[f"{mode}_batch{r['batch_size']}_decode_tok_s"] = r["decode_throughput_tok_s"]
    if mixtral:
        summary["mixtral_8x7b_two_gpus"] = mixtral
        for batch in (1, 64):
            ep, tp = mixtral.get(f"ep2_batch{batch}_decode_tok_s"), mixtral.get(f"tp2_batch{batch}_decode_tok_s")
            if ep and tp:
                summary["mixtral_8x7b_two_gpus"][f"batch{batch}_faster"] = "ep2" if ep > tp else "tp2"
    dp = dp_attention_table(_lines(out / "moe-dp.jsonl"))
    if dp:
        summary["dp_attention_two_gpus"] = dp
    return summary


def dp_attention_table(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Decode tok/s at EP 2 (eager) with and without data-parallel attention, per model and batch (stage moe-dp)."""
    table: dict[str, Any] = {}
    for r in rows:
        key = f"{r['model']}_batch{r['batch_size']}"
        table.setdefault(key, {})["dp" if r.get("dp_attention") else "ep2"] = r["decode_throughput_tok_s"]
    for cell in table.values():
        if cell.get("dp") and cell.get("ep2"):
            cell["dp_over_ep2"] = round(cell["dp"] / cell["ep2"], 3)
    return table


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "out")
    summary = summarize(out)
    for key, value in summary.items():
        print(f"{key:<34} {value}")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
