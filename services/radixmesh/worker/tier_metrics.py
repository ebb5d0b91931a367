"""Prometheus series of the cache tiers and of prefix sharing between workers (docs/hicache.md).

From the scheduler's stats (refreshed with the engine series): prompt tokens served by tier (device,
host, peer), bytes moved between the device pool and the host tier, host loads and their summed
latency (rate(seconds) / rate(loads) is the mean), the host tier's size. Observed in the front end:
fetches from peers by outcome, their time, bytes and tokens.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import REGISTRY, Counter, Histogram
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from radixmesh.common.metrics import TRANSFER_BUCKETS_S
from radixmesh.worker.metrics import ENGINE_STATS

PEER_FETCH_OUTCOMES = ("committed", "fallback", "skipped")
PEER_FETCHES = Counter("radixmesh_peer_fetches", "Prompt prefixes a router offered from a peer worker, by what became "
                       "of them (committed: fetched and used; fallback: tried, computed here; skipped: computed here "
                       "by the cost model or because this worker held them)", ["outcome"])
PEER_FETCH_SECONDS = Histogram("radixmesh_peer_fetch_seconds", "Time of one prefix fetch, from the reservation to the "
                               "KV in this worker's pool", buckets=TRANSFER_BUCKETS_S)
PEER_FETCH_BYTES = Counter("radixmesh_peer_fetch_bytes", "KV bytes of prompt prefixes moved between workers",
                           ["direction"])
PEER_FETCH_TOKENS = Counter("radixmesh_peer_fetch_tokens", "Prompt tokens whose KV this worker fetched from peers")


class TierStatsCollector(Collector):
    """The cache-tier series from the scheduler's last stats (the hierarchical cache's, when it is on)."""

    def collect(self) -> Iterator[Metric]:
        stats = ENGINE_STATS.stats
        host = float(stats.get("hicache_host_hit_tokens", 0))
        peer = float(stats.get("peer_fetched_tokens", 0))
        hits = CounterMetricFamily("radixmesh_cache_hit_tokens", "Prompt tokens served from cache, by the tier their "
                                   "KV came from (device: the device pool; host: loaded from the host tier; peer: "
                                   "fetched from another worker)", labels=["tier"])
        hits.add_metric(["device"], max(0.0, float(stats.get("num_cached_tokens", 0)) - host - peer))
        hits.add_metric(["host"], host)
        hits.add_metric(["peer"], peer)
        yield hits
        moved = CounterMetricFamily("radixmesh_hicache_bytes", "KV bytes copied between the device pool and the host "
                                    "tier (write: device to host; load: host to device)", labels=["direction"])
        moved.add_metric(["write"], float(stats.get("hicache_write_bytes", 0)))
        moved.add_metric(["load"], float(stats.get("hicache_load_bytes", 0)))
        yield moved
        yield CounterMetricFamily("radixmesh_hicache_loads", "Loads from the host tier",
                                  value=float(stats.get("hicache_num_loads", 0)))
        yield CounterMetricFamily("radixmesh_hicache_load_seconds", "Summed time of the loads from the host tier, "
                                  "from start to the KV in the pool", value=float(stats.get("hicache_load_s_total", 0)))
        yield GaugeMetricFamily("radixmesh_hicache_host_tokens", "Tokens whose KV the host tier holds",
                                value=float(stats.get("hicache_host_tokens", 0)))
        yield GaugeMetricFamily("radixmesh_hicache_host_capacity_tokens", "Tokens the host tier can hold (0: no tier)",
                                value=float(stats.get("hicache_host_capacity_tokens", 0)))


def observe_peer_fetch(outcome: str, seconds: float | None = None, num_bytes: int = 0, num_tokens: int = 0) -> None:
    """One prefix offered by a router from a peer (outcome: committed | fallback | skipped)."""
    PEER_FETCHES.labels(outcome).inc()
    if seconds is not None:
        PEER_FETCH_SECONDS.observe(seconds)
    if num_bytes:
        PEER_FETCH_BYTES.labels("receive").inc(num_bytes)
    if num_tokens:
        PEER_FETCH_TOKENS.inc(num_tokens)


def observe_peer_export(num_bytes: int) -> None:
    PEER_FETCH_BYTES.labels("send").inc(num_bytes)


REGISTRY.register(TierStatsCollector())
for _outcome in PEER_FETCH_OUTCOMES:  # the series exist (at zero) from the start
    PEER_FETCHES.labels(_outcome)
for _direction in ("receive", "send"):
    PEER_FETCH_BYTES.labels(_direction)
