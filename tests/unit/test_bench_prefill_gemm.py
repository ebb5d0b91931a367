"""bench_prefill_gemm's row lists and padding, and its refusal without a GPU."""

from __future__ import annotations

import pytest
import torch

from radixmesh.kernels.bench_prefill_gemm import parse_rows, round_up


def test_rows_as_a_range_or_a_list() -> None:
    assert parse_rows("1024:1300:128") == [1024, 1152, 1280]
    assert parse_rows("700,2048") == [700, 2048]


def test_round_up_keeps_multiples_and_rounds_the_rest_up() -> None:
    assert [round_up(m, 128) for m in (1, 128, 129, 2500)] == [128, 128, 256, 2560]
    assert round_up(2500, 256) == 2560


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")
def test_refuses_without_cuda() -> None:
    from radixmesh.kernels.bench_prefill_gemm import main

    with pytest.raises(SystemExit, match="needs a CUDA device"):
        main(["--rows", "64"])
