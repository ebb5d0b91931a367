"""One scenario end to end: idle KV baseline, load, fault, detection, healing, recovery, settled KV, RSS."""

from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import dataclass
from typing import Any

import httpx

from radixmesh.cluster.faults import integrity
from radixmesh.cluster.faults.harness import FaultCluster, wait_for
from radixmesh.cluster.faults.load import LoadGen, chat_stream, summarize
from radixmesh.cluster.faults.scenarios import Scenario

DETECT_WINDOW_S = 30.0
RECOVER_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class LoadShape:
    """The bounded load of every scenario."""

    concurrency: int = 6
    """Clients sending at once."""
    max_requests: int = 400
    """Cap on the requests of one scenario."""
    max_tokens: int = 24
    """Tokens per answer."""
    timeout_s: float = 60.0
    """A request with no end by then counts as hung."""
    after_recovery_s: float = 5.0
    """Load kept up once the cluster has recovered."""
    reference_requests: int = integrity.MAX_REFERENCE_REQUESTS
    """Most completed requests sent again, one at a time, to compare their texts (the affected ones first)."""


async def run_scenario(scenario: Scenario, shape: LoadShape) -> dict[str, Any]:
    cluster = scenario.cluster
    url = await scenario.setup()
    make_spec = functools.partial(chat_stream, max_tokens=shape.max_tokens)
    try:
        idle_kv = await asyncio.to_thread(cluster.settled_kv)
        migrations_before = await asyncio.to_thread(cluster.router_migrations)
        load = LoadGen(url, make_spec, shape.concurrency, shape.max_requests, shape.timeout_s)
        running = asyncio.create_task(load.run())
        await _until(lambda: load.num_streaming >= min(2, shape.concurrency) or running.done(), 300)
        fault_s, fault_at = load.now_s(), time.monotonic()
        scenario.fault_times = [fault_s]
        detect = asyncio.create_task(asyncio.to_thread(_poll_detected, scenario))
        await scenario.inject(load)
        await asyncio.sleep(max(0.0, scenario.hold_s - (time.monotonic() - fault_at)))
        heal_at = time.monotonic()
        await scenario.heal()
        recover_s = await asyncio.to_thread(_recover_s, cluster, url, heal_at)
        await asyncio.sleep(shape.after_recovery_s)
        load.stop()
        records = await running
        probe_s = await detect
        texts = await integrity.text_mismatches(url, make_spec, records, scenario.fault_times, shape.timeout_s,
                                                 shape.reference_requests)
        migrations = _delta(await asyncio.to_thread(cluster.router_migrations), migrations_before)
    finally:
        await scenario.teardown()
    records += getattr(scenario, "quitters", [])
    settled_kv = await asyncio.to_thread(cluster.settled_kv)
    summary = summarize(records, fault_s)
    detect_s = min((s for s in (probe_s, summary.pop("first_failure_s")) if s is not None), default=None)
    return {"scenario": scenario.id, "fault": scenario.fault, "hold_s": scenario.hold_s, **summary,
            "detect_s": round(detect_s, 3) if detect_s is not None else None,
            "detect_probe_s": probe_s, "recover_s": round(recover_s, 3),
            "fault_times_s": [round(t, 3) for t in scenario.fault_times],
            **integrity.token_counts(records, shape.max_tokens), **texts,
            "migration": {**integrity.migration_cost(records, scenario.fault_times), "router_migrations": migrations},
            "kv_idle": idle_kv, "kv_settled": settled_kv,
            "leaked_slots": sum(max(0, settled_kv[w] - idle_kv.get(w, 0)) for w in settled_kv),
            "rss_mb": await asyncio.to_thread(cluster.rss_mb), **scenario.extra()}


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, int]:
    """Migrations by reason during the scenario (a router restarted in it starts from zero again)."""
    return {reason: int(max(0.0, n - before.get(reason, 0.0))) for reason, n in after.items()}


async def _until(check: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError("the load did not start streaming")
        await asyncio.sleep(0.05)


def _poll_detected(scenario: Scenario) -> float | None:
    """Seconds from the fault until its probe first says the system noticed (None: no probe, or never)."""
    start = time.monotonic()
    while time.monotonic() - start < DETECT_WINDOW_S:
        try:
            seen = scenario.detected()
        except Exception:  # a probe that cannot reach what it asks counts as not yet
            seen = False
        if seen is None:
            return None
        if seen:
            return round(time.monotonic() - start, 3)
        time.sleep(0.1)
    return None


def _recover_s(cluster: FaultCluster, url: str, heal_at: float) -> float:
    """From the end of the fault until every service is healthy and a request through `url` succeeds."""
    def probe() -> bool:
        body = {"prompt": "Recovered?", "max_tokens": 1, "temperature": 0.0}
        return cluster.all_healthy() and httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 200

    wait_for(probe, RECOVER_TIMEOUT_S, "the cluster to recover")
    return time.monotonic() - heal_at
