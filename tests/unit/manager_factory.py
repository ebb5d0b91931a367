"""Small factories for the scheduler's parts on their own: KV memory without a model, requests, sampled results."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from radixmesh.engine.batch import LaunchedBatch, ScheduleBatch, commit_batch
from radixmesh.engine.config import EngineConfig
from radixmesh.engine.kv_manager import KVCacheManager
from radixmesh.engine.memory import KVSlotAllocator, ReqToTokenPool, TokenToKVPool
from radixmesh.engine.radix_cache import RadixCache
from radixmesh.engine.request import FinishReason, Req
from radixmesh.engine.sampling.sampler import HostSample
from radixmesh.engine.scheduler.counters import SchedulerCounters
from radixmesh.engine.scheduler.decode import DecodeManager
from radixmesh.engine.scheduler.hooks import HookSet, SchedulerHook
from radixmesh.engine.scheduler.prefill import PrefillManager
from radixmesh.engine.scheduler.results import ResultProcessor
from radixmesh.wire.messages import TokenOut
from radixmesh.wire.sampling import SamplingParams

CONTEXT_LEN = 64


def make_config(**overrides: Any) -> EngineConfig:
    settings: dict[str, Any] = dict(device="cpu", dtype="float32", max_total_tokens=64, max_running_requests=8,
                                    load_format="dummy")
    settings.update(overrides)
    return EngineConfig(**settings).resolve()


def make_kv(num_tokens: int = 64, num_rows: int = 8, context_len: int = CONTEXT_LEN,
            disable_cache: bool = False) -> KVCacheManager:
    """KV memory of `num_tokens` slots and `num_rows` request rows, with its radix tree (no model)."""
    allocator = KVSlotAllocator(num_tokens, "cpu", check_double_free=True)
    pool = TokenToKVPool(num_tokens, 1, 1, 2, torch.float32, "cpu")
    return KVCacheManager(ReqToTokenPool(num_rows, context_len + 1, "cpu"), pool, allocator,
                          RadixCache(allocator, disable=disable_cache))


def req(rid: str, prompt_len: int = 4, max_new_tokens: int = 8, first_id: int = 1, **params: Any) -> Req:
    """A greedy request whose prompt is `prompt_len` consecutive ids from `first_id`."""
    return Req(rid=rid, origin_input_ids=list(range(first_id, first_id + prompt_len)),
               params=SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, **params))


@dataclass
class Emitted:
    """Collects what a part emits."""

    outputs: list[TokenOut] = field(default_factory=list)

    def __call__(self, outputs: list[TokenOut]) -> None:
        self.outputs.extend(outputs)

    def of(self, rid: str) -> list[TokenOut]:
        return [o for o in self.outputs if o.rid == rid]

    def tokens(self, rid: str) -> list[int]:
        return [t for o in self.of(rid) for t in o.token_ids]


@dataclass
class Parts:
    """The three parts of a scheduler wired as `Scheduler.__init__` wires them, over KV memory without a model."""

    config: EngineConfig
    kv: KVCacheManager
    counters: SchedulerCounters
    hooks: HookSet
    prefill: PrefillManager
    decode: DecodeManager
    results: ResultProcessor
    emitted: Emitted


def make_parts(hooks: list[SchedulerHook] | None = None, num_tokens: int = 64, num_rows: int = 8,
               eos_ids: set[int] | None = None, disable_cache: bool = False, **config: Any) -> Parts:
    cfg = make_config(max_total_tokens=num_tokens, **config)
    kv = make_kv(num_tokens, num_rows, disable_cache=disable_cache)
    counters, hook_set, emitted = SchedulerCounters(), HookSet(hooks), Emitted()
    prefill = PrefillManager(cfg, kv, counters, hook_set)
    results_box: list[ResultProcessor] = []
    decode = DecodeManager(cfg, kv, counters, hook_set, CONTEXT_LEN, prefill.requeue,
                           lambda r, reason: results_box[0].finish(r, reason))
    results = ResultProcessor(kv, counters, hook_set, decode.running, emitted, eos_ids or set(), CONTEXT_LEN, None)
    results_box.append(results)
    return Parts(cfg, kv, counters, hook_set, prefill, decode, results, emitted)


class FixedSample:
    """A launched batch's results, already on the host (stands in for `SampleOutput`)."""

    def __init__(self, host: HostSample) -> None:
        self.host = host
        self.reads = 0

    def to_host(self) -> HostSample:
        self.reads += 1
        return self.host


def launch(batch: ScheduleBatch, launch_id: int, token_ids: list[int], running: list[Req] | None = None,
           **host: Any) -> LaunchedBatch:
    """Do what `Scheduler.launch` does without a device: commit the batch, give every request that samples a
    future, move prefilled requests to `running`; its "sampled" tokens are `token_ids`, one per row."""
    commit_batch(batch)
    for row, r in enumerate(batch.reqs):
        if r.is_chunked:
            continue
        r.futures.append((launch_id, row))
        if not batch.is_decode and running is not None:
            running.append(r)
    sampled: Any = FixedSample(HostSample(token_ids, **host))
    return LaunchedBatch(launch_id, batch, sampled)


def slots_accounted(kv: KVCacheManager, held_by_requests: int = 0) -> bool:
    """Every slot is free, in the tree, or held by a live request (`held_by_requests` of them)."""
    return kv.allocator.available_size() + kv.tree.total_size() + held_by_requests == kv.capacity


FINISHED = {FinishReason.LENGTH, FinishReason.STOP, FinishReason.ABORT, FinishReason.ERROR}
