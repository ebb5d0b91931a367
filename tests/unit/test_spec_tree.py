"""EAGLE draft trees (--speculative-eagle-topk > 1) on the CPU (fp32): greedy output is plain decoding's, the accepted
path's KV lands in the request's slots in order and no slot leaks; the acceptance along a tree by hand."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # must precede the first import of triton (radixmesh.kernels): @triton.jit reads it then
    os.environ["TRITON_INTERPRET"] = "1"

from pathlib import Path
from typing import Any

import pytest

from radixmesh.common.errors import RadixMeshError
from radixmesh.engine.kv_manager import KVCacheManager
from radixmesh.engine.memory import ReqToTokenPool
from radixmesh.engine.request import Req
from radixmesh.engine.scheduler.core import Scheduler
from radixmesh.engine.speculative import decoder as decoder_module
from radixmesh.engine.speculative.base import Proposal
from radixmesh.engine.speculative.decoder import SpecDecoder
from radixmesh.engine.speculative.eagle import EagleProposer
from radixmesh.engine.speculative.tree import tree_accept, tree_rows
from radixmesh.engine.speculative.verify_batch import settle_tree_kv
from radixmesh.wire.sampling import SamplingParams

from .eagle_factory import make_bigram_like, write_eagle, write_eagle3
from .scheduler_factory import (
    VOCAB,
    Collector,
    assert_no_leak,
    clone,
    make_requests,
    make_scheduler,
    run_until_idle,
    tiny_model_config,
)

BIGRAM_SCALE = 0.003
"""The bigram-like target's layers' share: its greedy token is the head's top-1 most of the time, else mostly among
its top few (trees then accept more than chains)."""


def _run(sched: Scheduler, col: Collector, reqs: list[Req]) -> dict[str, list[int]]:
    for req in reqs:
        sched.add_request(clone(req))
    run_until_idle(sched)
    assert not col.errors, col.errors
    return {r.rid: col.tokens[r.rid] for r in reqs}


def _head(tmp_path: Path, algorithm: str, **kwargs: Any) -> Path:
    if algorithm == "eagle":
        return write_eagle(tmp_path / "eagle", seed=3, **kwargs)
    return write_eagle3(tmp_path / "eagle3", seed=4, **kwargs)


def _tree_scheduler(head: Path, algorithm: str, topk: int, steps: int, tokens: int, model: Any = None,
                    **overrides: Any) -> tuple[Scheduler, Collector, EagleProposer]:
    sched, col = make_scheduler(model, speculative_algorithm=algorithm, speculative_draft_model=str(head),
                                disable_speculative_backoff=True, speculative_eagle_topk=topk,
                                speculative_num_steps=steps, speculative_num_draft_tokens=tokens, **overrides)
    spec = sched.hooks.get(SpecDecoder)
    assert spec is not None and isinstance(spec.proposer, EagleProposer) and spec.proposer.tree is not None
    return sched, col, spec.proposer


def _assert_clean(sched: Scheduler, proposer: EagleProposer) -> None:
    assert_no_leak(sched)
    assert sched.flush_cache()
    kv = proposer.kv
    assert kv.allocator.available_size() == kv.capacity, "head KV slots leaked"
    assert kv.req_pool.available_size() == kv.req_pool.size, "head rows (shadows or beams) leaked"


# ---- acceptance and KV by hand ----------------------------------------------------------------

def test_tree_accept_follows_the_targets_tokens_down_one_branch() -> None:
    # request 0:       root(5)                 request 1: root(9) -> 1(4) -> 2(6)
    #            1(7)   2(8)   3(3)
    #           4(1)    5(2)  6(4)
    #                         7(6)
    trees = [[-1, 0, 0, 0, 1, 2, 2, 6], [-1, 0, 1]]
    fed = torch.tensor([5, 7, 8, 3, 1, 2, 4, 6, 9, 4, 6])
    # the target's token at each row: root -> 8 (node 2), node 2 -> 4 (node 6), node 6 -> 6 (node 7), node 7 -> 11
    final = torch.tensor([8, 0, 4, 0, 0, 0, 6, 11, 4, 5, 0])
    num_accepted, emit = tree_accept(fed, final, tree_rows(trees, torch.device("cpu")))
    assert num_accepted.tolist() == [3, 1]
    assert emit.tolist()[:4] == [0, 2, 6, 7] and emit.tolist()[8:10] == [8, 9]
    assert final.index_select(0, emit).tolist()[:4] == [8, 4, 6, 11]  # the emitted tokens: the path, then 11


def test_settle_tree_kv_keeps_the_path_in_order_and_frees_the_rest() -> None:
    sched, _ = make_scheduler()
    kv: KVCacheManager = sched.kv
    req = Req(rid="r", origin_input_ids=list(range(10)), params=SamplingParams(max_new_tokens=8))
    req.output_ids = [1, 2, 3, 4]  # the root (position 10) and three accepted drafts were appended
    assert kv.assign_row(req)
    before = kv.allocator.available_size()
    slots = kv.alloc_slots(8)
    assert slots is not None and isinstance(kv.req_pool, ReqToTokenPool) and req.req_pool_idx is not None
    kv.req_pool.write(req.req_pool_idx, 10, slots)
    assert settle_tree_kv(req, 10, 8, [0, 2, 5, 7], kv) == 14
    row = kv.req_pool.req_to_token[req.req_pool_idx]
    assert row[10:14].tolist() == slots[[0, 2, 5, 7]].tolist()
    assert kv.allocator.available_size() == before - 4
    # a stop that cut the tokens short keeps fewer
    req.output_ids = [1]
    slots = kv.alloc_slots(3)
    assert slots is not None
    kv.req_pool.write(req.req_pool_idx, 10, slots)
    assert settle_tree_kv(req, 10, 3, [0, 2], kv) == 11 and row[10].item() == slots[0].item()


# ---- EAGLE heads drafting trees -------------------------------------------------------------

@pytest.mark.parametrize("algorithm", ["eagle", "eagle3"])
@pytest.mark.parametrize("topk, steps, tokens", [(2, 2, 4), (4, 3, 8), (3, 3, 6), (2, 3, 8)])
def test_tree_greedy_output_is_plain_decoding(tmp_path: Path, algorithm: str, topk: int, steps: int,
                                              tokens: int) -> None:
    """Random heads (few drafts accepted), a batch of mixed lengths with a shared prefix."""
    reqs = make_requests(6, seed=31, shared_prefix_len=5, max_new_tokens=14, prompt_len=(2, 30))
    expected = _run(*make_scheduler(), reqs)
    sched, col, proposer = _tree_scheduler(_head(tmp_path, algorithm), algorithm, topk, steps, tokens)
    assert _run(sched, col, reqs) == expected
    stats = sched.stats()
    assert stats["spec_num_verified_requests"] > 0 and stats["spec_num_draft_tokens"] > 0
    assert proposer.tree is not None and proposer.tree.num_trees > 0
    _assert_clean(sched, proposer)


def _bigram_run(tmp_path: Path, reqs: list[Req], topk: int, steps: int, tokens: int,
                spy: Any = None, **overrides: Any) -> tuple[dict[str, list[int]], dict[str, float]]:
    head = write_eagle(tmp_path / f"bigram-{topk}", seed=3, bigram=True)
    if topk > 1:
        sched, col, proposer = _tree_scheduler(head, "eagle", topk, steps, tokens, **overrides)
    else:
        sched, col = make_scheduler(speculative_algorithm="eagle", speculative_draft_model=str(head),
                                    disable_speculative_backoff=True, speculative_num_steps=steps, **overrides)
    make_bigram_like(sched.runner.model, BIGRAM_SCALE)
    if spy is not None:
        spy(sched)
    out = _run(sched, col, reqs)
    if topk > 1:
        _assert_clean(sched, proposer)
    return out, sched.stats()


@pytest.mark.parametrize("overrides", [{}, {"chunked_prefill_size": 8},
                                       {"max_total_tokens": 260, "max_running_requests": 8}],
                         ids=["default", "chunked", "tight-kv"])
def test_trees_accept_along_other_branches_and_stay_exact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          overrides: dict[str, Any]) -> None:
    """A head that mostly agrees with the target: paths through a node's second or later child are accepted,
    output stays plain decoding's, and (with KV to spare) trees accept more per step than chains of the same depth."""
    reqs = make_requests(8, seed=32, shared_prefix_len=4, max_new_tokens=24, prompt_len=(2, 25))
    plain, col = make_scheduler(**overrides)
    make_bigram_like(plain.runner.model, BIGRAM_SCALE)
    expected = _run(plain, col, reqs)
    trees: dict[str, list[int]] = {}
    later_children = []

    def spy(sched: Scheduler) -> None:
        spec = sched.hooks.get(SpecDecoder)
        assert spec is not None
        propose = spec.proposer.propose

        def recording(reqs: list[Req], max_drafts: list[int]) -> Proposal:
            proposal = propose(reqs, max_drafts)
            for req, parents in zip(reqs, proposal.parents or []):  # (none while a long prompt catches up)
                trees[req.rid] = [-1, *(p + 1 for p in parents)]
            return proposal

        spec.proposer.propose = recording  # type: ignore[method-assign]

    def settle(req: Req, start: int, num_reserved: int, path: list[int], kv: KVCacheManager) -> int:
        parents = trees[req.rid]
        later_children.extend(node for node in path[1:] if any(parents[s] == parents[node] for s in range(node)))
        return settle_tree_kv(req, start, num_reserved, path, kv)

    monkeypatch.setattr(decoder_module, "settle_tree_kv", settle)
    got, tree_stats = _bigram_run(tmp_path, reqs, 4, 3, 8, spy, **overrides)
    assert got == expected
    assert later_children, "no accepted path went through a node's later child"
    chain_out, chain_stats = _bigram_run(tmp_path, reqs, 1, 3, 3, **overrides)
    assert chain_out == expected
    if not overrides:  # (with KV to spare: tight KV cuts trees and chains differently)
        assert tree_stats["spec_accept_length"] > chain_stats["spec_accept_length"]


