"""Speculative decoding on a GPU: verify passes (Triton extend kernel, captured per batch size and draft
length) beside the decode CUDA graphs.

A small random model (wide weights: well-separated logits); float32 so that greedy output must be
identical to plain decoding (CUDA graphs, overlap scheduler) token for token. The draft model's
decode passes replay its own CUDA graphs; with nothing accepted, the back-off leaves the target
on its graphs with the overlap scheduler running ahead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from radixmesh.engine.speculative.decoder import SpecDecoder
from tests.unit.scheduler_factory import clone, make_requests, make_scheduler, run_until_idle, tiny_model_config
from tests.unit.spec_factory import OracleProposer, draft_scheduler, oracle, write_model_dir
from tests.unit.stats_helpers import chi_square_pvalue

pytestmark = [pytest.mark.gpu]
__all__ = ["oracle"]  # the fixture

SHAPE = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2, head_dim=32,
             max_position_embeddings=1024)
HF_SHAPE = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, max_position_embeddings=1024)
GPU: dict[str, Any] = dict(device="cuda", attention_backend="triton", max_total_tokens=16384, max_running_requests=32,
                           cuda_graph_max_bs=32)


def _run(reqs: list[Any], dtype: str = "float32", draft_dir: Path | None = None, same_weights: bool = False,
         **overrides: Any) -> tuple[Any, dict[str, list[int]]]:
    settings = dict(GPU, dtype=dtype, **overrides)
    if draft_dir is not None:
        sched, col = draft_scheduler(draft_dir, same_weights=same_weights, model_config=tiny_model_config(**SHAPE),
                                     **settings)
    else:
        sched, col = make_scheduler(tiny_model_config(**SHAPE), **settings)
    for req in reqs:
        sched.add_request(clone(req))
    run_until_idle(sched)
    assert not col.errors, col.errors
    return sched, {r.rid: col.tokens[r.rid] for r in reqs}


def _requests(num: int = 12, max_new_tokens: int = 40) -> list[Any]:
    reqs = make_requests(num, seed=4, shared_prefix_len=10, max_new_tokens=max_new_tokens, prompt_len=(4, 40))
    for req in reqs:  # some repetition for n-gram lookups
        req.origin_input_ids = req.origin_input_ids + req.origin_input_ids[-12:]
    return reqs


def test_plain_reference_uses_graphs_and_overlap() -> None:
    sched, _ = _run(_requests(4, 8))
    assert sched.config.overlap_enabled and sched.runner.graph_runner is not None
    assert sched.runner.graph_runner.num_replays > 0


def test_oracle_drafts_through_the_triton_verify_are_exact(oracle: type[OracleProposer]) -> None:
    reqs = _requests()
    _, expected = _run(reqs)
    oracle.reference = expected
    sched, got = _run(reqs, speculative_algorithm="oracle", speculative_num_draft_tokens=6,
                      disable_speculative_backoff=True)
    assert got == expected
    stats = sched.stats()
    assert 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"]
    assert sched.config.overlap_enabled  # verify steps wait for their tokens; the overlap scheduler stays on
    graphs = sched.hooks.get(SpecDecoder).verifier.graphs  # type: ignore[union-attr]
    assert graphs is not None and graphs.num_replays == stats["spec_num_verify_passes"]  # every verify replayed


def test_verify_graphs_give_the_eager_logits(oracle: type[OracleProposer]) -> None:
    """Each captured verify replay (padding and dummy rows included) against the eager pass of the same batch."""
    reqs = _requests(5, 24)
    _, expected = _run(reqs)
    oracle.reference = expected
    compared: list[float] = []
    sched, col = make_scheduler(tiny_model_config(**SHAPE), dtype="float32", speculative_algorithm="oracle",
                                disable_speculative_backoff=True, **GPU)
    verifier = sched.hooks.get(SpecDecoder).verifier  # type: ignore[union-attr]
    graph_forward = verifier.forward

    def both(batch: Any) -> torch.Tensor:
        eager = verifier._forward_eager(batch)
        logits = graph_forward(batch)
        compared.append(float((logits - eager).abs().max()))
        return logits

    verifier.forward = both  # type: ignore[method-assign]
    for req in reqs:
        sched.add_request(clone(req))
    run_until_idle(sched)
    assert {r.rid: col.tokens[r.rid] for r in reqs} == expected
    assert compared and max(compared) < 1e-3, compared


def test_ngram_greedy_is_exact() -> None:
    reqs = _requests()
    _, expected = _run(reqs)
    sched, got = _run(reqs, speculative_algorithm="ngram", speculative_ngram_min_match=1)
    assert got == expected
    assert sched.stats()["spec_ngram_hits"] > 0


def test_same_weight_draft_accepts_everything_and_replays_its_graphs(tmp_path: Path) -> None:
    reqs = _requests()
    _, expected = _run(reqs)
    sched, got = _run(reqs, draft_dir=write_model_dir(tmp_path / "draft", **HF_SHAPE), same_weights=True,
                      disable_speculative_backoff=True)
    assert got == expected
    stats = sched.stats()
    assert stats["spec_accept_rate"] > 0.99, stats
    proposer = sched.hooks.get(SpecDecoder).proposer  # type: ignore[union-attr]
    assert proposer.runner.graph_runner is not None
    loop = proposer.loop  # the draft steps of a cycle: one replay of the draft loop's graph
    assert loop is not None and loop.graphs and loop.num_runs > 0


def test_random_draft_backs_off_to_the_target_graphs(tmp_path: Path) -> None:
    reqs = _requests(2, 240)
    _, expected = _run(reqs)
    sched, got = _run(reqs, draft_dir=write_model_dir(tmp_path / "draft", **HF_SHAPE))
    assert got == expected
    stats = sched.stats()
    assert stats["spec_num_verify_passes"] < 40, stats
    assert sched.runner.graph_runner is not None and sched.runner.graph_runner.num_replays > 150
    assert stats["spec_num_overlapped_steps"] > 100  # backed off: plain steps overlap again


def test_bf16_same_weight_draft_mostly_agrees(tmp_path: Path) -> None:
    """bf16 logits of an extend (verify) and a decode pass differ in rounding, so a near-tie may flip the
    argmax: the outputs are compared, not required equal; acceptance must stay near 1."""
    reqs = _requests()
    _, expected = _run(reqs, dtype="bfloat16")
    sched, got = _run(reqs, dtype="bfloat16", draft_dir=write_model_dir(tmp_path / "draft", **HF_SHAPE),
                      same_weights=True, disable_speculative_backoff=True)
    same = sum(got[r] == expected[r] for r in expected)
    print(f"bf16: {same}/{len(expected)} outputs identical, accept rate {sched.stats()['spec_accept_rate']:.3f}")
    assert same >= 0.75 * len(expected)
    assert sched.stats()["spec_accept_rate"] > 0.9


@pytest.mark.parametrize("point_mass", [False, True])
def test_rejection_sampling_on_the_device(point_mass: bool) -> None:
    from radixmesh.engine.speculative.rejection import (
        ChainRows,
        accepted_lengths,
        chain_tokens,
        residual_sample,
        sampled_accept,
    )

    vocab, n = 64, 100_000
    gen = torch.Generator().manual_seed(5)
    p = torch.softmax(torch.randn(vocab, generator=gen) * 2, 0)
    q = torch.softmax(torch.randn(vocab, generator=gen) * 2, 0)
    x = torch.full((n,), int(q.argmax())) if point_mass else torch.multinomial(q, n, True, generator=gen)
    dev = torch.device("cuda")
    rows = ChainRows(torch.stack([x, torch.full_like(x, -1)], 1).reshape(-1).to(dev),
                     torch.arange(n).repeat_interleave(2).to(dev), torch.tensor([0, 1]).repeat(n).to(dev), n)
    pp = p.to(dev).expand(2 * n, -1)
    qq = None if point_mass else q.to(dev).expand(2 * n, -1)
    accept = sampled_accept(pp, qq, rows, torch.rand(2 * n, generator=gen).to(dev))
    final = residual_sample(pp, qq, rows, torch.rand(2 * n, generator=gen).to(dev))
    emitted = chain_tokens(rows, accepted_lengths(accept, rows), final).reshape(n, 2)[:, 0].cpu()
    assert chi_square_pvalue(torch.bincount(emitted, minlength=vocab).float(), p) > 1e-4
