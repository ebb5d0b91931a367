"""scripts/moe_table.py: the `moe` GPU stage's summary from its result files (figures made up here)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .script_loader import load_script


def _write(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_summary_of_the_stage(tmp_path: Path) -> None:
    _write(tmp_path / "moe-one-batch.jsonl", [{"batch_size": 1, "decode_throughput_tok_s": 600.0,
                                               "bandwidth_floor_tok_s": 700.0, "of_bandwidth_floor": 0.857}])
    window = {"kernel_ms_by_kind": {"moe": 30.0, "gemm": 50.0, "decode-attention": 20.0}}
    _write(tmp_path / "moe-offline.jsonl", [
        {"model": "qwen3-30b-a3b", "output_throughput_tok_s": 5000.0, "profile": {"kernel_windows": [window] * 2}},
        {"model": "qwen3-8b", "output_throughput_tok_s": 4000.0}])
    _write(tmp_path / "moe-mixtral.jsonl", [
        {"moe_ep_size": 2, "batch_size": 1, "decode_throughput_tok_s": 80.0},
        {"moe_ep_size": 2, "batch_size": 64, "decode_throughput_tok_s": 2000.0},
        {"moe_ep_size": 1, "batch_size": 1, "decode_throughput_tok_s": 90.0},
        {"moe_ep_size": 1, "batch_size": 64, "decode_throughput_tok_s": 1900.0}])
    summary = load_script("moe_table").summarize(tmp_path)
    assert summary["qwen3_30b_a3b_batch1"]["meets_80pct"] is True
    assert summary["offline_moe_over_dense"] == 1.25 and summary["offline_moe_kernel_share"] == 0.3
    assert summary["mixtral_8x7b_two_gpus"]["batch1_faster"] == "tp2"
    assert summary["mixtral_8x7b_two_gpus"]["batch64_faster"] == "ep2"


def test_missing_files_give_what_there_is(tmp_path: Path) -> None:
    assert load_script("moe_table").summarize(tmp_path) == {"bench": "moe-summary"}
