"""The decode attention benchmark's arguments and the request lengths it draws (the timing needs a GPU)."""

from __future__ import annotations

import pytest

from radixmesh.kernels.bench_decode import SWEEP_TILES, parse_args, seq_lens_for


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
