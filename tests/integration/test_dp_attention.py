"""Data-parallel attention on the CPU (gloo): MoE models at TP 2 / EP 2 with --enable-dp-attention give EP 1's
greedy tokens, and each rank's KV pool accounts for every slot.

Tiny Qwen3-MoE (a dense layer between sparse ones) and Mixtral checkpoints saved by transformers. The scenario:
one request alone (rank 1 idle in its passes), then five of different lengths and output lengths (the ranks'
shares differ in size, and the last decode steps run on one rank), then test_tensor_parallel's waves (chunked
prompts, shared prefixes, prompt log-probs: extra LM-head rows from both ranks); with overlap scheduling too (each
rank's share of a decode step reads its inputs from the previous step's sampled tokens).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from radixmesh.engine.distributed.dp_attention import DpPass
from radixmesh.engine.dp_kv import DpKVCacheManager
from radixmesh.engine.request import Req
from radixmesh.engine.scheduler.core import Scheduler
from radixmesh.wire.messages import TokenOut
from radixmesh.wire.sampling import SamplingParams

from ..unit.moe_factory import write_hf_checkpoint
from ..unit.scheduler_factory import Collector, assert_no_leak, clone, make_requests, run_until_idle
from ..unit.tp_factory import close_scheduler, make_tp_scheduler, pid_alive
from .test_tensor_parallel import WAVES

pytestmark = [pytest.mark.integration]


def scenario() -> list[list[Req]]:
    alone = make_requests(1, seed=21, prompt_len=(12, 12), max_new_tokens=5)
    mixed = make_requests(5, seed=22, prompt_len=(3, 45))
    for i, req in enumerate(mixed):
        req.params = SamplingParams(max_new_tokens=2 + 3 * i, temperature=0.0)
    return [alone, mixed, *WAVES]


SCENARIO = scenario()


class LogprobCollector(Collector):
    """Also keeps the prompt log-probs (rows of the LM head beyond the requests' last tokens)."""

    def __init__(self) -> None:
        super().__init__()
        self.prompt_logprobs: dict[str, list[float | None]] = {}

    def __call__(self, outputs: list[TokenOut]) -> None:
        super().__call__(outputs)
        for out in outputs:
            self.prompt_logprobs.setdefault(out.rid, []).extend(out.input_logprobs or [])


def run_scenario(sched: Scheduler) -> LogprobCollector:
    col = LogprobCollector()
    sched.emit = col
    for wave in SCENARIO:
        for req in wave:
            sched.add_request(clone(req))
        run_until_idle(sched)
    assert not col.errors, col.errors
    assert_no_leak(sched)
    return col


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, LogprobCollector]:
    """A checkpoint and its outputs at EP 1."""
    path, _ = write_hf_checkpoint(request.param, tmp_path_factory.mktemp("dp") / request.param)
    sched, _ = make_tp_scheduler(path, 1, chunked_prefill_size=32)
    return path, run_scenario(sched)


def record_passes(sched: Scheduler) -> list[DpPass]:
    """The shape of every pass rank 0 runs from now on."""
    dp = sched.runner.dp
    assert dp is not None
    passes: list[DpPass] = []
    begin = dp.begin

    def recording(plan: DpPass) -> None:
        passes.append(plan)
        begin(plan)

    dp.begin = recording  # type: ignore[method-assign]
    return passes


@pytest.mark.parametrize(("dispatch", "overlap"), [("all-reduce", "off"), ("all-to-all", "on")])
def test_dp_attention_matches_one_rank(model: tuple[Path, LogprobCollector], dispatch: str, overlap: str) -> None:
    path, reference = model
    sched, _ = make_tp_scheduler(path, 2, chunked_prefill_size=32, ep_size=2, moe_dispatch=dispatch,
                                 enable_dp_attention=True, max_total_tokens=1024, overlap_schedule=overlap)
    passes = record_passes(sched)
    try:
        out = run_scenario(sched)
        kv = sched.kv
        assert isinstance(kv, DpKVCacheManager)
        per_rank = kv.rank_stats()
        stats = sched.stats()
    finally:
        pids = close_scheduler(sched)
    assert out.tokens == reference.tokens
    assert any(reference.prompt_logprobs.values())
    for rid, logprobs in reference.prompt_logprobs.items():  # (None: the first prompt token has none)
        got = out.prompt_logprobs[rid]
        assert [v is None for v in got] == [v is None for v in logprobs], rid
        assert [v for v in got if v is not None] == pytest.approx([v for v in logprobs if v is not None],
                                                                  rel=1e-4, abs=1e-4), rid
    assert any(n == 0 for p in passes for n in p.num_tokens), "no pass left a rank without requests"
    assert sum(1 for p in passes if min(p.num_tokens) > 0) > 3, "the ranks rarely ran together"
    # each rank's pool: every slot free or cached by its own requests, none held; both ranks served requests
    assert [s["free"] + s["evictable"] for s in per_rank] == [1024, 1024]
    assert all(s["evictable"] > 0 and s["live_requests"] == 0 for s in per_rank)
    assert stats["max_total_num_tokens"] == 2048 and stats["dp_attention_size"] == 2
    assert sched.runner.kv_pool.num_kv_heads == 2 and sched.runner.kv_pool.size == 1024  # whole KV heads per rank
    assert sum(stats["moe_rank_assignments"]) == sum(stats["moe_expert_assignments"]) > 0
    assert not any(pid_alive(pid) for pid in pids)


def test_a_rank_short_of_kv_retracts_its_own_requests(model: tuple[Path, LogprobCollector]) -> None:
    """A small pool per rank: decode runs out on a rank and retracts there; the tokens stay EP 1's."""
    path, _ = model
    reqs = make_requests(6, seed=31, prompt_len=(20, 30), max_new_tokens=24)
    reference, ref_col = make_tp_scheduler(path, 1)
    for req in reqs:
        reference.add_request(clone(req))
    run_until_idle(reference)
    sched, col = make_tp_scheduler(path, 2, ep_size=2, enable_dp_attention=True, max_total_tokens=120,
                                   disable_radix_cache=True)
    try:
        for req in reqs:
            sched.add_request(clone(req))
        run_until_idle(sched)
        retractions = sched.counters.num_retractions
        assert_no_leak(sched)
    finally:
        close_scheduler(sched)
    assert not col.errors and col.tokens == ref_col.tokens
    assert retractions > 0
