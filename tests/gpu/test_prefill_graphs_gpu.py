"""Prefill CUDA graphs against eager prefills of the same passes: one request per pass, with and without a cached
prefix, over a float32 pool (the same greedy tokens as with the graphs off) and an FP8 pool (whose new K/V the
kernel gathers through their slots)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from radixmesh.engine.batch import ScheduleBatch
from radixmesh.engine.scheduler.core import Scheduler
from tests.unit.scheduler_factory import clone, make_requests, make_scheduler, run_until_idle, tiny_model_config

pytestmark = [pytest.mark.gpu]

BASE: dict[str, Any] = dict(device="cuda", attention_backend="triton", max_total_tokens=8192, max_running_requests=16,
                            cuda_graph_max_bs=16, prefill_graph_max_tokens=64)


def _serve_one_by_one(sched: Scheduler, reqs: list[Any]) -> None:
    for req in reqs:  # each prompt alone in its pass
        sched.add_request(clone(req))
        run_until_idle(sched)


def _compare_each_replay(sched: Scheduler, rel: float) -> list[tuple[int, int]]:
    """Wrap the runner's forward: a pass the graphs take runs eagerly first, then replays; the logits must agree to
    `rel` (the norm of the difference over the eager logits' norm: the GEMMs run on more rows in the graph, and the
    library may pick another kernel for them)."""
    runner = sched.runner
    graphs = runner.prefill_graphs
    assert graphs is not None, "no prefill graphs were captured"
    forward = runner.forward
    seen: list[tuple[int, int]] = []

    def both(batch: ScheduleBatch) -> torch.Tensor:
        if graphs.length(batch) is None:
            return forward(batch)
        runner.prefill_graphs = None
        eager = forward(batch)[:1].clone()  # the same KV written again by the replay: idempotent
        runner.prefill_graphs = graphs
        replays = graphs.num_replays
        logits = forward(batch)
        assert graphs.num_replays == replays + 1
        assert logits.shape == eager.shape and torch.isfinite(logits).all()
        assert ((logits - eager).norm() / eager.norm()).item() < rel
        seen.append((batch.extend_lens[0], batch.prefix_lens[0]))
        return logits

    runner.forward = both  # type: ignore[method-assign]
    return seen


def test_replays_give_the_eager_logits_and_the_same_tokens() -> None:
    reqs = make_requests(8, seed=61, shared_prefix_len=10, max_new_tokens=6, prompt_len=(6, 50))
    model = tiny_model_config(head_dim=16)
    eager, col_eager = make_scheduler(model, **{**BASE, "dtype": "float32", "prefill_graph_max_tokens": 0})
    assert eager.runner.prefill_graphs is None
    _serve_one_by_one(eager, reqs)
    sched, col = make_scheduler(model, **{**BASE, "dtype": "float32"})
    seen = _compare_each_replay(sched, 1e-5)
    _serve_one_by_one(sched, reqs)
    assert not col.errors and col.tokens == col_eager.tokens
    assert len(seen) >= 6 and any(p > 0 for _, p in seen) and any(p == 0 for _, p in seen)


def test_replays_over_an_fp8_pool_match_eager() -> None:
    reqs = make_requests(5, seed=62, shared_prefix_len=12, max_new_tokens=4, prompt_len=(10, 50))
    sched, col = make_scheduler(tiny_model_config(head_dim=16), **{**BASE, "dtype": "bfloat16",
                                                                    "kv_cache_dtype": "fp8_e4m3"})
    seen = _compare_each_replay(sched, 2e-2)
    _serve_one_by_one(sched, reqs)
    assert not col.errors and len(seen) >= 4
