"""Expert parallelism on the CPU (gloo): MoE models at EP 2 give EP 1's greedy tokens.

Tiny Qwen3-MoE (a dense layer between sparse ones) and Mixtral checkpoints saved by transformers run at EP 1,
at TP 2 with the experts sliced (--ep-size 1), and at EP 2 with each dispatch: all-reduce of the ranks' partial
sums, and all-to-all of the tokens to their experts' ranks. The scenario batches requests, chunks prompts, hits
the radix cache and asks for prompt log-probs (the waves of test_tensor_parallel).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ..unit.moe_factory import write_hf_checkpoint
from ..unit.tp_factory import close_scheduler, make_tp_scheduler, pid_alive
from .test_tensor_parallel import WAVES, run_waves

pytestmark = [pytest.mark.integration]


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, tuple[dict, dict]]:
    """A checkpoint and its EP 1 tokens and cached counts."""
    path, _ = write_hf_checkpoint(request.param, tmp_path_factory.mktemp("ep") / request.param)
    sched, col = make_tp_scheduler(path, 1, chunked_prefill_size=32)
    return path, run_waves(sched, col, WAVES)


@pytest.mark.parametrize(("tp_size", "ep_size", "dispatch"), [(2, 1, "auto"), (2, 2, "all-reduce"),
                                                              (2, 2, "all-to-all")])
def test_expert_parallel_matches_one_rank(model: tuple[Path, tuple[dict, dict]], tp_size: int, ep_size: int,
                                          dispatch: str) -> None:
    path, reference = model
    sched, col = make_tp_scheduler(path, tp_size, chunked_prefill_size=32, ep_size=ep_size, moe_dispatch=dispatch)
    try:
        tokens, cached = run_waves(sched, col, WAVES)
        stats = sched.stats()
    finally:
        pids = close_scheduler(sched)
    assert tokens == reference[0]
    assert cached == reference[1]
    assert stats["moe_ep_size"] == ep_size and len(stats["moe_rank_assignments"]) == ep_size
    assert sum(stats["moe_rank_assignments"]) == sum(stats["moe_expert_assignments"]) > 0
    assert not any(pid_alive(pid) for pid in pids)


def test_auto_dispatch_switches_to_all_to_all_for_large_passes(model: tuple[Path, tuple[dict, dict]]) -> None:
    path, reference = model
    sched, col = make_tp_scheduler(path, 2, chunked_prefill_size=32, ep_size=2, moe_a2a_min_tokens=16)
    try:
        assert sched.runner.model.moe_runtime.dispatch == "auto"
        tokens, _ = run_waves(sched, col, WAVES)  # prefill chunks of 16+ tokens by all-to-all, decode by all-reduce
    finally:
        close_scheduler(sched)
    assert tokens == reference[0]
