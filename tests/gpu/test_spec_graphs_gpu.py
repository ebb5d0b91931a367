"""Speculative decoding's CUDA graphs against their eager runs (issue 47): the draft loop (a cycle's draft decode
steps in one graph) and the draft model's catch-up graphs draft what their eager runs and pass-by-pass drafting
draft, and EAGLE heads read the target features its decode and verify graphs store (an identity head drafts the
target's own greedy token), with greedy output equal to plain decoding (float32)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from radixmesh.engine.request import Req
from radixmesh.engine.scheduler.core import Scheduler
from radixmesh.engine.speculative.decoder import SpecDecoder
from radixmesh.engine.speculative.draft_loop import DraftLoop
from radixmesh.engine.speculative.draft_model import DraftModelProposer
from radixmesh.engine.speculative.verify_graphs import VerifyGraphRunner
from tests.unit.eagle_factory import write_eagle, write_eagle3
from tests.unit.scheduler_factory import VOCAB, clone, make_requests, make_scheduler, run_until_idle, tiny_model_config
from tests.unit.spec_factory import draft_values, write_model_dir

pytestmark = [pytest.mark.gpu]

TARGET = dict(head_dim=16)  # the factory's tiny target (hidden 32), with heads the Triton kernels take
HEADS = (2, 1, 16)
GPU: dict[str, Any] = dict(device="cuda", attention_backend="triton", dtype="float32", max_total_tokens=8192,
                           max_running_requests=16, cuda_graph_max_bs=16, disable_speculative_backoff=True,
                           speculative_num_draft_tokens=4)


def _requests() -> list[Req]:
    return make_requests(10, seed=41, shared_prefix_len=6, max_new_tokens=30, prompt_len=(4, 30))


def _plain(reqs: list[Req]) -> dict[str, list[int]]:
    sched, col = make_scheduler(tiny_model_config(**TARGET), **{k: v for k, v in GPU.items() if "spec" not in k})
    assert sched.runner.graph_runner is not None
    return _finish(sched, col, reqs)


def _finish(sched: Scheduler, col: Any, reqs: list[Req]) -> dict[str, list[int]]:
    for req in reqs:
        sched.add_request(clone(req))
    run_until_idle(sched)
    assert not col.errors, col.errors
    return {r.rid: col.tokens[r.rid] for r in reqs}


def _speculate(reqs: list[Req], loop: str, **overrides: Any) -> tuple[Scheduler, dict[str, list[int]], list[Any]]:
    """`loop`: "graph" (captured, the default on CUDA), "eager" (the same pass run eagerly) or "off" (pass by pass).
    Returns the scheduler, the outputs and every proposal as (the request's last token, its drafts)."""
    sched, col = make_scheduler(tiny_model_config(**TARGET), **{**GPU, **overrides})
    spec = sched.hooks.get(SpecDecoder)
    assert spec is not None and isinstance(spec.proposer, DraftModelProposer)
    proposer = spec.proposer
    if overrides.get("speculative_algorithm") == "draft":
        proposer.runner.model.load_state_dict(sched.runner.model.state_dict())
    assert proposer.loop is not None and proposer.loop.graphs, "no draft-loop graphs were captured"
    if loop == "eager":
        proposer.loop = DraftLoop(proposer.runner, proposer.loop.max_steps, proposer.loop.max_bs, proposer._to_target,
                                  proposer._between_steps, capture=False)
        if proposer.catch_up_graphs is not None:
            tokens = proposer._catch_up_graph_tokens(sched.config)
            proposer.catch_up_graphs = VerifyGraphRunner(proposer.runner, tokens - 1, proposer.catch_up_graphs.max_bs,
                                                         capture=False)
    elif loop == "off":
        proposer.loop = proposer.catch_up_graphs = None
    seen: list[Any] = []
    propose = proposer.propose

    def spy(batch: list[Req], limits: list[int]) -> Any:
        proposal = propose(batch, limits)
        seen.extend((req.all_ids[-1], d) for req, d in zip(batch, draft_values(proposal)) if d)
        return proposal

    proposer.propose = spy  # type: ignore[method-assign]
    return sched, _finish(sched, col, reqs), seen


def _head(tmp_path: Path, algorithm: str, identity: bool = False) -> Path:
    if algorithm == "draft":
        return write_model_dir(tmp_path / "draft", head_dim=16)
    if algorithm == "eagle":
        return write_eagle(tmp_path / "eagle", seed=7, identity=identity, heads=HEADS)
    target = make_scheduler(tiny_model_config(**TARGET))[0].runner.model if identity else None
    return write_eagle3(tmp_path / "eagle3", seed=8, identity_of=target, draft_vocab=VOCAB if identity else 64,
                        heads=HEADS)


def _settings(tmp_path: Path, algorithm: str, identity: bool = False) -> dict[str, Any]:
    extra = {"speculative_draft_load_format": "dummy"} if algorithm == "draft" else {}
    return {"speculative_algorithm": algorithm, "speculative_draft_model": str(_head(tmp_path, algorithm, identity)),
            **extra}


@pytest.mark.parametrize("algorithm", ["draft", "eagle", "eagle3"])
def test_draft_loop_graphs_draft_what_eager_and_pass_by_pass_draft(tmp_path: Path, algorithm: str) -> None:
    reqs = _requests()
    expected = _plain(reqs)
    settings = _settings(tmp_path, algorithm)
    runs = {mode: _speculate(reqs, mode, **settings) for mode in ("graph", "eager", "off")}
    for mode, (_, outputs, _) in runs.items():
        assert outputs == expected, mode
    graph_sched, _, graph_drafts = runs["graph"]
    assert graph_drafts == runs["eager"][2] == runs["off"][2]
    assert any(len(d) == 4 for _, d in graph_drafts)
    loop = graph_sched.hooks.get(SpecDecoder).proposer.loop  # type: ignore[union-attr]
    assert loop is not None and loop.num_runs > 0
    if algorithm == "draft":  # the target's own weights: every draft accepted in float32
        assert graph_sched.stats()["spec_accept_rate"] > 0.99
    catch_up = graph_sched.hooks.get(SpecDecoder).proposer.catch_up_graphs  # type: ignore[union-attr]
    assert catch_up is not None and catch_up.num_replays > 0  # short catch-ups replayed their graphs


@pytest.mark.parametrize("algorithm", ["eagle", "eagle3"])
def test_identity_heads_read_the_features_the_target_graphs_store(tmp_path: Path, algorithm: str) -> None:
    """Features come from the target's prefill (eager), its decode graphs (none here: every step verifies) and its
    verify graphs; an identity head's drafts are the request's last token exactly when they line up."""
    reqs = _requests()
    expected = _plain(reqs)
    sched, outputs, seen = _speculate(reqs, "graph", **_settings(tmp_path, algorithm, identity=True))
    assert outputs == expected
    assert len(seen) > 20 and all(drafts == [last] * len(drafts) for last, drafts in seen), seen[:4]
    verify_graphs = sched.hooks.get(SpecDecoder).verifier.graphs  # type: ignore[union-attr]
    assert verify_graphs is not None and verify_graphs.num_replays > 0


@pytest.mark.parametrize("algorithm", ["eagle", "eagle3"])
def test_tree_drafts_on_the_gpu_are_plain_decoding(tmp_path: Path, algorithm: str) -> None:
    """EAGLE trees (top-4, 3 steps, 8 tokens) on CUDA: steps 2..3 replay the tree loop's graphs, catch-ups the head's
    extend graphs, verification the tree verify graphs (a staged tree mask); a head that mostly agrees with the
    target (EAGLE) gets drafts accepted along the trees; greedy output is plain decoding's (float32)."""
    from tests.unit.eagle_factory import make_bigram_like

    scale = 0.003 if algorithm == "eagle" else 1.0
    head = (write_eagle(tmp_path / "eagle", seed=7, heads=HEADS, bigram=True) if algorithm == "eagle"
            else _head(tmp_path, algorithm))
    reqs = _requests()[:6]
    settings = {**GPU, "cuda_graph_max_bs": 32}
    plain, col = make_scheduler(tiny_model_config(**TARGET), **{k: v for k, v in settings.items() if "spec" not in k})
    make_bigram_like(plain.runner.model, scale)
    expected = _finish(plain, col, reqs)
    sched, col = make_scheduler(tiny_model_config(**TARGET), **{**settings, "speculative_algorithm": algorithm,
                                                              "speculative_draft_model": str(head),
                                                              "speculative_eagle_topk": 4, "speculative_num_steps": 3,
                                                              "speculative_num_draft_tokens": 8})
    make_bigram_like(sched.runner.model, scale)
    spec = sched.hooks.get(SpecDecoder)
    assert spec is not None and isinstance(spec.proposer, DraftModelProposer)
    tree = spec.proposer.tree  # type: ignore[attr-defined]
    assert tree is not None and tree.loop is not None and tree.loop.graphs, "no tree-loop graphs were captured"
    assert spec.verifier.tree_graphs is not None
    assert _finish(sched, col, reqs) == expected
    stats = sched.stats()
    assert stats["spec_num_verified_requests"] > 0
    assert tree.loop.num_runs > 0 and spec.verifier.tree_graphs.num_replays > 0
    if algorithm == "eagle":
        assert stats["spec_num_accepted_tokens"] > 0