def test_sampled_requests_decode_beside_trees_without_drafts(tmp_path: Path) -> None:
    reqs = make_requests(6, seed=33, max_new_tokens=12)
    for req in reqs[::2]:
        req.params = SamplingParams(max_new_tokens=12, temperature=0.8, seed=5)
    greedy = [r for r in reqs if r.params.is_greedy]
    expected = _run(*make_scheduler(), greedy)
    drafted: list[str] = []
    sched, col, proposer = _tree_scheduler(_head(tmp_path, "eagle"), "eagle", 3, 2, 6)
    propose = proposer.propose

    def spy(batch_reqs: list[Req], max_drafts: list[int]) -> Proposal:
        proposal = propose(batch_reqs, max_drafts)
        drafted.extend(r.rid for r, d in zip(batch_reqs, proposal.drafts) if d)
        return proposal

    proposer.propose = spy  # type: ignore[method-assign]
    got = _run(sched, col, reqs)
    assert {r.rid: got[r.rid] for r in greedy} == expected
    assert all(len(got[r.rid]) == 12 for r in reqs)
    sampled = {r.rid for r in reqs if not r.params.is_greedy}
    assert drafted and not sampled & set(drafted)
    _assert_clean(sched, proposer)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the scheduler factory runs on CPU: triton needs the interpreter")
