"""The benchmark-only oracle proposer and `bench speculative --oracle` on a tiny random model (CPU)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from radixmesh.cli import build_parser
from radixmesh.engine.scheduler.core import Scheduler
from radixmesh.engine.speculative.decoder import SpecDecoder
from radixmesh.engine.speculative.oracle import OracleProposer, keep_probability

from .scheduler_factory import Collector, assert_no_leak, clone, make_requests, make_scheduler, run_until_idle
from .spec_factory import write_model_dir


def _run(sched: Scheduler, col: Collector, reqs: list[Any]) -> dict[str, list[int]]:
    for req in reqs:
        sched.add_request(clone(req))
    run_until_idle(sched)
    assert not col.errors, col.errors
    return {r.rid: col.tokens[r.rid] for r in reqs}


def _oracle_scheduler(reqs: list[Any], expected: dict[str, list[int]], acceptance: float = 1.0,
                      **overrides: Any) -> tuple[Scheduler, Collector, OracleProposer]:
    sched, col = make_scheduler(speculative_algorithm="oracle", disable_speculative_backoff=True, **overrides)
    spec = sched.hooks.get(SpecDecoder)
    assert spec is not None and isinstance(spec.proposer, OracleProposer)
    for req in reqs:
        spec.proposer.record(req.origin_input_ids, expected[req.rid])
    spec.proposer.set_acceptance(acceptance, seed=3)
    return sched, col, spec.proposer


def _stats(sched: Scheduler) -> dict[str, Any]:
    return {k: v for k, v in sched.stats().items() if k.startswith("spec_")}


@pytest.mark.parametrize("acceptance, k", [(0.7, 4), (0.5, 4), (0.9, 6), (0.3, 1)])
def test_keep_probability_gives_the_accept_rate(acceptance: float, k: int) -> None:
    s = keep_probability(acceptance, k)
    assert 0 < s < 1
    assert sum(s ** j for j in range(1, k + 1)) / k == pytest.approx(acceptance, abs=1e-9)
    assert keep_probability(1.0, k) == 1.0 and keep_probability(0.0, k) == 0.0


def test_oracle_drafts_are_all_accepted_and_output_is_plain() -> None:
    reqs = make_requests(6, seed=11, max_new_tokens=25)
    expected = _run(*make_scheduler(), reqs)
    sched, col, _ = _oracle_scheduler(reqs, expected, speculative_num_draft_tokens=4)
    assert _run(sched, col, reqs) == expected
    stats = _stats(sched)
    assert stats["spec_num_draft_tokens"] > 0
    assert stats["spec_accept_rate"] == 1.0 and stats["spec_accept_length"] > 4.0
    assert stats["spec_oracle_diverged"] == 0 and stats["spec_oracle_spoiled"] == 0
    assert sched.counters.num_forward_passes < sum(len(v) for v in expected.values()) / 3
    assert_no_leak(sched)


def test_oracle_acceptance_spoils_a_seeded_fraction() -> None:
    reqs = make_requests(16, seed=12, max_new_tokens=60)
    expected = _run(*make_scheduler(), reqs)
    rates = []
    for _ in range(2):  # the same seed spoils the same proposals
        sched, col, _ = _oracle_scheduler(reqs, expected, acceptance=0.7, speculative_num_draft_tokens=4)
        assert _run(sched, col, reqs) == expected
        stats = _stats(sched)
        assert stats["spec_oracle_spoiled"] > 0 and stats["spec_oracle_diverged"] == 0
        rates.append(stats["spec_accept_rate"])
        assert_no_leak(sched)
    assert rates[0] == rates[1]
    assert rates[0] == pytest.approx(0.7, abs=0.08)


def test_oracle_at_a_draft_models_cost(tmp_path: Path) -> None:
    reqs = make_requests(5, seed=13, shared_prefix_len=4, max_new_tokens=18)
    expected = _run(*make_scheduler(), reqs)
    sched, col, proposer = _oracle_scheduler(reqs, expected, speculative_num_draft_tokens=3,
                                             speculative_draft_model=str(write_model_dir(tmp_path / "draft")),
                                             speculative_draft_load_format="dummy")
    assert _run(sched, col, reqs) == expected
    stats = _stats(sched)
    assert stats["spec_accept_rate"] == 1.0
    assert stats["spec_draft_passes"] > 0  # the draft model ran, though its tokens were not used
    assert proposer.cost is not None and proposer.relative_cost > 0
    assert_no_leak(sched)
    assert sched.flush_cache()
    kv = proposer.cost.kv
    assert kv.allocator.available_size() == kv.capacity, "draft KV slots leaked"


def test_a_request_leaving_its_recording_gets_no_more_drafts() -> None:
    reqs = make_requests(2, seed=14, max_new_tokens=20)
    expected = _run(*make_scheduler(), reqs)
    wrong = dict(expected)
    first = reqs[0].rid
    wrong[first] = expected[first][:5] + [(t + 1) % 101 for t in expected[first][5:]]
    sched, col, _ = _oracle_scheduler(reqs, wrong, speculative_num_draft_tokens=4)
    assert _run(sched, col, reqs) == expected
    assert _stats(sched)["spec_oracle_diverged"] == 1
    assert_no_leak(sched)


def test_a_tie_margin_keeps_the_target_on_its_recording() -> None:
    """With a margin wider than any logit gap, every verify row emits the recorded token: what the oracle does for
    random bf16 weights' near-ties, here forced with a recording that leaves the target's argmax at token 5."""
    reqs = make_requests(2, seed=14, max_new_tokens=20)
    expected = _run(*make_scheduler(), reqs)
    wrong = dict(expected)
    first = reqs[0].rid
    wrong[first] = expected[first][:5] + [(t + 1) % 101 for t in expected[first][5:]]
    sched, col, proposer = _oracle_scheduler(reqs, wrong, speculative_num_draft_tokens=4)
    proposer.set_tie_margin(1e9)
    assert _run(sched, col, reqs) == wrong
    stats = _stats(sched)
    assert stats["spec_oracle_diverged"] == 0 and stats["spec_accept_rate"] == 1.0
    assert stats["spec_oracle_snapped"] >= 15  # every row of the altered tail changed (others need no snap)
    assert_no_leak(sched)
    with pytest.raises(ValueError, match="tie margin"):
        proposer.set_tie_margin(-1.0)


def test_bench_speculative_oracle_on_cpu(tmp_path: Path) -> None:
    model = write_model_dir(tmp_path / "tiny", vocab_size=512)
    result = tmp_path / "spec.jsonl"
    args = build_parser().parse_args([
        "bench", "speculative", "--oracle", "--oracle-acceptance", "1.0,0.6", "--model", str(model),
        "--load-format", "dummy", "--device", "cpu", "--dtype", "float32", "--workload", "random",
        "--input-len", "12", "--output-len", "24", "--batch-sizes", "1,2", "--speculative-num-draft-tokens", "4",
        "--disable-speculative-backoff", "--result-file", str(result)])
    assert args.func(args) == 0
    rows = [json.loads(line) for line in result.read_text().splitlines()]
    assert [(r["oracle_acceptance"], r["batch_size"]) for r in rows] == [(1.0, 1), (1.0, 2), (0.6, 1), (0.6, 2)]
    for row in rows:
        assert row["speculative_algorithm"] == "oracle"
        assert row["identical_outputs"] == f"{row['num_requests']}/{row['num_requests']}"
        assert row["oracle_diverged"] == 0
    assert all(r["accept_rate"] == 1.0 and r["mean_accept_length"] > 4.0 for r in rows[:2])
    assert all(0.2 < r["accept_rate"] < 1.0 for r in rows[2:])
