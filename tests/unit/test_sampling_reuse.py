"""Reusing the last step's SamplingBatchInfo: the same tokens and log-probs as a fresh build
every step, through joins, finishes, aborts and per-request sampling settings (CPU)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import torch

from radixmesh.engine.request import Req
from radixmesh.engine.sampling.batch_info import SamplingBatchInfo, SamplingInfoCache
from radixmesh.wire.messages import TokenOut
from radixmesh.wire.sampling import SamplingParams

from .scheduler_factory import VOCAB, assert_no_leak, make_scheduler

EOS = 7


class FullCollector:
    """Every field a client sees, per request."""

    def __init__(self) -> None:
        self.outputs: dict[str, list[Any]] = {}

    def __call__(self, outputs: list[TokenOut]) -> None:
        for out in outputs:
            self.outputs.setdefault(out.rid, []).append(
                (out.token_ids, out.logprobs, out.top_logprobs, out.finish_reason, out.input_logprobs))


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(max_new_tokens=14, temperature=0.0),
        SamplingParams(max_new_tokens=9, temperature=0.9, top_p=0.8),
        SamplingParams(max_new_tokens=12, temperature=1.1, top_k=5, seed=11),
        SamplingParams(max_new_tokens=6, temperature=0.7, min_p=0.05, logprobs=True, top_logprobs=3),
        SamplingParams(max_new_tokens=10, temperature=0.0, logit_bias={3: 2.5}, logprobs=True),
        SamplingParams(max_new_tokens=11, temperature=1.0, min_new_tokens=4, seed=5),
        SamplingParams(max_new_tokens=8, temperature=0.8, stop_token_ids=(9,), seed=3, top_logprobs=2),
        SamplingParams(max_new_tokens=7, temperature=1.0, frequency_penalty=0.4),
        SamplingParams(max_new_tokens=13, temperature=0.6, seed=21, logprob_start_len=1),
    ]


def _requests() -> list[Req]:
    gen = torch.Generator().manual_seed(5)
    reqs = []
    for i, params in enumerate(_params()):
        ids = torch.randint(0, VOCAB, (4 + 3 * i,), generator=gen).tolist()
        reqs.append(Req(rid=f"q{i}-{uuid.uuid4().hex[:4]}", origin_input_ids=ids, params=params))
    return reqs


def _run(reuse: bool, overlap: str) -> tuple[dict[str, list[Any]], SamplingInfoCache]:
    from radixmesh.engine.model_config import ModelConfig

    from .scheduler_factory import tiny_model_config

    mc: ModelConfig = tiny_model_config(eos_token_ids=(EOS,))
    sched, _ = make_scheduler(mc, overlap_schedule=overlap, random_seed=1234)
    collector = FullCollector()
    sched.emit = collector
    cache = sched.runner.sampling_cache
    cache.enabled = reuse
    reqs = _requests()
    joins = {0: reqs[:3], 6: reqs[3:5], 14: reqs[5:7], 24: reqs[7:]}  # step -> requests that arrive
    steps = 0
    while steps < 400 and (sched.has_work or any(k >= steps for k in joins)):
        for req in joins.get(steps, []):
            sched.add_request(Req(rid=req.rid.split("-")[0], origin_input_ids=list(req.origin_input_ids),
                                  params=req.params))
        if steps == 5:
            sched.abort("q1")  # leaves mid-decode
        sched.step()
        steps += 1
    assert not sched.has_work, "the workload did not finish"
    assert_no_leak(sched)
    return collector.outputs, cache


@pytest.mark.parametrize("overlap", ["on", "off"])
def test_reused_sampling_info_gives_the_tokens_of_a_fresh_build(overlap: str) -> None:
    fresh, fresh_cache = _run(reuse=False, overlap=overlap)
    reused, cache = _run(reuse=True, overlap=overlap)
    assert fresh_cache.num_reuses == 0
    assert cache.num_reuses > 10, "the workload never reused an info: the comparison proves nothing"
    assert cache.num_builds < fresh_cache.num_builds
    assert reused == fresh
    assert set(fresh) == {f"q{i}" for i in range(len(_params()))}
    finishes = {rid: chunks[-1][3] for rid, chunks in fresh.items()}
    assert finishes["q1"] == "abort" and finishes["q0"] == "length"
    assert any(chunk[2] for chunk in fresh["q3"]), "top log-probs reached the client"


def _info(params: list[SamplingParams], outputs: list[list[int]] | None = None) -> SamplingBatchInfo:
    outputs = outputs or [[] for _ in params]
    return SamplingBatchInfo.build(params, [[1, 2] for _ in params], outputs, [EOS], VOCAB, "cpu")


def test_cache_keeps_only_step_invariant_infos_for_the_same_rows() -> None:
    cache = SamplingInfoCache()
    a, b = object(), object()
    plain = [SamplingParams(temperature=0.5), SamplingParams(temperature=0.0)]
    first = cache.get([a, b], [1, 1], lambda: _info(plain))
    again = cache.get([a, b], [2, 3], lambda: _info(plain))
    assert again is first and again.output_lens == [2, 3] and cache.num_reuses == 1
    assert cache.get([b, a], [2, 3], lambda: _info(plain)) is not first, "same requests, other order"
    assert cache.get([a], [2], lambda: _info(plain[:1])) is not first
    penalised, c = [SamplingParams(temperature=0.5, presence_penalty=0.5)], object()
    built = [cache.get([c], [1], lambda: _info(penalised, [[3]])) for _ in range(2)]
    assert built[0] is not built[1], "penalties depend on the tokens generated so far"
    banned = [SamplingParams(min_new_tokens=5)]
    assert not _info(banned).is_step_invariant and _info(plain).is_step_invariant


def test_reused_info_drops_the_last_steps_grammar_mask() -> None:
    from radixmesh.engine.grammar.vocab_mask import VocabMask

    cache = SamplingInfoCache()
    row = object()
    info = cache.get([row], [0], lambda: _info([SamplingParams()]))
    info.vocab_mask = VocabMask(torch.zeros(1, 4, dtype=torch.int32), [0])
    assert cache.get([row], [1], lambda: _info([SamplingParams()])).vocab_mask is None


def test_all_greedy_batches_build_no_row_tensors() -> None:
    info = _info([SamplingParams(temperature=0.0), SamplingParams(top_k=1)])
    assert info.all_greedy and info.temperatures is None and info.is_greedy is None
    mixed = _info([SamplingParams(temperature=0.0), SamplingParams(temperature=0.5, top_k=4)])
    assert mixed.is_greedy is not None and mixed.is_greedy.tolist() == [True, False]
    assert mixed.top_ks is not None and mixed.top_ks.tolist() == [VOCAB, 4]
