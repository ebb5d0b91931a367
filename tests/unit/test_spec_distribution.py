"""Sampling with speculation follows the target distribution (chi-square on a small random model).

A tiny model with an 8-token vocabulary; each request samples 3 tokens from one prompt. The exact
distributions of the 2nd and 3rd tokens (drawn by verify passes) and of the pair come from the
model's own log-probs; 3,000 speculative samples must fit them. A verifier that accepts
every draft must not (the test has power).
"""

from __future__ import annotations

import itertools
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from radixmesh.engine.request import Req
from radixmesh.engine.sampling.batch_info import SamplingBatchInfo
from radixmesh.engine.scheduler.core import Scheduler
from radixmesh.engine.speculative import rejection
from radixmesh.wire.sampling import SamplingParams

from .scheduler_factory import Collector, make_scheduler, run_until_idle, tiny_model_config
from .spec_factory import draft_scheduler, write_model_dir
from .stats_helpers import chi_square_pvalue

V = 8
PROMPT = [6, 1, 6, 3, 6, 1, 6, 3]
"""Repetitive, in tokens the model likes: n-gram drafts are often (not always) accepted."""
NUM_SAMPLES = 3000
SETTINGS: dict[str, Any] = dict(max_total_tokens=NUM_SAMPLES * 16, max_running_requests=NUM_SAMPLES,
                                chunked_prefill_size=-1, max_prefill_tokens=NUM_SAMPLES * 12)
PVALUE_FLOOR = 1e-4
"""Twelve p-values are checked (fixed seeds, so the outcome is reproducible); a broken verifier scores < 1e-6."""
PARAMS = {"t1": dict(temperature=1.0), "t07-topk5-topp09": dict(temperature=0.7, top_k=5, top_p=0.9)}


def _model() -> Any:
    return tiny_model_config(vocab_size=V)


def _step_probs(sched: Scheduler, col: Collector, prefixes: list[list[int]], params: dict[str, Any]) -> torch.Tensor:
    """[len(prefixes), V] the sampling distribution after each prefix of PROMPT (from the model's log-probs)."""
    logs: dict[str, list[Any]] = {}

    def emit(outputs: list[Any]) -> None:
        col(outputs)
        for out in outputs:
            logs.setdefault(out.rid, []).extend(out.top_logprobs or [])

    sched.emit = emit
    rids = []
    for prefix in prefixes:
        rid = uuid.uuid4().hex[:8]
        rids.append(rid)
        sched.add_request(Req(rid=rid, origin_input_ids=PROMPT + prefix,
                              params=SamplingParams(max_new_tokens=1, temperature=0.0, top_logprobs=V)))
    run_until_idle(sched)
    logprobs = torch.full((len(prefixes), V), float("-inf"))
    for row, rid in enumerate(rids):
        for token, value in logs[rid][0]:
            logprobs[row, token] = value
    sp = SamplingParams(max_new_tokens=3, **params)
    info = SamplingBatchInfo.build([sp] * len(prefixes), [PROMPT] * len(prefixes), [[]] * len(prefixes), (), V, "cpu")
    return rejection.target_probs(logprobs, info)  # temperature and truncation as the sampler applies them


def _exact(params: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact P(t2), P(t3) and P(t2, t3) of 3-token samples."""
    sched, col = make_scheduler(_model(), **SETTINGS)
    p1 = _step_probs(sched, col, [[]], params)[0]
    p2 = _step_probs(sched, col, [[a] for a in range(V)], params)  # [a, b]
    p3 = _step_probs(sched, col, [[a, b] for a, b in itertools.product(range(V), repeat=2)], params).view(V, V, V)
    joint = p1[:, None, None] * p2[:, :, None] * p3  # [a, b, c]
    pair = joint.sum(0)  # [b, c]
    return pair.sum(1), pair.sum(0), pair.reshape(-1)


def _samples(sched: Scheduler, col: Collector, params: dict[str, Any]) -> torch.Tensor:
    rids = []
    for _ in range(NUM_SAMPLES):
        rid = uuid.uuid4().hex[:10]
        rids.append(rid)
        sched.add_request(Req(rid=rid, origin_input_ids=list(PROMPT),
                              params=SamplingParams(max_new_tokens=3, ignore_eos=True, **params)))
    run_until_idle(sched)
    out = torch.tensor([col.tokens[rid] for rid in rids])
    assert out.shape == (NUM_SAMPLES, 3)
    return out


def _fit(samples: torch.Tensor, exact: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> list[float]:
    p_t2, p_t3, p_pair = exact
    t2, t3 = samples[:, 1], samples[:, 2]
    return [chi_square_pvalue(torch.bincount(t2, minlength=V).float(), p_t2),
            chi_square_pvalue(torch.bincount(t3, minlength=V).float(), p_t3),
            chi_square_pvalue(torch.bincount(t2 * V + t3, minlength=V * V).float(), p_pair)]


def _speculative(kind: str, tmp_path: Path) -> tuple[Scheduler, Collector]:
    common: dict[str, Any] = dict(SETTINGS, speculative_num_draft_tokens=2, disable_speculative_backoff=True)
    if kind == "ngram":
        return make_scheduler(_model(), speculative_algorithm="ngram", speculative_ngram_min_match=1, **common)
    return draft_scheduler(write_model_dir(tmp_path / "draft", vocab_size=V), model_config=_model(), **common)


@pytest.mark.parametrize("params_id", list(PARAMS))
@pytest.mark.parametrize("kind", ["ngram", "draft"])
def test_speculative_samples_follow_the_target_distribution(kind: str, params_id: str, tmp_path: Path) -> None:
    params = PARAMS[params_id]
    exact = _exact(params)
    sched, col = _speculative(kind, tmp_path)
    pvalues = _fit(_samples(sched, col, params), exact)
    stats = sched.stats()
    assert stats["spec_num_draft_tokens"] > NUM_SAMPLES // 2  # verify passes drew most of these tokens
    assert 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"]  # both branches ran
    assert min(pvalues) > PVALUE_FLOOR, pvalues


def test_a_verifier_that_accepts_every_draft_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def accept_all(p: torch.Tensor, q: Any, rows: rejection.ChainRows, uniforms: torch.Tensor) -> torch.Tensor:
        return rows.draft_next >= 0

    monkeypatch.setattr("radixmesh.engine.speculative.verifier.sampled_accept", accept_all)
    params = PARAMS["t1"]
    exact = _exact(params)
    sched, col = _speculative("draft", tmp_path)
    assert min(_fit(_samples(sched, col, params), exact)) < 1e-6
