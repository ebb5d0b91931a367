"""How `radixmesh bench lora-routing` scores a run: hits by the workers' own lists, random routing over the same
requests, requests per adapter and worker."""

from __future__ import annotations

import argparse

from radixmesh.cluster.bench_lora import register_lora_routing
from radixmesh.cluster.lora_affinity import AffinityRun


def _run(landed: list[tuple[str, str]]) -> AffinityRun:
    run = AffinityRun(placement={"a": "w0", "b": "w1"}, holders={"a": ["w0"], "b": ["w1", "w0"]},
                      workers=["w0", "w1"])
    run.landed = landed
    return run


def test_hits_count_workers_holding_the_adapter() -> None:
    run = _run([("a", "w0"), ("a", "w1"), ("b", "w1"), ("b", "w0"), ("a", "")])
    assert run.hit_rate() == 3 / 5
    assert run.random_expected() == (0.5 + 0.5 + 1 + 1 + 0.5) / 5
    assert run.per_adapter() == {"a": {"failed": 1, "w0": 1, "w1": 1}, "b": {"w0": 1, "w1": 1}}


def test_random_routing_is_seeded_and_scored_over_the_same_requests() -> None:
    run = _run([("a", "w0")] * 200)
    rate = run.random_hit_rate(seed=3)
    assert rate == run.random_hit_rate(seed=3) and 0.4 < rate < 0.6
    assert _run([("b", "w1")] * 10).random_hit_rate(seed=3) == 1.0  # b is on every worker
    summary = run.summary(seed=3)
    assert (summary["hit_rate"], summary["requests"], summary["workers"], summary["adapters"]) == (1.0, 200, 2, 2)


def test_command_flags() -> None:
    parser = argparse.ArgumentParser()
    register_lora_routing(parser.add_subparsers())
    args = parser.parse_args(["lora-routing", "--requests", "8", "--lora-paths", "x=/a/x"])
    assert (args.requests, args.workers, args.adapters, args.lora_paths) == (8, 2, 4, ["x=/a/x"])
