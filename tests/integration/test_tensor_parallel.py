"""Tensor parallelism on the CPU (gloo): rank processes give the same greedy tokens as one process.

A tiny random checkpoint with 8 heads over 2 KV heads runs at TP 2 and TP 4 (KV heads replicated,
vocabulary padded); the default model (9 heads, 3 KV heads) at TP 3. Every scenario mixes what
the scheduler does around the model: batches, chunked prefill, radix-cache hits, overlap
scheduling, structured outputs and prefill/decode KV transfer between TP sizes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from radixmesh.common.errors import ErrorCode, RadixMeshError
from radixmesh.engine.disagg.handler import DisaggHandler
from radixmesh.engine.request import Req
from radixmesh.engine.scheduler.core import Scheduler
from radixmesh.wire.sampling import SamplingParams

from ..unit.scheduler_factory import Collector, assert_no_leak, clone, make_requests, run_until_idle
from ..unit.test_disagg import Side, transfer
from ..unit.tp_factory import close_scheduler, make_tp_scheduler, pid_alive, write_tiny_checkpoint

pytestmark = [pytest.mark.integration]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tp") / "tiny")


def waves() -> list[list[Req]]:
    """A batch sharing a 40-token prefix with prompts up to 60 tokens (chunks of 32), then a second
    batch continuing some of those prompts (radix-cache hits) and asking for prompt log-probs."""
    first = make_requests(4, seed=3, max_new_tokens=6, shared_prefix_len=40, prompt_len=(3, 20))
    second = [Req(rid=f"{r.rid}-again", origin_input_ids=[*r.origin_input_ids, 5, 6, 7], params=r.params)
              for r in first[:2]]
    second += make_requests(1, seed=4, max_new_tokens=6, prompt_len=(50, 50))
    second += make_requests(1, seed=5, max_new_tokens=4, prompt_len=(20, 20), logprobs=True, top_logprobs=2,
                            logprob_start_len=0)  # prompt log-probs: the LM head returns extra rows
    return [first, second]


WAVES = waves()  # request ids are random: one set for every run


def run_waves(sched: Scheduler, col: Collector, batches: list[list[Req]]) -> tuple[dict, dict]:
    for batch in batches:
        for req in batch:
            sched.add_request(clone(req))
        run_until_idle(sched)
    assert not col.errors, col.errors
    assert_no_leak(sched)
    return col.tokens, col.cached


@pytest.fixture(scope="module")
def tiny_reference(tiny_dir: Path) -> tuple[dict, dict]:
    sched, col = make_tp_scheduler(tiny_dir, 1, chunked_prefill_size=32)
    return run_waves(sched, col, WAVES)


@pytest.mark.parametrize(("tp_size", "overlap"), [(2, "off"), (4, "off"), (2, "on")])
def test_random_8_head_model_matches_tp1(tiny_dir: Path, tiny_reference: tuple[dict, dict], tp_size: int,
                                         overlap: str) -> None:
    sched, col = make_tp_scheduler(tiny_dir, tp_size, chunked_prefill_size=32, overlap_schedule=overlap)
    try:
        tokens, cached = run_waves(sched, col, WAVES)
        assert sched.runner.kv_pool.num_kv_heads == 1  # 2 KV heads: split over 2 ranks, replicated over 4
        assert sched.runner.layout.kv_replicated == (tp_size == 4)
    finally:
        pids = close_scheduler(sched)
    assert tokens == tiny_reference[0]
    assert cached == tiny_reference[1] and max(cached.values()) >= 40  # the radix cache served prefixes
    assert len(pids) == tp_size - 1 and not any(pid_alive(pid) for pid in pids)


def _side(sched: Scheduler, col: Collector) -> Side:
    exports: list[Any] = []
    replies: dict[str, dict[str, Any]] = {}
    handler = DisaggHandler(sched, exports.append, lambda query_id, result: replies.__setitem__(query_id, result))
    side = Side(sched, col, handler, exports, replies)
    handler.reservations.clock = handler.exports.clock = side.clock
    return side


@pytest.fixture
def tp1_and_tp2(tiny_dir: Path) -> Iterator[tuple[Side, Side]]:
    one = _side(*make_tp_scheduler(tiny_dir, 1))
    two = _side(*make_tp_scheduler(tiny_dir, 2))
    try:
        yield one, two
    finally:
        close_scheduler(two.sched)


def test_kv_transfer_between_tp_sizes_equals_unified(tp1_and_tp2: tuple[Side, Side]) -> None:
    """Whole-model KV on the wire: a TP 2 prefill feeds a TP 1 decode and the other way round."""
    one, two = tp1_and_tp2
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    reqs = make_requests(2, seed=11, prompt_len=(20, 40))
    unified = _side(*make_tp_scheduler(one.sched.config.model, 1))
    for req in reqs:
        unified.sched.add_request(Req(rid=req.rid, origin_input_ids=req.origin_input_ids, params=params))
    run_until_idle(unified.sched)
    transfer(two, one, "a", reqs[0].origin_input_ids, params)  # prefill at TP 2, decode at TP 1
    transfer(one, two, "b", reqs[1].origin_input_ids, params)  # prefill at TP 1, decode at TP 2
    assert one.out.tokens["a"] == unified.out.tokens[reqs[0].rid]
    assert two.out.tokens["b"] == unified.out.tokens[reqs[1].rid]
    for side in (one, two):
        assert side.handler.stats()["num_fallbacks"] == 0
        assert_no_leak(side.sched)


@pytest.mark.slow
def test_default_model_tp3_matches_tp1() -> None:
    """9 heads and 3 KV heads over 3 ranks, real weights in fp32: batched, chunked, cached and
    regex-constrained requests give TP 1's greedy tokens."""
    from radixmesh.engine.hf_tokenizer import load_tokenizer
    from radixmesh.engine.loader import ensure_default_model

    tok = load_tokenizer(ensure_default_model(progress=False))
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    texts = ["The capital of France is", "def fibonacci(n):",
             "Once upon a time, in a small village by the sea, there lived an old fisherman who"]
    first = [Req(rid=f"r{i}", origin_input_ids=tok.encode(t), params=greedy) for i, t in enumerate(texts)]
    first.append(Req(rid="regex", origin_input_ids=tok.encode("Is the sky blue? Answer:"),
                     params=SamplingParams(max_new_tokens=8, temperature=0.0, regex=r" (yes|no)\.")))
    second = [Req(rid="again", origin_input_ids=first[2].origin_input_ids + tok.encode(" and"), params=greedy)]
    results = []
    for tp_size in (1, 3):
        sched, col = make_tp_scheduler(None, tp_size, tokenizer=tok, chunked_prefill_size=8)
        try:
            results.append(run_waves(sched, col, [first, second]))
        finally:
            close_scheduler(sched)
    (tokens1, cached1), (tokens3, cached3) = results
    assert tokens3 == tokens1
    assert cached3 == cached1 and cached3["again"] >= 16
    assert tok.decode(tokens3["regex"], skip_special_tokens=True) in (" yes.", " no.")
    assert "Paris" in tok.decode(tokens3["r0"])