def test_tree_verification_through_the_triton_kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Drafts accepted beyond the root (a mostly agreeing head), so the rows under the mask decide tokens; the masks
    reach the kernel (whose masking test_tree_attention.py checks against the reference)."""
    from radixmesh.engine.attention import triton_backend

    masked: list[int] = []
    kernel = triton_backend.extend_attention_fwd

    def counting(*args: Any, **kwargs: Any) -> None:
        if kwargs.get("custom_mask") is not None:
            masked.append(1)
        kernel(*args, **kwargs)

    monkeypatch.setattr(triton_backend, "extend_attention_fwd", counting)
    model = tiny_model_config(head_dim=16)
    reqs = make_requests(3, seed=34, shared_prefix_len=4, max_new_tokens=10)
    plain, col = make_scheduler(model, attention_backend="torch-native")
    make_bigram_like(plain.runner.model, BIGRAM_SCALE)
    expected = _run(plain, col, reqs)
    head = write_eagle(tmp_path / "h", seed=3, heads=(2, 1, 16), bigram=True)
    sched, col, proposer = _tree_scheduler(head, "eagle", 3, 3, 6, model, attention_backend="triton")
    make_bigram_like(sched.runner.model, BIGRAM_SCALE)
    assert _run(sched, col, reqs) == expected
    assert sched.stats()["spec_num_accepted_tokens"] > 0 and masked
    _assert_clean(sched, proposer)


def test_bench_speculative_takes_tree_flags(tmp_path: Path) -> None:
    import json

    from radixmesh.cli import build_parser

    from .spec_factory import write_model_dir

    model = write_model_dir(tmp_path / "tiny", vocab_size=512)  # (the random workload draws ids from 100 up)
    head = write_eagle(tmp_path / "head", seed=3)  # no embedding and LM head of its own: the target's
    config = json.loads((head / "config.json").read_text())
    (head / "config.json").write_text(json.dumps({**config, "vocab_size": 512}))
    result = tmp_path / "spec.jsonl"
    args = build_parser().parse_args([
        "bench", "speculative", "--model", str(model), "--load-format", "dummy", "--device", "cpu", "--dtype",
        "float32", "--workload", "random", "--input-len", "12", "--output-len", "12", "--batch-sizes", "1,2",
        "--speculative-algorithm", "eagle", "--speculative-draft-model", str(head), "--speculative-eagle-topk", "4",
        "--speculative-num-steps", "3", "--speculative-num-draft-tokens", "8", "--disable-speculative-backoff",
        "--result-file", str(result)])
    assert args.func(args) == 0
    rows = [json.loads(line) for line in result.read_text().splitlines()]
    assert [r["batch_size"] for r in rows] == [1, 2]
    for row in rows:
        assert (row["speculative_eagle_topk"], row["speculative_num_steps"]) == (4, 3)
        assert row["identical_outputs"] == f"{row['num_requests']}/{row['num_requests']}"


def test_tree_options_are_checked() -> None:
    with pytest.raises(RadixMeshError, match="num-draft-tokens >= 2"):
        make_scheduler(speculative_algorithm="eagle", speculative_draft_model="x", speculative_eagle_topk=2,
                       speculative_num_draft_tokens=1)
    from radixmesh.engine.config import EngineConfig

    config = EngineConfig(model="m", speculative_algorithm="eagle", speculative_draft_model="x",
                          speculative_eagle_topk=4, speculative_num_steps=3, speculative_num_draft_tokens=8)
    assert config.speculative_max_drafts == 7 and config.speculative_tree_steps == 3
    small = EngineConfig(model="m", speculative_algorithm="eagle", speculative_draft_model="x",
                         speculative_eagle_topk=2, speculative_num_steps=1, speculative_num_draft_tokens=8)
    assert small.speculative_max_drafts == 2  # one level of two branches


assert VOCAB > 8  # (the hand-made trees' tokens are real ids)


@pytest.mark.slow  # the Triton interpreter: about a minute
@pytest.mark.skipif(torch.cuda.is_available(), reason="the scheduler factory runs on CPU: triton needs the interpreter")
def test_tree_verify_through_the_graph_pass_matches_eager(tmp_path: Path) -> None:
    """The static-buffer pass the tree verify graphs capture, run eagerly: trees padded to 2/3/5/7 rows per request,
    dummy requests, the staged masks and depth positions give the eager pass's logits, and output stays plain."""
    from radixmesh.engine.speculative.verify_graphs import VerifyGraphRunner

    model = tiny_model_config(head_dim=16)
    reqs = make_requests(3, seed=35, shared_prefix_len=4, max_new_tokens=9)
    plain, col = make_scheduler(model, attention_backend="torch-native")
    make_bigram_like(plain.runner.model, BIGRAM_SCALE)
    expected = _run(plain, col, reqs)
    head = write_eagle(tmp_path / "h", seed=3, heads=(2, 1, 16), bigram=True)
    sched, col, _ = _tree_scheduler(head, "eagle", 3, 3, 7, model, attention_backend="triton")
    make_bigram_like(sched.runner.model, BIGRAM_SCALE)
    spec = sched.hooks.get(SpecDecoder)
    assert spec is not None
    verifier = spec.verifier
    graphs = verifier.tree_graphs = VerifyGraphRunner(sched.runner, 6, 4, capture=False, tree=True)
    graph_forward = verifier.forward
    compared: list[int] = []

    def both(batch: Any) -> torch.Tensor:
        eager = verifier._forward_eager(batch)  # the same KV written again: idempotent
        logits = graph_forward(batch)
        torch.testing.assert_close(logits, eager, atol=1e-4, rtol=1e-4)
        compared.append(len(batch.reqs))
        return logits

    verifier.forward = both  # type: ignore[method-assign]
    assert _run(sched, col, reqs) == expected
    assert sched.stats()["spec_num_accepted_tokens"] > 0
    assert graphs.num_replays > 0 and 3 in compared


