"""LoRA adapter affinity measured on a running cluster (`radixmesh bench lora-routing` and its test).

Adapters are placed through the gateway (`/load_lora_adapter` with `worker_id`: adapter i on worker i mod N), the
requests go through the router (gRPC Generate: the first message's routing info names the worker that ran it), and
each worker's own `ListLoraAdapters` says which adapters it holds. A hit: the request ran on a worker holding its
adapter. Random routing is scored over the same requests: each one given a worker drawn uniformly (seeded), as a
router blind to adapters would send it (such a request fails there, or waits for the adapter to load).
"""

from __future__ import annotations

import random
import statistics
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import grpc
import httpx

from radixmesh.protocol import common_pb2, router_pb2, router_pb2_grpc, sampling_pb2, worker_pb2, worker_pb2_grpc


@dataclass
class AffinityRun:
    """What one run measured."""

    placement: dict[str, str]
    """adapter -> the worker it was loaded on."""
    holders: dict[str, list[str]]
    """adapter -> the workers whose own list names it (after placement)."""
    workers: list[str]
    """Serving workers, as the router names them."""
    landed: list[tuple[str, str]] = field(default_factory=list)
    """(adapter, worker that ran the request; "" when it failed), in request order."""
    errors: list[str] = field(default_factory=list)
    route_s: list[float] = field(default_factory=list)
    """Wall time of each request (its whole stream)."""

    def hit_rate(self) -> float:
        hits = sum(1 for adapter, worker in self.landed if worker in self.holders.get(adapter, []))
        return hits / max(len(self.landed), 1)

    def random_hit_rate(self, seed: int) -> float:
        """The same requests, each sent to a worker drawn uniformly."""
        rng = random.Random(seed)
        hits = sum(1 for adapter, _ in self.landed if rng.choice(self.workers) in self.holders.get(adapter, []))
        return hits / max(len(self.landed), 1)

    def random_expected(self) -> float:
        """The expectation of random routing: per request, the share of workers holding its adapter."""
        shares = [len(self.holders.get(a, [])) / len(self.workers) for a, _ in self.landed]
        return sum(shares) / max(len(shares), 1)

    def per_adapter(self) -> dict[str, dict[str, int]]:
        counts: dict[str, Counter[str]] = {}
        for adapter, worker in self.landed:
            counts.setdefault(adapter, Counter())[worker or "failed"] += 1
        return {a: dict(sorted(c.items())) for a, c in sorted(counts.items())}

    def summary(self, seed: int) -> dict[str, Any]:
        return {"workers": len(self.workers), "adapters": len(self.placement), "requests": len(self.landed),
                "failed": len(self.errors), "hit_rate": round(self.hit_rate(), 4),
                "random_hit_rate": round(self.random_hit_rate(seed), 4),
                "random_expected": round(self.random_expected(), 4), "placement": self.placement,
                "landed": self.per_adapter(),
                "request_ms_p50": round(statistics.median(self.route_s) * 1000, 1) if self.route_s else None}


def serving_workers(router_address: str) -> dict[str, str]:
    """worker id -> address of the router's healthy unified and decode workers."""
    with grpc.insecure_channel(router_address) as channel:
        reply = router_pb2_grpc.RouterServiceStub(channel).ListWorkers(router_pb2.ListWorkersRequest(), timeout=10)
    serving = (common_pb2.WORKER_ROLE_UNIFIED, common_pb2.WORKER_ROLE_DECODE)
    return {w.worker_id: w.address for w in sorted(reply.workers, key=lambda w: w.worker_id)
            if w.healthy and w.role in serving}


def place_adapters(gateway_url: str, adapters: dict[str, str], workers: list[str],
                   timeout_s: float = 300.0) -> dict[str, str]:
    """Load adapter i (in name order) on worker i mod N through the gateway; adapter -> worker."""
    placement = {}
    with httpx.Client(base_url=gateway_url, timeout=timeout_s) as client:
        for i, (name, path) in enumerate(sorted(adapters.items())):
            worker = workers[i % len(workers)]
            reply = client.post("/load_lora_adapter", json={"lora_name": name, "lora_path": path,
                                                            "worker_id": worker})
            if reply.status_code != 200:
                raise RuntimeError(f"loading {name} on {worker} failed: {reply.status_code} {reply.text}")
            placement[name] = worker
    return placement


def unload_adapters(gateway_url: str, names: list[str]) -> None:
    with httpx.Client(base_url=gateway_url, timeout=60.0) as client:
        for name in names:
            client.post("/unload_lora_adapter", json={"lora_name": name})


def held_adapters(workers: dict[str, str]) -> dict[str, list[str]]:
    """adapter -> the workers whose own ListLoraAdapters names it."""
    holders: dict[str, list[str]] = {}
    for worker_id, address in workers.items():
        with grpc.insecure_channel(address) as channel:
            reply = worker_pb2_grpc.WorkerServiceStub(channel).ListLoraAdapters(common_pb2.ListLoraAdaptersRequest(),
                                                                                timeout=10)
        for adapter in reply.adapters:
            holders.setdefault(adapter.name, []).append(worker_id)
    return holders


def route_requests(router_address: str, run: AffinityRun, num_requests: int, prompt_len: int,
                   max_new_tokens: int, seed: int, vocab: int) -> None:
    """Send `num_requests` requests through the router, one after another, each adapter as often as the others
    (within one) in a seeded random order, each with a random prompt; record where each ran."""
    rng = random.Random(seed)
    names = sorted(run.placement)
    order = (names * (num_requests // len(names) + 1))[:num_requests]
    rng.shuffle(order)
    with grpc.insecure_channel(router_address) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        for adapter in order:
            ids = [rng.randrange(min(100, vocab - 1), vocab) for _ in range(prompt_len)]
            request = worker_pb2.GenerateRequest(
                request_id=uuid.uuid4().hex, token_ids=ids, lora_name=adapter,
                sampling_params=sampling_pb2.SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0,
                                                             ignore_eos=True))
            start = time.perf_counter()
            worker = ""
            try:
                for msg in stub.Generate(request, timeout=120):
                    worker = worker or msg.routing.worker_id
            except grpc.RpcError as exc:
                run.errors.append(f"{adapter}: {exc.code().name} {exc.details()}")
                worker = ""
            run.route_s.append(time.perf_counter() - start)
            run.landed.append((adapter, worker))


def measure(gateway_url: str, router_address: str, adapters: dict[str, str], num_requests: int,
            prompt_len: int = 8, max_new_tokens: int = 2, seed: int = 0) -> AffinityRun:
    """Place `adapters` (name -> path on the workers) one per worker in turn, then route the requests."""
    workers = serving_workers(router_address)
    if not workers:
        raise RuntimeError(f"the router at {router_address} has no healthy serving worker")
    placement = place_adapters(gateway_url, adapters, list(workers))
    run = AffinityRun(placement, held_adapters(workers), list(workers))
    route_requests(router_address, run, num_requests, prompt_len, max_new_tokens, seed, vocab_size(router_address))
    return run


def vocab_size(router_address: str) -> int:
    with grpc.insecure_channel(router_address) as channel:
        info = router_pb2_grpc.RouterServiceStub(channel).GetModelInfo(worker_pb2.GetModelInfoRequest(), timeout=60)
    return int(info.vocab_size)
