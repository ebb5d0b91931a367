"""`radixmesh bench lora` end to end on a tiny random model on the CPU (the figures are the GPU's business)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from loadtests.commands import add_bench_commands

from .tp_factory import write_tiny_checkpoint


def test_bench_lora_prints_every_figure(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = write_tiny_checkpoint(tmp_path / "tiny", vocab_size=300)  # the benchmark draws ids from 100 up
    parser = argparse.ArgumentParser()
    add_bench_commands(parser)
    args = parser.parse_args(["lora", "--model", str(model), "--model-shape", "", "--device", "cpu",
                                      "--num-adapters", "3", "--rank", "4", "--batch-size", "4", "--input-len", "8",
                                      "--output-len", "6", "--max-total-tokens", "1024",
                                      "--lora-overlap", "on", "off"])
    assert args.func(args) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("base_batch_tok_s", "lora_batch_tok_s", "lora_batch_vs_base", "base_bs1_tok_s", "lora_bs1_tok_s",
                "lora_bs1_vs_base_bs1", "load_adapter_s", "lora_engine_base_batch_tok_s"):
        assert result[key] > 0, key
    assert result["num_adapters"] == 3 and result["rank"] == 4
    assert result["lora_overlap"] == "on"  # the first setting gives the other figures
    assert result["lora_batch_tok_s_by_overlap"]["on"] == result["lora_batch_tok_s"]
    for by in ("lora_batch_tok_s_by_overlap", "lora_batch_vs_base_by_overlap"):
        assert set(result[by]) == {"on", "off"} and min(result[by].values()) > 0, by
