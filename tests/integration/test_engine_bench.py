"""The engine benchmarks run end to end on CPU at tiny sizes and end with one JSON line of results.

Figures are not checked (benchmarks are commands, not timed tests); their presence and
internal consistency are.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.integration]
TINY = ["--model-shape", "smollm2-135m", "--device", "cpu", "--max-total-tokens", "4096"]


def run_bench(*args: str) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "radixmesh.cli", "bench", *args], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["device"] == "cpu" and result["load_format"] == "dummy"
    return result


def test_one_batch(tmp_path: Path) -> None:
    """Two prompt lengths on one loaded model: a JSON line each, in order."""
    results = tmp_path / "one-batch.jsonl"
    result = run_bench("one-batch", *TINY, "--batch-size", "2", "--input-len", "8", "16", "--output-len", "4",
                       "--result-file", str(results))
    assert result["bench"] == "one-batch" and result["batch_size"] == 2 and result["input_len"] == 16
    assert result["decode_step_latency_ms"] > 0 and result["prefill_throughput_tok_s"] > 0
    lines = [json.loads(line) for line in results.read_text().splitlines()]
    assert [line["input_len"] for line in lines] == [8, 16]


def test_one_batch_of_an_moe_model_at_two_batch_sizes(tmp_path: Path) -> None:
    """A tiny Qwen3-MoE config with random weights, batches of 1 and 3; the floor needs CUDA and says so."""
    from ..unit.moe_factory import write_hf_checkpoint

    path, _ = write_hf_checkpoint("qwen3_moe", tmp_path / "moe")
    config = tmp_path / "moe-config.json"  # the benchmark's prompts draw token ids from 100 up
    config.write_text(json.dumps({**json.loads((path / "config.json").read_text()), "vocab_size": 512}))
    results = tmp_path / "moe.jsonl"
    run_bench("one-batch", "--model", str(config), "--device", "cpu", "--max-total-tokens", "4096",
              "--batch-size", "1", "3", "--input-len", "8", "--output-len", "4", "--bandwidth-floor",
              "--result-file", str(results))
    lines = [json.loads(line) for line in results.read_text().splitlines()]
    assert [line["batch_size"] for line in lines] == [1, 3]
    assert lines[0]["moe_ep_size"] == 1 and sum(lines[1]["moe_expert_assignments"]) > 0
    assert "CUDA" in lines[0]["bandwidth_floor_note"] and "bandwidth_floor_note" not in lines[1]


def test_offline() -> None:
    result = run_bench("offline", *TINY, "--num-prompts", "4", "--random-input-len", "32",
                       "--random-output-len", "8")
    assert result["bench"] == "offline" and result["num_prompts"] == 4
    assert 4 <= result["total_output_tokens"] <= 32 and result["output_throughput_tok_s"] > 0


def test_structured_outputs_validate_and_match_token_counts() -> None:
    result = run_bench("structured", *TINY, "--num-prompts", "3", "--input-len", "16", "--max-new-tokens", "96")
    assert result["num_outputs"] == 3
    assert result["num_parsed_json"] == 3 and result["num_schema_valid"] == 3, result
    assert result["finish_reasons"] == {"stop": 3}
    # the unconstrained run decodes exactly the tokens the constrained one produced
    assert result["unconstrained_forward_passes"] == result["constrained_forward_passes"]


def test_structured_jump_forward_runs_fewer_passes() -> None:
    args = ["structured", *TINY, "--schema", "long-keys", "--num-prompts", "2", "--input-len", "16",
            "--max-new-tokens", "160", "--skip-unconstrained"]
    plain, jumping = run_bench(*args), run_bench(*args, "--enable-jump-forward")
    assert plain["num_schema_valid"] == jumping["num_schema_valid"] == 2
    assert jumping["constrained_forward_passes"] < plain["constrained_forward_passes"]
