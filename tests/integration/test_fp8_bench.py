"""The FP8 benchmarks run end to end on CPU at tiny sizes (the reference path) and report what they measured."""

from __future__ import annotations

import pytest

from .test_engine_bench import TINY, run_bench

pytestmark = [pytest.mark.slow, pytest.mark.integration]


def test_one_batch_with_fp8_weights_and_kv_reports_them() -> None:
    result = run_bench("one-batch", *TINY, "--batch-size", "2", "--input-len", "16", "--output-len", "4",
                       "--quantization", "fp8", "--kv-cache-dtype", "fp8_e4m3")
    assert result["quantization"] == "fp8" and result["kv_cache_dtype"] == "float8_e4m3fn"
    assert result["fp8_linear_layers"] == 30 * 4 and result["kv_bytes_per_token"] == 2 * 30 * 3 * 64
    assert result["decode_step_latency_ms"] > 0


def test_kv_capacity_and_fp8_accuracy() -> None:
    result = run_bench("kv-capacity", "--model-shape", "smollm2-135m", "--device", "cpu", "--variants",
                       "none/auto", "fp8/fp8_e5m2")
    plain, fp8 = result["variants"]
    assert plain["kv_bytes_per_token"] == 4 * fp8["kv_bytes_per_token"]  # float32 on the CPU vs one byte
    assert fp8["weight_gib"] < plain["weight_gib"] and fp8["max_total_tokens"] > 0
    result = run_bench("fp8-accuracy", "--model-shape", "smollm2-135m", "--load-format", "dummy", "--device", "cpu",
                       "--num-prompts", "8", "--max-len", "16")
    assert result["num_prompts"] == 8 and 0.9 < result["cosine_mean"] <= 1.0
    assert 0 <= result["top1_agreement"] <= result["top1_in_ref_top3"] <= 1
