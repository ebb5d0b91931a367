"""Verify passes through the Triton extend kernel (CPU: the Triton interpreter, tiny shapes)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # must precede the first import of triton (radixmesh.kernels): @triton.jit reads it then
    os.environ["TRITON_INTERPRET"] = "1"

from typing import Any

import pytest

from radixmesh.engine.speculative.decoder import SpecDecoder

from .scheduler_factory import clone, make_requests, make_scheduler, run_until_idle, tiny_model_config
from .spec_factory import OracleProposer, oracle

__all__ = ["oracle"]  # the fixture


@pytest.mark.skipif(torch.cuda.is_available(), reason="the scheduler factory runs on CPU: triton needs the interpreter")
def test_verify_with_the_triton_backend_matches_plain_torch_native(oracle: type[OracleProposer]) -> None:
    reqs = make_requests(3, seed=21, shared_prefix_len=6, max_new_tokens=7)
    model = tiny_model_config(head_dim=16)
    outputs = {}
    for name, overrides in (("plain", {"attention_backend": "torch-native"}),
                            ("spec", {"attention_backend": "triton", "speculative_algorithm": "oracle",
                                      "disable_speculative_backoff": True})):
        sched, col = make_scheduler(model, **overrides)
        for req in reqs:
            sched.add_request(clone(req))
        run_until_idle(sched)
        outputs[name] = col.tokens
        if name == "plain":
            oracle.reference = dict(col.tokens)
        else:
            assert sched.stats()["spec_num_accepted_tokens"] > 0
    assert outputs["spec"] == outputs["plain"]


def test_graph_lengths_cover_every_draft_count_within_twice_the_need() -> None:
    from radixmesh.engine.speculative.verify_graphs import graph_lengths

    assert graph_lengths(1) == [2]
    assert graph_lengths(4) == [2, 3, 5]
    assert graph_lengths(16) == [2, 3, 5, 9, 17]
    for k in range(1, 17):
        lens = graph_lengths(k)
        assert lens[-1] == k + 1
        assert all(next(e for e in lens if e >= need) <= 2 * need for need in range(2, k + 2))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the scheduler factory runs on CPU: triton needs the interpreter")
def test_verify_through_the_graph_pass_with_padding_matches_plain(oracle: type[OracleProposer]) -> None:
    """The static-buffer pass the verify graphs capture, run eagerly: padded tokens (requests with fewer
    drafts, lengths rounded up to 2/3/5) and dummy rows (3 requests in the graph of 4) change nothing."""
    from radixmesh.engine.speculative.verify_graphs import VerifyGraphRunner

    reqs = make_requests(3, seed=22, shared_prefix_len=6, max_new_tokens=9)
    for req, budget in zip(reqs, (9, 4, 6)):
        req.params = type(req.params)(max_new_tokens=budget, temperature=0.0)
    model = tiny_model_config(head_dim=16)
    outputs = {}
    compared: list[int] = []
    for name, overrides in (("plain", {"attention_backend": "torch-native"}),
                            ("spec", {"attention_backend": "triton", "speculative_algorithm": "oracle",
                                      "disable_speculative_backoff": True})):
        sched, col = make_scheduler(model, **overrides)
        spec = sched.hooks.get(SpecDecoder)
        if spec is not None:
            verifier = spec.verifier
            graphs = verifier.graphs = VerifyGraphRunner(sched.runner, 4, 4, capture=False)
            graph_forward = verifier.forward

            def both(batch: Any, graph_forward: Any = graph_forward, verifier: Any = verifier) -> torch.Tensor:
                eager = verifier._forward_eager(batch)  # the same KV written again: idempotent
                logits = graph_forward(batch)
                torch.testing.assert_close(logits, eager, atol=1e-4, rtol=1e-4)
                compared.append(len(batch.reqs))
                return logits

            verifier.forward = both  # type: ignore[method-assign]
        for req in reqs:
            sched.add_request(clone(req))
        run_until_idle(sched)
        outputs[name] = col.tokens
        if name == "plain":
            oracle.reference = dict(col.tokens)
    assert outputs["spec"] == outputs["plain"]
    assert graphs.num_replays == len(compared) > 0 and 3 in compared  # a dummy row padded 3 requests to 4