@pytest.mark.slow
def test_engine_tp2_serves_through_its_scheduler_process_and_stops_its_ranks(tiny_dir: Path) -> None:
    from radixmesh.engine.engine import Engine

    ids = [[3, 14, 15, 92, 65], [35, 89, 79, 32, 38, 46, 26]]
    outputs = []
    for tp_size in (1, 2):
        with Engine(str(tiny_dir), tp_size=tp_size, device="cpu", dtype="float32", max_total_tokens=2048) as engine:
            result = engine.generate(ids, {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True})
            assert isinstance(result, list)
            outputs.append([r["output_ids"] for r in result])
            scheduler_pid = engine.client._proc.pid
            ranks = _children(scheduler_pid)
            assert len(ranks) == tp_size - 1
        deadline = time.monotonic() + 10
        while any(pid_alive(pid) for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(pid_alive(pid) for pid in ranks)
    assert outputs[0] == outputs[1]


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().split(")")[-1].split()
        except OSError:
            continue
        cmdline = (stat.parent / "cmdline").read_bytes() if (stat.parent / "cmdline").exists() else b""
        if int(fields[1]) == pid and b"distributed.follower" in cmdline:
            found.append(int(stat.parent.name))
    return found


def test_engine_refuses_a_tp_size_that_does_not_split_the_heads() -> None:
    from radixmesh.engine.engine import Engine

    with pytest.raises(RadixMeshError) as info:
        Engine(tp_size=2, device="cpu")
    assert info.value.code is ErrorCode.INVALID_ARGUMENT
    assert "9 attention heads" in info.value.message and "--tp-size 2" in info.value.message
