"""The draft loop (all draft decode steps of a cycle in one static-buffer pass, one CUDA graph on a GPU) run eagerly
on the CPU through the Triton backend (its interpreter): the same drafts as drafting pass by pass, for a draft model
and for EAGLE heads, and greedy output equal to plain decoding."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # must precede the first import of triton (radixmesh.kernels): @triton.jit reads it then
    os.environ["TRITON_INTERPRET"] = "1"

from pathlib import Path
from typing import Any

import pytest

from radixmesh.engine.request import Req
from radixmesh.engine.scheduler.core import Scheduler
from radixmesh.engine.speculative.decoder import SpecDecoder
from radixmesh.engine.speculative.draft_loop import DraftLoop
from radixmesh.engine.speculative.draft_model import DraftModelProposer
from radixmesh.engine.speculative.verify_graphs import VerifyGraphRunner

from .eagle_factory import write_eagle, write_eagle3
from .scheduler_factory import clone, make_requests, make_scheduler, run_until_idle, tiny_model_config
from .spec_factory import draft_values, write_model_dir

pytestmark = [pytest.mark.slow,  # the Triton interpreter: over a minute per case
              pytest.mark.skipif(torch.cuda.is_available(),
                                 reason="the scheduler factory runs on CPU: triton needs the interpreter")]
HEAD_DIM = 16  # (the Triton kernels' smallest head)
TRITON_HEADS = (2, 1, HEAD_DIM)
TRITON: dict[str, Any] = {"attention_backend": "triton", "disable_speculative_backoff": True,
                          "speculative_num_draft_tokens": 3}


def _run(sched: Scheduler, reqs: list[Req], col: Any) -> dict[str, list[int]]:
    for req in reqs:
        sched.add_request(clone(req))
    run_until_idle(sched)
    assert not col.errors, col.errors
    return {r.rid: col.tokens[r.rid] for r in reqs}


def _speculate(reqs: list[Req], loop: bool, **overrides: Any) -> tuple[dict[str, list[int]], list[list[int]], int]:
    """Outputs, every proposal's drafts, and how many times the loop ran."""
    sched, col = make_scheduler(tiny_model_config(head_dim=HEAD_DIM), **{**TRITON, **overrides})
    spec = sched.hooks.get(SpecDecoder)
    assert spec is not None and isinstance(spec.proposer, DraftModelProposer)
    proposer = spec.proposer
    if overrides.get("speculative_algorithm") == "draft":
        proposer.runner.model.load_state_dict(sched.runner.model.state_dict())  # every draft accepted
    assert proposer.loop is None  # (no CUDA graphs on the CPU)
    if loop:
        proposer.loop = DraftLoop(proposer.runner, 2, 4, proposer._to_target, proposer._between_steps, capture=False)
        if proposer.graph_catch_up:  # short catch-ups through the extend graphs' static-buffer pass
            tokens = proposer._catch_up_graph_tokens(sched.config)
            proposer.catch_up_graphs = VerifyGraphRunner(proposer.runner, tokens - 1, 4, capture=False)
        # and the verify pass through its graphs' static-buffer pass, drafts written in on the device
        spec.verifier.graphs = VerifyGraphRunner(sched.runner, 3, 4, capture=False)
    drafted: list[list[int]] = []
    propose = proposer.propose

    def spy(batch: list[Req], limits: list[int]) -> Any:
        proposal = propose(batch, limits)
        drafted.extend(draft_values(proposal))
        return proposal

    proposer.propose = spy  # type: ignore[method-assign]
    outputs = _run(sched, reqs, col)
    if loop and proposer.catch_up_graphs is not None:
        assert proposer.catch_up_graphs.num_replays > 0
    if loop:
        assert spec.verifier.graphs is not None and spec.verifier.graphs.num_replays > 0
        assert sched.stats()["spec_draft_device_proposals"] > 0
    return outputs, drafted, proposer.loop.num_runs if proposer.loop is not None else 0


@pytest.mark.parametrize("algorithm", ["draft", "eagle", "eagle3"])
def test_the_draft_loop_drafts_what_pass_by_pass_drafts(tmp_path: Path, algorithm: str) -> None:
    reqs = make_requests(3, seed=31, shared_prefix_len=4, max_new_tokens=9)
    plain_sched, plain_col = make_scheduler(tiny_model_config(head_dim=HEAD_DIM), attention_backend="triton")
    expected = _run(plain_sched, reqs, plain_col)
    if algorithm == "draft":
        head = write_model_dir(tmp_path / "draft", head_dim=HEAD_DIM)
        extra = {"speculative_draft_load_format": "dummy"}
    else:  # random heads: (few drafts accepted) the drafts themselves are compared
        head = (write_eagle(tmp_path / "h", seed=5, heads=TRITON_HEADS) if algorithm == "eagle"
                else write_eagle3(tmp_path / "h", seed=6, heads=TRITON_HEADS))
        extra = {}
    settings = {"speculative_algorithm": algorithm, "speculative_draft_model": str(head), **extra}
    looped, looped_drafts, runs = _speculate(reqs, True, **settings)
    stepped, stepped_drafts, _ = _speculate(reqs, False, **settings)
    assert looped == stepped == expected
    assert looped_drafts == stepped_drafts and any(len(d) == 3 for d in looped_drafts)
    assert runs > 0

