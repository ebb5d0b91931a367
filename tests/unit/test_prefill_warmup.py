"""The prefills a CUDA server runs before reporting ready (scheduler/warmup.py), on the CPU scheduler."""

from __future__ import annotations

import pytest

from radixmesh.engine.scheduler import warmup as prefill_warmup
from radixmesh.engine.scheduler.warmup import decode_batches, wants_warmup, warm_up_prefill, warmup_lengths

from .scheduler_factory import assert_no_leak, clone, make_requests, make_scheduler, run_until_idle


def test_lengths_stop_at_the_chunk_the_context_and_the_pool() -> None:
    assert warmup_lengths(4096, 8192, 400_000)[-1] == 4096
    assert warmup_lengths(0, 8192, 400_000)[-1] == 6000  # no chunking: up to the context length
    assert warmup_lengths(4096, 130, 400_000)[-1] == 128
    assert warmup_lengths(4096, 8192, 300)[-1] == 256
    assert warmup_lengths(4096, 2, 300) == []


def test_decode_batches_stop_at_the_running_limit_and_the_pool() -> None:
    assert decode_batches(256, 455_762) == [1, 2, 3, 5, 9, 17, 33, 65, 129, 256]  # the largest batch added
    assert decode_batches(256, 2048) == [1, 2, 3, 5, 9, 17, 33, 65, 129, 170]  # 12 tokens a request
    assert decode_batches(4, 10_000) == [1, 2, 3, 4]
    assert decode_batches(257, 10**6)[-1] == 257
    assert decode_batches(8, 2) == []


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_warm_up_leaves_nothing_behind_and_outputs_unchanged(monkeypatch: pytest.MonkeyPatch, overlap: str) -> None:
    monkeypatch.setattr(prefill_warmup, "WARMUP_LENGTHS", (1, 7, 16, 33, 100, 200, 300))
    monkeypatch.setattr(prefill_warmup, "DECODE_BATCHES", (1, 3, 5))
    monkeypatch.setattr(prefill_warmup, "MIXED_PAIR", (40, 5))
    reqs = make_requests(6, seed=3, max_new_tokens=8)
    cold, cold_out = make_scheduler(overlap_schedule=overlap, max_total_tokens=2048, context_length=256,
                                    chunked_prefill_size=64)
    for req in map(clone, reqs):
        cold.add_request(req)
    run_until_idle(cold)

    warm, warm_out = make_scheduler(overlap_schedule=overlap, max_total_tokens=2048, context_length=256,
                                    chunked_prefill_size=64)
    emitted_before = dict(warm_out.tokens)
    seen: dict[str, object] = {}
    reset = warm.reset_counters
    monkeypatch.setattr(warm, "reset_counters", lambda: (seen.update(warm.stats()), reset()))
    assert warm_up_prefill(warm) > 0
    # the lengths up to the chunk size, each prefilled, then batches of 1, 3, 5 and the running limit (8 tokens each)
    sizes = decode_batches(warm.runner.plan.max_running_requests, warm.kv.capacity)
    assert sizes[:3] == [1, 3, 5] and len(sizes) == 4
    assert seen["num_prompt_tokens"] == 1 + 7 + 16 + 33 + 40 + 5 + sum(sizes) * 8
    assert seen["num_generated_tokens"] == 4 + 2 + sum(sizes) * 4
    # (the short decode prompts may share a first token in this small vocabulary; the long ones never match)
    assert seen["num_cached_tokens"] < sum(sizes) * 8
    assert warm_out.tokens == emitted_before, "warm-up tokens reached the server's outputs"
    assert warm.kv.tree.total_size() == 0 and warm.kv.used_tokens() == 0
    stats = warm.stats()
    assert stats["num_prompt_tokens"] == stats["num_generated_tokens"] == stats["num_forward_passes"] == 0
    assert warm.decode.new_token_ratio == warm.config.init_new_token_ratio
    for req in map(clone, reqs):
        warm.add_request(req)
    run_until_idle(warm)
    assert warm_out.tokens == cold_out.tokens and warm_out.cached == cold_out.cached
    assert_no_leak(warm)


def test_only_a_plain_cuda_server_warms_up() -> None:
    from types import SimpleNamespace

    from radixmesh.engine.config import EngineConfig

    def sched(device: str = "cuda", mm: object = None) -> SimpleNamespace:
        return SimpleNamespace(runner=SimpleNamespace(device=SimpleNamespace(type=device), mm=mm))

    plain = EngineConfig(device="cpu")
    assert wants_warmup(plain, sched())  # type: ignore[arg-type]
    assert not wants_warmup(plain, sched("cpu"))  # type: ignore[arg-type]
    assert not wants_warmup(EngineConfig(device="cpu", disable_prefill_warmup=True), sched())  # type: ignore[arg-type]
    assert not wants_warmup(EngineConfig(device="cpu", enable_hierarchical_cache=True), sched())  # type: ignore[arg-type]
    assert not wants_warmup(plain, sched(mm=object()))  # type: ignore[arg-type]
