"""Speculative decoding through the scheduler on a tiny random model (CPU, in-process).

The reference is always the same requests without speculation: greedy output must be identical
token for token, whatever was proposed and however much of it was accepted.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from radixmesh.common.errors import RadixMeshError
from radixmesh.engine.request import Req
from radixmesh.engine.scheduler.core import Scheduler
from radixmesh.engine.speculative.decoder import SpecDecoder
from radixmesh.wire.sampling import SamplingParams

from .scheduler_factory import (
    VOCAB,
    Collector,
    assert_no_leak,
    clone,
    make_requests,
    make_scheduler,
    run_until_idle,
)
from .spec_factory import OracleProposer, draft_scheduler, oracle, write_model_dir

__all__ = ["oracle"]  # the fixture


def _run(sched: Scheduler, col: Collector, reqs: list[Req]) -> dict[str, list[int]]:
    for req in reqs:
        sched.add_request(clone(req))
    run_until_idle(sched)
    assert not col.errors, col.errors
    return {r.rid: col.tokens[r.rid] for r in reqs}


def _reference(reqs: list[Req], **overrides: Any) -> tuple[dict[str, list[int]], Collector]:
    sched, col = make_scheduler(**overrides)
    return _run(sched, col, reqs), col


def _repetitive(reqs: list[Req]) -> list[Req]:
    for req in reqs:  # prompts that repeat themselves, so n-gram lookups find matches
        req.origin_input_ids = req.origin_input_ids * 3
    return reqs


def _spec_stats(sched: Scheduler) -> dict[str, float | int]:
    return {k: v for k, v in sched.stats().items() if k.startswith("spec_")}


@pytest.mark.parametrize("backoff", [True, False], ids=["backoff", "always"])
def test_ngram_greedy_equals_plain_decoding(backoff: bool) -> None:
    reqs = _repetitive(make_requests(10, seed=3, max_new_tokens=24, prompt_len=(4, 12)))
    expected, _ = _reference(reqs)
    sched, col = make_scheduler(speculative_algorithm="ngram", speculative_ngram_min_match=1,
                                disable_speculative_backoff=not backoff)
    assert _run(sched, col, reqs) == expected
    stats = _spec_stats(sched)
    assert stats["spec_ngram_hits"] > 0 and stats["spec_num_draft_tokens"] > 0
    assert_no_leak(sched)


@pytest.mark.parametrize("overrides", [
    {},
    {"chunked_prefill_size": 8},
    {"max_total_tokens": 160, "max_running_requests": 8},  # retractions
    {"disable_radix_cache": True},
], ids=["default", "chunked", "tight-kv", "no-cache"])
def test_accepted_prefixes_of_every_length_keep_greedy_output(oracle: type[OracleProposer],
                                                             overrides: dict[str, Any]) -> None:
    reqs = make_requests(12, seed=5, shared_prefix_len=6, max_new_tokens=20)
    expected, _ = _reference(reqs, **overrides)
    oracle.reference = expected
    sched, col = make_scheduler(speculative_algorithm="oracle", speculative_num_draft_tokens=5,
                                disable_speculative_backoff=True, **overrides)
    assert _run(sched, col, reqs) == expected
    stats = _spec_stats(sched)
    assert 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"]
    assert 1.0 < stats["spec_accept_length"] <= 6.0
    assert sched.counters.num_forward_passes < sum(len(v) for v in expected.values())  # fewer passes than tokens
    assert_no_leak(sched)
    if "max_total_tokens" in overrides:
        assert sched.counters.num_retractions > 0


def test_draft_model_with_the_target_weights_accepts_every_draft(tmp_path: Path) -> None:
    reqs = make_requests(8, seed=7, max_new_tokens=21)
    expected, _ = _reference(reqs)
    sched, col = draft_scheduler(write_model_dir(tmp_path / "draft"), same_weights=True,
                                 speculative_num_draft_tokens=4, disable_speculative_backoff=True)
    assert _run(sched, col, reqs) == expected
    stats = _spec_stats(sched)
    assert stats["spec_accept_rate"] == 1.0 and stats["spec_accept_length"] > 4.0
    _assert_draft_clean(sched)


def test_random_draft_model_changes_nothing(tmp_path: Path) -> None:
    reqs = make_requests(8, seed=8, shared_prefix_len=5, max_new_tokens=16)
    expected, _ = _reference(reqs, chunked_prefill_size=8)
    sched, col = draft_scheduler(write_model_dir(tmp_path / "draft"), chunked_prefill_size=8,
                                 disable_speculative_backoff=True)
    assert _run(sched, col, reqs) == expected
    assert _spec_stats(sched)["spec_num_draft_tokens"] > 0
    # the draft's radix cache keeps the finished requests' tokens (evictable) until a flush
    assert _spec_stats(sched)["spec_draft_kv_cached_tokens"] > 0
    assert sched.flush_cache()
    _assert_draft_clean(sched)


def _assert_draft_clean(sched: Scheduler) -> None:
    assert_no_leak(sched)
    spec = sched.hooks.get(SpecDecoder)
    assert spec is not None
    assert spec.flush()
    draft_kv = spec.proposer.kv  # type: ignore[attr-defined]
    assert draft_kv.allocator.available_size() == draft_kv.capacity, "draft KV slots leaked"
    assert draft_kv.req_pool.available_size() == draft_kv.req_pool.size, "draft rows leaked"


def test_logprobs_and_top_logprobs_match_plain_decoding(oracle: type[OracleProposer]) -> None:
    reqs = make_requests(6, seed=9, max_new_tokens=14, logprobs=True, top_logprobs=3)
    plain, plain_col = make_scheduler()
    spec, spec_col = make_scheduler(speculative_algorithm="oracle", disable_speculative_backoff=True)
    got: dict[str, dict[str, list[Any]]] = {}
    for sched, col in ((plain, plain_col), (spec, spec_col)):
        logs: dict[str, list[Any]] = {r.rid: [] for r in reqs}
        tops: dict[str, list[Any]] = {r.rid: [] for r in reqs}

        def emit(outputs: list[Any], col: Collector = col, logs: dict = logs, tops: dict = tops) -> None:
            col(outputs)
            for out in outputs:
                logs[out.rid] += out.logprobs or []
                tops[out.rid] += out.top_logprobs or []

        sched.emit = emit
        if sched is spec:
            oracle.reference = {r.rid: plain_col.tokens[r.rid] for r in reqs}
        _run(sched, col, reqs)
        got["spec" if sched is spec else "plain"] = {"logprobs": list(logs.values()), "top": list(tops.values())}
    assert spec_col.tokens == plain_col.tokens
    for a, b in zip(got["plain"]["logprobs"], got["spec"]["logprobs"]):
        assert a == pytest.approx(b, abs=1e-4)
    for a, b in zip(got["plain"]["top"], got["spec"]["top"]):
        assert [[t for t, _ in row] for row in a] == [[t for t, _ in row] for row in b]
    assert _spec_stats(spec)["spec_num_accepted_tokens"] > 0


def test_stop_tokens_max_tokens_and_min_new_tokens_cut_accepted_drafts(oracle: type[OracleProposer]) -> None:
    base = make_requests(8, seed=11, max_new_tokens=18)
    free, _ = _reference(base)
    reqs = []
    for i, req in enumerate(base):  # stop at a token the free run emits mid-way; vary the budgets
        out = free[req.rid]
        params = SamplingParams(max_new_tokens=[1, 2, 3, 18][i % 4] if i < 4 else 18, temperature=0.0,
                                stop_token_ids=[out[len(out) // 2]] if i >= 4 else [],
                                min_new_tokens=len(out) // 2 + 2 if i >= 6 else 0)
        reqs.append(Req(rid=req.rid, origin_input_ids=req.origin_input_ids, params=params))
    expected, ref_col = _reference(reqs)
    oracle.reference = free  # drafts run past the stops and budgets
    sched, col = make_scheduler(speculative_algorithm="oracle", speculative_num_draft_tokens=6,
                                disable_speculative_backoff=True)
    assert _run(sched, col, reqs) == expected
    assert col.finish == ref_col.finish
    assert_no_leak(sched)


def test_penalties_follow_the_accepted_drafts(oracle: type[OracleProposer]) -> None:
    reqs = make_requests(6, seed=12, max_new_tokens=16, repetition_penalty=1.3, frequency_penalty=0.4,
                         presence_penalty=0.2, logit_bias={"7": 2.0})
    expected, _ = _reference(reqs)
    oracle.reference = expected
    sched, col = make_scheduler(speculative_algorithm="oracle", disable_speculative_backoff=True)
    assert _run(sched, col, reqs) == expected
    assert _spec_stats(sched)["spec_num_accepted_tokens"] > 0


def test_sampled_requests_with_a_seed_are_reproducible(tmp_path: Path) -> None:
    reqs = make_requests(4, seed=13, max_new_tokens=12)
    for req in reqs:
        req.params = SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.9, seed=7)
    runs = []
    for _ in range(2):
        sched, col = draft_scheduler(write_model_dir(tmp_path / "draft"), same_weights=True,
                                     disable_speculative_backoff=True)
        runs.append(_run(sched, col, reqs))
        assert _spec_stats(sched)["spec_accept_rate"] > 0.5  # same weights: drafts mostly accepted
    assert runs[0] == runs[1]
    assert all(len(v) == 12 for v in runs[0].values())


def test_backoff_stops_drafting_that_never_pays(tmp_path: Path) -> None:
    reqs = make_requests(2, seed=14, max_new_tokens=60)
    expected, _ = _reference(reqs)
    sched, col = draft_scheduler(write_model_dir(tmp_path / "draft"))  # random draft: nothing accepted
    assert _run(sched, col, reqs) == expected
    stats = _spec_stats(sched)
    # a handful of verifications, then rests with ever rarer one-draft probes
    assert stats["spec_num_verify_passes"] < 25, stats
    assert sched.counters.num_forward_passes >= 60


@pytest.mark.parametrize("overrides, message", [
    ({"speculative_algorithm": "medusa"}, "speculative_algorithm must be one of"),
    ({"speculative_algorithm": "draft"}, "--speculative-algorithm draft needs --speculative-draft-model"),
    ({"speculative_draft_model": "x"}, "--speculative-draft-model goes with"),
    ({"speculative_algorithm": "ngram", "speculative_num_draft_tokens": 0}, "speculative_num_draft_tokens"),
    ({"speculative_algorithm": "ngram", "speculative_ngram_min_match": 5, "speculative_ngram_max_match": 3},
     "speculative_ngram_min_match"),
    ({"speculative_algorithm": "draft", "speculative_draft_model": "x", "speculative_draft_load_format": "onnx"},
     "speculative_draft_load_format"),
])
def test_bad_speculative_options_are_refused(overrides: dict[str, Any], message: str) -> None:
    from radixmesh.engine.config import EngineConfig

    with pytest.raises(RadixMeshError, match=message):
        EngineConfig(**overrides)


def test_draft_with_another_vocabulary_fails_at_start(tmp_path: Path) -> None:
    with pytest.raises(RadixMeshError, match=r"vocabulary of 64 tokens and the target 101"):
        draft_scheduler(write_model_dir(tmp_path / "small-vocab", vocab_size=64))
    with pytest.raises(RadixMeshError, match=r"reads 64 positions"):
        draft_scheduler(write_model_dir(tmp_path / "short", max_position_embeddings=64))


@pytest.mark.parametrize("algorithm", ["oracle", "ngram", "draft"])
def test_overlap_scheduler_runs_ahead_only_between_plain_steps(oracle: type[OracleProposer], tmp_path: Path,
                                                              algorithm: str) -> None:
    reqs = _repetitive(make_requests(8, seed=15, max_new_tokens=30, prompt_len=(4, 12)))
    expected, _ = _reference(reqs, overlap_schedule="on")
    oracle.reference = expected
    overrides: dict[str, Any] = dict(overlap_schedule="on", speculative_ngram_min_match=1)
    if algorithm == "draft":  # a random draft: rejected, so the back-off soon decodes plainly (overlapped)
        sched, col = draft_scheduler(write_model_dir(tmp_path / "draft"), **overrides)
    else:
        sched, col = make_scheduler(speculative_algorithm=algorithm, **overrides)
    assert sched.config.overlap_enabled
    assert _run(sched, col, reqs) == expected
    stats = _spec_stats(sched)
    assert stats["spec_num_verify_passes"] > 0
    assert sched.counters.num_forward_passes > stats["spec_num_verify_passes"]  # plain steps too
    if algorithm == "draft":
        assert stats["spec_num_overlapped_steps"] > 10  # built while the previous step ran
    assert_no_leak(sched)


def test_vocab_constant_matches_the_tiny_model() -> None:
    assert VOCAB == 101 and torch.get_default_dtype() == torch.float32


def test_speculative_series_on_the_worker_and_serve() -> None:
    from prometheus_client import generate_latest

    from radixmesh.gateway.metrics import GatewayMetrics
    from radixmesh.worker import metrics as worker_metrics

    stats = {"spec_num_draft_tokens": 40, "spec_num_accepted_tokens": 30, "spec_accept_length": 2.5}
    serve = GatewayMetrics("m", "serve")
    serve.update_engine(stats, 0)
    text = serve.render().decode()
    assert 'radixmesh_spec_draft_tokens_total{service="serve"} 40.0' in text
    assert 'radixmesh_spec_accept_length{service="serve"} 2.5' in text
    worker_metrics.ENGINE_STATS.update(stats)
    text = generate_latest(worker_metrics.REGISTRY).decode()
    assert "radixmesh_spec_accepted_tokens_total 30.0" in text
    assert GatewayMetrics("m", "gateway").speculative is None  # a gateway sums nothing of the kind
    worker_metrics.ENGINE_STATS.update({})


def test_abort_while_a_verification_is_in_flight_frees_its_slots(oracle: type[OracleProposer], tmp_path: Path) -> None:
    from radixmesh.engine.speculative.verify_batch import VerifyBatch

    reqs = make_requests(3, seed=16, max_new_tokens=30)
    expected, _ = _reference(reqs)
    oracle.reference = expected
    for algorithm in ("oracle", "draft"):
        overrides: dict[str, Any] = dict(overlap_schedule="on", disable_speculative_backoff=True)
        if algorithm == "draft":
            sched, col = draft_scheduler(write_model_dir(tmp_path / "draft"), same_weights=True, **overrides)
        else:
            sched, col = make_scheduler(speculative_algorithm="oracle", **overrides)
        for req in reqs:
            sched.add_request(clone(req))
        while not (sched.in_flight is not None and isinstance(sched.in_flight.batch, VerifyBatch)):
            sched.step()
        sched.abort(reqs[0].rid)  # its verify pass was launched, not yet read back
        run_until_idle(sched)
        assert col.finish[reqs[0].rid] == "abort"
        assert {r.rid: col.tokens[r.rid] for r in reqs[1:]} == {r.rid: expected[r.rid] for r in reqs[1:]}
        assert_no_leak(sched)
        spec = sched.hooks.get(SpecDecoder)
        assert spec is not None and not spec.pending
        if algorithm == "draft":
            _assert_draft_clean(sched)