@pytest.mark.slow  # the Triton interpreter: about a minute
@pytest.mark.skipif(torch.cuda.is_available(), reason="the scheduler factory runs on CPU: triton needs the interpreter")
@pytest.mark.parametrize("algorithm", ["eagle", "eagle3"])
def test_tree_loop_drafts_what_pass_by_pass_drafts(tmp_path: Path, algorithm: str) -> None:
    """The tree loop's static-buffer pass (one CUDA graph on a GPU) run eagerly through the Triton backend: the same
    trees as stepping pass by pass, padding requests (3 in the loop's 4) included, and plain decoding's output."""
    from radixmesh.engine.speculative.tree_loop import TreeLoop

    model = tiny_model_config(head_dim=16)
    reqs = make_requests(3, seed=36, shared_prefix_len=4, max_new_tokens=8)
    plain, col = make_scheduler(model, attention_backend="torch-native")
    make_bigram_like(plain.runner.model, BIGRAM_SCALE)
    expected = _run(plain, col, reqs)
    head = (write_eagle(tmp_path / "h", seed=3, heads=(2, 1, 16), bigram=True) if algorithm == "eagle"
            else write_eagle3(tmp_path / "h3", seed=4, heads=(2, 1, 16)))
    drafted: dict[bool, list[Any]] = {}
    for loop in (False, True):
        sched, col, proposer = _tree_scheduler(head, algorithm, 2, 3, 6, model, attention_backend="triton")
        make_bigram_like(sched.runner.model, BIGRAM_SCALE)
        tree = proposer.tree
        assert tree is not None and tree.loop is None  # (no CUDA graphs on the CPU)
        if loop:
            tree.loop = TreeLoop(proposer.runner, proposer.head, 2, 2, 4, proposer._to_target, capture=False)
        propose = proposer.propose
        seen: list[Any] = drafted.setdefault(loop, [])

        def spy(batch: list[Req], limits: list[int], propose: Any = propose, seen: list[Any] = seen) -> Proposal:
            proposal = propose(batch, limits)
            seen.append((proposal.drafts, proposal.parents))
            return proposal

        proposer.propose = spy  # type: ignore[method-assign]
        assert _run(sched, col, reqs) == expected
        if loop:
            assert tree.loop is not None and tree.loop.num_runs > 0
        _assert_clean(sched, proposer)
    assert drafted[True] == drafted[False] and any(parents for _, parents in drafted[True])
