"""`radixmesh bench lora` end to end on a tiny random model on the CPU (the figures are the GPU's business), and its
`--profile-bs1` (skipped off CUDA; on CUDA, faked here, one batch-1 request handed to the step profiler)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from loadtests.commands import add_bench_commands
from radixmesh.engine.bench import lora as bench_lora

from .tp_factory import write_tiny_checkpoint


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_commands(parser)
    return parser.parse_args(["lora", *argv])


def test_bench_lora_prints_every_figure(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    def no_profile(*_args: Any, **_kwargs: Any) -> dict[str, Any]:
        raise AssertionError("--profile-bs1 profiles on CUDA only")

    monkeypatch.setattr(bench_lora, "profile_decode_steps", no_profile)
    model = write_tiny_checkpoint(tmp_path / "tiny", vocab_size=300)  # the benchmark draws ids from 100 up
    args = _parse("--model", str(model), "--model-shape", "", "--device", "cpu", "--num-adapters", "3", "--rank", "4",
                  "--batch-size", "4", "--input-len", "8", "--output-len", "6", "--max-total-tokens", "1024",
                  "--lora-overlap", "on", "off", "--profile-bs1")
    assert args.profile_bs1
    assert args.func(args) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out.strip().splitlines()[-1])
    # on the CPU both engines say the profile is skipped, and the run goes on without it
    skipped = [line for line in captured.err.splitlines() if line.startswith("--profile-bs1: needs CUDA; skipped")]
    assert len(skipped) == 2 and "base_bs1_profile" in skipped[0] and "lora_bs1_profile" in skipped[1], skipped
    assert "base_bs1_profile" not in result and "lora_bs1_profile" not in result
    for key in ("base_batch_tok_s", "lora_batch_tok_s", "lora_batch_vs_base", "base_bs1_tok_s", "lora_bs1_tok_s",
                "lora_bs1_vs_base_bs1", "load_adapter_s", "lora_engine_base_batch_tok_s"):
        assert result[key] > 0, key
    assert result["num_adapters"] == 3 and result["rank"] == 4
    assert result["lora_overlap"] == "on"  # the first setting gives the other figures
    assert result["lora_batch_tok_s_by_overlap"]["on"] == result["lora_batch_tok_s"]
    for by in ("lora_batch_tok_s_by_overlap", "lora_batch_vs_base_by_overlap"):
        assert set(result[by]) == {"on", "off"} and min(result[by].values()) > 0, by


def test_profile_bs1_is_off_by_default() -> None:
    assert _parse().profile_bs1 is False


def test_profile_bs1_on_cuda_profiles_one_request(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """On CUDA (the device faked): one request of `--input-len` tokens with the adapter, decoding past the steps
    traced, handed to profile_decode_steps with the longer kernel list; its summary under the key."""
    calls: list[tuple[list[Any], dict[str, Any]]] = []

    def fake_profile(sched: Any, reqs: list[Any], **kwargs: Any) -> dict[str, Any]:
        calls.append((reqs, kwargs))
        return {"step_kernel_us_per_replay": 1.0}

    monkeypatch.setattr(bench_lora, "profile_decode_steps", fake_profile)
    sched = SimpleNamespace(runner=SimpleNamespace(device=SimpleNamespace(type="cuda"),
                                                   model_config=SimpleNamespace(vocab_size=300)))
    result: dict[str, Any] = {}
    bench_lora._profile_bs1(sched, _parse("--input-len", "12"), "a0", result, "lora_bs1_profile")
    assert result == {"lora_bs1_profile": {"step_kernel_us_per_replay": 1.0}}
    (reqs, kwargs), = calls
    assert kwargs == {"skip": bench_lora.PROFILE_SKIP, "steps": bench_lora.PROFILE_STEPS, "top": 40}
    (req,) = reqs
    assert req.lora_name == "a0" and len(req.origin_input_ids) == 12
    assert req.params.max_new_tokens > bench_lora.PROFILE_SKIP + bench_lora.PROFILE_STEPS
    assert "lora_bs1_profile: batch-1 decode step kernels with adapter a0" in capsys.readouterr().out
