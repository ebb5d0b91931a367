"""One-request prefills through the prefill graphs' static-buffer pass (CPU: the pass a graph captures, run eagerly,
through the Triton kernels under the interpreter), which passes take it, and when a runner captures none."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # must precede the first import of triton (radixmesh.kernels): @triton.jit reads it then
    os.environ["TRITON_INTERPRET"] = "1"

from types import SimpleNamespace
from typing import Any

import pytest

from radixmesh.common.errors import RadixMeshError
from radixmesh.engine import prefill_graphs
from radixmesh.engine.attention.base import ForwardMode
from radixmesh.engine.batch import PromptLogprobPlan, ScheduleBatch
from radixmesh.engine.config import EngineConfig
from radixmesh.engine.prefill_graphs import (
    PrefillGraphRunner,
    graph_lengths,
    make_prefill_graphs,
    prefill_graph_refusal,
)

from .scheduler_factory import clone, make_requests, make_scheduler, run_until_idle, tiny_model_config

CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="the scheduler factory runs on CPU: triton needs the "
                                                                "interpreter")


def test_lengths_pad_at_most_half_a_bucket_and_end_at_the_limit() -> None:
    assert graph_lengths(1024) == [16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024]
    assert graph_lengths(100)[-2:] == [96, 100] and graph_lengths(16) == [16] and graph_lengths(15) == []
    lengths = graph_lengths(4000)
    assert lengths[-1] == 4000
    for need in range(16, 4001):
        assert next(e for e in lengths if e >= need) <= 1.5 * need


def _batch(extend_lens: list[int], prefix_lens: list[int] | None = None, **fields: Any) -> ScheduleBatch:
    prefix_lens = prefix_lens or [0] * len(extend_lens)
    n = sum(extend_lens)
    return ScheduleBatch(mode=ForwardMode.EXTEND, reqs=[object()] * len(extend_lens),  # type: ignore[list-item]
                         input_ids=[1] * n, positions=list(range(n)), out_cache_loc=torch.arange(1, n + 1),
                         prefix_lens=prefix_lens, extend_lens=extend_lens, req_pool_indices=[1] * len(extend_lens),
                         **fields)


def test_which_batches_replay_and_in_which_graph() -> None:
    graphs = PrefillGraphRunner.__new__(PrefillGraphRunner)
    graphs.lengths, graphs.max_seq_len = graph_lengths(64), 100
    assert graphs.length(_batch([9])) == 16 and graphs.length(_batch([17])) == 24
    assert graphs.length(_batch([64], [30])) == 64
    assert graphs.length(_batch([8])) is None  # the decode kernel's short path
    assert graphs.length(_batch([65])) is None  # past the largest graph
    assert graphs.length(_batch([20, 20])) is None  # two requests
    assert graphs.length(_batch([40], [61])) is None  # past the KV index list
    assert graphs.length(_batch([20], future_rows=[0])) is None  # an input is the previous step's token
    logprobs = PromptLogprobPlan(rows=[3], targets=[1], counts=[1], next_pos=[4])
    assert graphs.length(_batch([20], prompt_logprobs=logprobs)) is None


def _runner(**config: Any) -> SimpleNamespace:
    """What the refusals and the limit read of a runner that may capture."""
    return SimpleNamespace(graph_runner=object(), attn_backend=SimpleNamespace(supports_extend_graph=True),
                           model=SimpleNamespace(rows_independent=True), lora=None, mm=None, dp=None,
                           tp=SimpleNamespace(enabled=False), context_len=8192,
                           config=SimpleNamespace(**{"speculative_algorithm": None, "prefill_graph_max_tokens": 1024,
                                                     "prefill_token_budget": 4096, **config}))


def test_the_limit_is_capped_by_the_prefill_budget_and_the_context(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[int] = []

    def record(runner: Any, max_tokens: int) -> str:
        made.append(max_tokens)
        return "graphs"

    monkeypatch.setattr(prefill_graphs, "PrefillGraphRunner", record)
    assert make_prefill_graphs(_runner()) == "graphs"  # type: ignore[arg-type]
    assert make_prefill_graphs(_runner(prefill_token_budget=512)) == "graphs"  # type: ignore[arg-type]
    short_context = _runner()
    short_context.context_len = 300
    assert make_prefill_graphs(short_context) == "graphs"  # type: ignore[arg-type]
    assert made == [1024, 512, 299]
    assert make_prefill_graphs(_runner(prefill_graph_max_tokens=0)) is None  # type: ignore[arg-type]
    assert make_prefill_graphs(_runner(prefill_graph_max_tokens=15)) is None  # type: ignore[arg-type]
    assert made == [1024, 512, 299]


def test_refusals_name_the_reason() -> None:
    runner = _runner()
    assert prefill_graph_refusal(runner) is None  # type: ignore[arg-type]
    moe = SimpleNamespace(**{**vars(runner), "model": SimpleNamespace(rows_independent=False)})
    assert "MoE" in (prefill_graph_refusal(moe) or "")  # type: ignore[arg-type]
    no_graphs = SimpleNamespace(**{**vars(runner), "graph_runner": None})
    assert prefill_graph_refusal(no_graphs) == "no decode CUDA graphs"  # type: ignore[arg-type]
    spec = SimpleNamespace(**{**vars(runner), "config": SimpleNamespace(speculative_algorithm="ngram")})
    assert "speculative" in (prefill_graph_refusal(spec) or "")  # type: ignore[arg-type]


def test_a_negative_limit_is_refused() -> None:
    with pytest.raises(RadixMeshError, match="prefill_graph_max_tokens"):
        EngineConfig(prefill_graph_max_tokens=-1)


def test_a_cpu_runner_captures_none() -> None:
    sched, _ = make_scheduler(tiny_model_config(head_dim=16))
    assert sched.runner.prefill_graphs is None and make_prefill_graphs(sched.runner) is None


@CPU_ONLY
def test_the_graph_pass_gives_the_eager_logits_and_tokens() -> None:
    """Prompts of 9-40 new tokens, alone in their passes, some after a cached prefix: the static-buffer pass's
    logits (padding rows in it) equal the eager pass's, and the outputs equal plain torch-native decoding."""
    reqs = make_requests(6, seed=5, shared_prefix_len=12, max_new_tokens=5, prompt_len=(9, 28))
    model = tiny_model_config(head_dim=16)
    plain, col = make_scheduler(model, attention_backend="torch-native")
    for req in reqs:
        plain.add_request(clone(req))
        run_until_idle(plain)
    sched, col_graph = make_scheduler(model, attention_backend="triton")
    runner = sched.runner
    graphs = runner.prefill_graphs = PrefillGraphRunner(runner, 48, capture=False)
    eager_forward = runner.forward
    compared: list[tuple[int, int]] = []

    def both(batch: ScheduleBatch) -> torch.Tensor:
        length = graphs.length(batch)
        if length is None:
            return eager_forward(batch)
        runner.prefill_graphs = None
        eager = eager_forward(batch)[:1].clone()  # the same KV written twice: idempotent
        runner.prefill_graphs = graphs
        logits = eager_forward(batch)
        torch.testing.assert_close(logits, eager, atol=1e-4, rtol=1e-4)
        compared.append((batch.extend_lens[0], batch.prefix_lens[0]))
        return logits

    runner.forward = both  # type: ignore[method-assign]
    for req in reqs:  # one at a time: each prompt is its pass's only request
        sched.add_request(clone(req))
        run_until_idle(sched)
    assert col_graph.tokens == col.tokens
    assert graphs.num_replays == len(compared) == len(reqs)
    assert any(prefix > 0 for _, prefix in compared) and any(prefix == 0 for _, prefix in compared)
