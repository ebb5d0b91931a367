"""A worker's load: one type (`WorkerLoad`) the worker reports, the router scores and the gateway shows, with one
converter pair to and from the protobuf `WorkerLoad`.

The scheduler's stats dict (SGLang's /get_server_info names) enters through `WorkerLoad.from_stats` and leaves
through `WorkerLoad.as_stats`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from radixmesh.protocol import common_pb2


@dataclass(frozen=True)
class WorkerLoad:
    """A worker's load as its last GetLoad reported it (token counts unless named num_*_reqs)."""

    num_running_reqs: int = 0
    """Sequences running (decode or chunked prefill)."""
    num_waiting_reqs: int = 0
    """Sequences queued for admission."""
    num_queued_prefill_tokens: int = 0
    """Uncached prompt tokens still to prefill."""
    num_running_decode_tokens: int = 0
    """Tokens held by running sequences."""
    kv_used_tokens: int = 0
    """KV slots in use."""
    max_total_tokens: int = 0
    """KV capacity (0: unknown)."""
    kv_usage: float = 0.0
    """kv_used_tokens / max_total_tokens."""
    cache_hit_rate: float = 0.0
    """Cached prompt tokens / prompt tokens since the worker started."""
    max_running_requests: int = 0
    """Most sequences the worker runs at once (0: unknown)."""
    lora_adapters: tuple[tuple[str, int, int], ...] = ()
    """LoRA adapters loaded on the worker: (name, running sequences, waiting sequences)."""
    max_loras_per_batch: int = 0
    """Adapters one batch may mix (0: the worker serves none)."""

    @property
    def adapter_names(self) -> frozenset[str]:
        return frozenset(name for name, _, _ in self.lora_adapters)

    @classmethod
    def from_stats(cls, stats: Mapping[str, Any]) -> WorkerLoad:
        """The load in a scheduler's stats dict (keys as in `Scheduler.stats`; missing ones are 0)."""
        return cls(
            num_running_reqs=int(stats.get("num_running_reqs", 0)),
            num_waiting_reqs=int(stats.get("num_waiting_reqs", 0)),
            num_queued_prefill_tokens=int(stats.get("num_queued_prefill_tokens", 0)),
            num_running_decode_tokens=int(stats.get("num_running_decode_tokens", 0)),
            kv_used_tokens=int(stats.get("kv_used_tokens", 0)),
            max_total_tokens=int(stats.get("max_total_num_tokens", 0)),
            kv_usage=float(stats.get("kv_usage", 0.0)),
            cache_hit_rate=float(stats.get("cache_hit_rate", 0.0)),
            max_running_requests=int(stats.get("max_running_requests", 0)),
            lora_adapters=_adapters_of(stats), max_loras_per_batch=int(stats.get("max_loras_per_batch", 0)))

    def as_stats(self) -> dict[str, Any]:
        """The stats dict shape (SGLang's /get_server_info names)."""
        return {
            "num_running_reqs": self.num_running_reqs, "num_waiting_reqs": self.num_waiting_reqs,
            "num_queued_prefill_tokens": self.num_queued_prefill_tokens,
            "num_running_decode_tokens": self.num_running_decode_tokens,
            "kv_used_tokens": self.kv_used_tokens, "max_total_num_tokens": self.max_total_tokens,
            "kv_usage": self.kv_usage, "cache_hit_rate": self.cache_hit_rate,
            "max_running_requests": self.max_running_requests,
            **({"lora_adapters": [n for n, _, _ in self.lora_adapters],
                "lora_running": {n: r for n, r, _ in self.lora_adapters if r},
                "lora_waiting": {n: w for n, _, w in self.lora_adapters if w},
                "max_loras_per_batch": self.max_loras_per_batch} if self.max_loras_per_batch else {}),
        }


def _adapters_of(stats: Mapping[str, Any]) -> tuple[tuple[str, int, int], ...]:
    running, waiting = stats.get("lora_running") or {}, stats.get("lora_waiting") or {}
    return tuple((str(n), int(running.get(n, 0)), int(waiting.get(n, 0))) for n in stats.get("lora_adapters") or ())


def load_to_proto(load: WorkerLoad) -> common_pb2.WorkerLoad:
    return common_pb2.WorkerLoad(
        num_running_reqs=load.num_running_reqs, num_waiting_reqs=load.num_waiting_reqs,
        num_queued_prefill_tokens=load.num_queued_prefill_tokens,
        num_running_decode_tokens=load.num_running_decode_tokens, kv_used_tokens=load.kv_used_tokens,
        max_total_tokens=load.max_total_tokens, kv_usage=load.kv_usage, cache_hit_rate=load.cache_hit_rate,
        max_running_requests=load.max_running_requests, max_loras_per_batch=load.max_loras_per_batch,
        lora_adapters=[common_pb2.AdapterLoad(name=n, num_running_reqs=r, num_waiting_reqs=w)
                       for n, r, w in load.lora_adapters])


def load_from_proto(load: common_pb2.WorkerLoad) -> WorkerLoad:
    return WorkerLoad(num_running_reqs=load.num_running_reqs, num_waiting_reqs=load.num_waiting_reqs,
                      num_queued_prefill_tokens=load.num_queued_prefill_tokens,
                      num_running_decode_tokens=load.num_running_decode_tokens,
                      kv_used_tokens=load.kv_used_tokens, max_total_tokens=load.max_total_tokens,
                      kv_usage=load.kv_usage, cache_hit_rate=load.cache_hit_rate,
                      max_running_requests=load.max_running_requests, max_loras_per_batch=load.max_loras_per_batch,
                      lora_adapters=tuple((a.name, a.num_running_reqs, a.num_waiting_reqs)
                                          for a in load.lora_adapters))


def sum_loads(loads: Iterable[WorkerLoad]) -> WorkerLoad:
    """Several workers' loads as one (the router's GetLoad): counts added, the hit rate averaged."""
    loads = list(loads)
    used = sum(load.kv_used_tokens for load in loads)
    capacity = sum(load.max_total_tokens for load in loads)
    return WorkerLoad(
        num_running_reqs=sum(load.num_running_reqs for load in loads),
        num_waiting_reqs=sum(load.num_waiting_reqs for load in loads),
        num_queued_prefill_tokens=sum(load.num_queued_prefill_tokens for load in loads),
        num_running_decode_tokens=sum(load.num_running_decode_tokens for load in loads),
        kv_used_tokens=used, max_total_tokens=capacity, kv_usage=used / capacity if capacity else 0.0,
        cache_hit_rate=sum(load.cache_hit_rate for load in loads) / len(loads) if loads else 0.0)
