"""The decode attention benchmark's arguments and the request lengths it draws (the timing needs a GPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from radixmesh.kernels.bench_decode import (
    FP8_K_SCALE,
    FP8_V_SCALE,
    SWEEP_TILES,
    SWEEP_TILES_FP8,
    main,
    make_inputs,
    parse_args,
    seq_lens_for,
)


def test_lengths_are_fixed_or_drawn_in_range_and_repeatable() -> None:
    assert seq_lens_for(parse_args(["--batch", "3", "--seq-len", "100"])) == [100, 100, 100]
    args = parse_args(["--batch", "200", "--min-seq-len", "256", "--seq-len", "6144"])
    lens = seq_lens_for(args)
    assert len(lens) == 200 and min(lens) >= 256 and max(lens) <= 6144
    assert len(set(lens)) > 100  # drawn, not one length
    assert seq_lens_for(args) == lens  # seeded: every run times the same batch


def test_sweep_tiles_parse_and_default_to_the_module_list() -> None:
    assert parse_args(["--sweep"]).sweep_tiles == list(SWEEP_TILES)
    assert parse_args(["--sweep", "--sweep-tiles", "64,4,2", "32,4,3"]).sweep_tiles == [(64, 4, 2), (32, 4, 3)]


@pytest.mark.parametrize("argv", [["--sweep-tiles", "64,4"], ["--sweep-tiles", "a,b,c"],
                                  ["--min-seq-len", "300", "--seq-len", "200"], ["--sweep-splits", "0"]])
def test_bad_arguments_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(argv)


def test_fp8_sweep_arguments() -> None:
    args = parse_args(["--dtype", "fp8_e4m3", "--sweep", "--sweep-tiles", "fp8", "--sweep-widen", "f32", "f16",
                       "--grid-orders", "head-major"])
    assert args.sweep_tiles == list(SWEEP_TILES_FP8) and args.sweep_widen == ["f32", "f16"]
    with pytest.raises(SystemExit):
        parse_args(["--sweep-widen", "bf16"])


def test_fp8_inputs_hold_kv_over_their_scales() -> None:
    import torch

    inputs = make_inputs(parse_args(["--dtype", "fp8_e4m3", "--batch", "2", "--seq-len", "5", "--heads", "4",
                                     "--kv-heads", "2", "--head-dim", "16"]), torch.device("cpu"))
    assert inputs["k_buf"].dtype == torch.float8_e4m3fn and inputs["q"].dtype == torch.bfloat16
    assert (inputs["k_scale"], inputs["v_scale"]) == (FP8_K_SCALE, FP8_V_SCALE)
    assert inputs["kv_indptr"].tolist() == [0, 5, 10] and sorted(inputs["kv_indices"].tolist()) == list(range(1, 11))


def _row(batch: int, tiles: list[int], widen: str, us: float, **extra: object) -> str:
    row = {"dtype": "fp8_e4m3", "batch": batch, "tiles": tiles, "fp8_widen": widen, "median_us": us,
           "head_major": True, "chosen_splits": True, "max_abs_err": 0.01, **extra}
    return json.dumps(row)


def test_pick_takes_the_least_total_time_over_every_batch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = [
        _row(168, [64, 4, 2], "f32", 900), _row(48, [64, 4, 2], "f32", 300),
        _row(168, [128, 4, 3], "f16", 600), _row(48, [128, 4, 3], "f16", 250),
        _row(168, [128, 8, 2], "direct", 500),  # fastest at 168, but never measured at 48: not a candidate
        _row(168, [256, 8, 2], "f16", 100, max_abs_err=3.0), _row(48, [256, 8, 2], "f16", 50),  # wrong: skipped
        _row(168, [64, 4, 3], "f32", 10, chosen_splits=False), _row(48, [64, 4, 3], "f32", 10),  # other split count
        json.dumps({"sweep_best": {}}), "not json",
    ]
    path = tmp_path / "sweep.jsonl"
    path.write_text("\n".join(lines) + "\n")
    assert main(["--pick", str(path)]) == 0
    out = capsys.readouterr()
    assert out.out.strip() == "RADIXMESH_DECODE_FP8_TILES=128,4,3 RADIXMESH_DECODE_FP8_WIDEN=f16"
    assert "(the defaults 64,4,2 f32: 1200.0 us)" in out.err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["--pick", str(empty)]) == 1
