"""Loading and unloading LoRA adapters across the workers: what a cluster's front door does with SGLang's
`/load_lora_adapter` and `/unload_lora_adapter` (the gateway sends them here, as RouterService calls).

A load goes to every healthy worker that serves adapters (unified and decode roles), or to the one `worker_id`
names; workers that already hold it are skipped, and a load that finds it on every one of them is INVALID_ARGUMENT
("already loaded"), as on one server. An unload goes to every worker holding it (NOT_FOUND naming the adapter when
none does), or to the named one. The calls run concurrently; a worker's error comes back with its own code (a bad
adapter: INVALID_ARGUMENT naming the mismatch), prefixed with the worker's id and followed by the workers that did
succeed (which keep the adapter: loading again completes the rest). Routing follows each success at once
(`AdapterAffinity.on_loaded` / `on_unloaded`), before the workers' published lists catch up.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from radixmesh.common.errors import ErrorCode, RadixMeshError, invalid_argument, not_found
from radixmesh.protocol import common_pb2
from radixmesh.router import metrics
from radixmesh.router.adapters import AdapterAffinity
from radixmesh.router.disagg import SERVING_ROLES
from radixmesh.router.workers import WorkerHandle, WorkerRegistry

logger = logging.getLogger(__name__)


@dataclass
class LoraControl:
    """Load, unload and list adapters over one registry, keeping the router's adapter affinity current."""

    registry: WorkerRegistry
    affinity: AdapterAffinity

    def _serving(self) -> list[WorkerHandle]:
        workers = [w for w in self.registry.all() if w.health.healthy and w.role in SERVING_ROLES]
        if not workers:
            raise RadixMeshError(ErrorCode.UNAVAILABLE, f"no healthy worker ({len(self.registry)} known)")
        leases = self.affinity.leases()
        return [w for w in workers if self.affinity.published(w, leases)[1] > 0] or workers

    def _named(self, worker_id: str) -> WorkerHandle:
        worker = self.registry.get(worker_id) or self.registry.by_index_id().get(worker_id)
        if worker is None:
            known = ", ".join(w.worker_id for w in self.registry.all()) or "none"
            raise not_found(f"no worker {worker_id!r} (known: {known})", "worker_id")
        return worker

    async def load(self, request: common_pb2.LoadLoraAdapterRequest) -> common_pb2.LoadLoraAdapterResponse:
        name = request.name
        if request.worker_id:
            targets = [self._named(request.worker_id)]
        else:
            leases = self.affinity.leases()
            serving = self._serving()
            targets = [w for w in serving if not self.affinity.holds(w, name, leases)]
            if not targets:
                raise invalid_argument(f"LoRA adapter {name!r} is already loaded on every worker "
                                       f"({', '.join(w.worker_id for w in serving)}); unload it first", "lora_name")
        results = await asyncio.gather(*(self._load_one(w, name, request.path, bool(request.worker_id))
                                         for w in targets),
                                       return_exceptions=True)
        done = [w for w, r in zip(targets, results) if not isinstance(r, BaseException)]
        for worker in done:
            self.affinity.on_loaded(worker, name)
            metrics.LORA_LOADS.labels(name, "api").inc()
        _raise_first(name, "loading", targets, results, done)
        replies = [r for r in results if isinstance(r, common_pb2.LoadLoraAdapterResponse)]
        reply = common_pb2.LoadLoraAdapterResponse(name=name, worker_ids=sorted(w.worker_id for w in done))
        if replies:
            first = replies[0]
            reply.rank, reply.load_s = first.rank, max(r.load_s for r in replies)
            reply.targets.extend(first.targets)
        logger.info("loaded LoRA adapter %s on %s", name, ", ".join(reply.worker_ids))
        return reply

    @staticmethod
    async def _load_one(worker: WorkerHandle, name: str, path: str,
                        named: bool) -> common_pb2.LoadLoraAdapterResponse | None:
        """The worker's answer; None when it already held the adapter (its published list lagged)."""
        try:
            reply: common_pb2.LoadLoraAdapterResponse = await worker.client.load_lora_adapter(name, path)
        except RadixMeshError as exc:
            if not named and exc.code is ErrorCode.INVALID_ARGUMENT and "already loaded" in exc.message:
                return None
            raise
        return reply

    async def unload(self, request: common_pb2.UnloadLoraAdapterRequest) -> common_pb2.UnloadLoraAdapterResponse:
        name = request.name
        if request.worker_id:
            targets = [self._named(request.worker_id)]
        else:
            leases = self.affinity.leases()
            targets = [w for w in self._serving() if self.affinity.holds(w, name, leases)]
            if not targets:
                raise not_found(f"LoRA adapter {name!r} is not loaded on any worker", "lora_name")
        results = await asyncio.gather(*(self._unload_one(w, name, bool(request.worker_id)) for w in targets),
                                       return_exceptions=True)
        done = [w for w, r in zip(targets, results) if not isinstance(r, BaseException)]
        for worker in done:
            self.affinity.on_unloaded(worker, name)
        _raise_first(name, "unloading", targets, results, done)
        logger.info("unloaded LoRA adapter %s from %s", name, ", ".join(w.worker_id for w in done))
        return common_pb2.UnloadLoraAdapterResponse(worker_ids=sorted(w.worker_id for w in done))

    @staticmethod
    async def _unload_one(worker: WorkerHandle, name: str, named: bool) -> None:
        try:
            await worker.client.unload_lora_adapter(name)
        except RadixMeshError as exc:
            if named or exc.code is not ErrorCode.NOT_FOUND:  # not there after all: its list lagged
                raise

    async def list(self) -> common_pb2.ListLoraAdaptersResponse:
        """Every healthy serving worker's adapters, merged by name (each with the workers holding it)."""
        workers = [w for w in self.registry.all() if w.health.healthy and w.role in SERVING_ROLES]
        results = await asyncio.gather(*(w.client.list_lora_adapters() for w in workers), return_exceptions=True)
        merged: dict[str, common_pb2.LoraAdapterInfo] = {}
        for worker, result in zip(workers, results):
            if isinstance(result, BaseException):
                logger.warning("listing LoRA adapters of worker %s failed: %s", worker.worker_id, result)
                continue
            for info in result:
                entry = merged.setdefault(info.name, common_pb2.LoraAdapterInfo(
                    name=info.name, path=info.path, rank=info.rank, targets=list(info.targets)))
                entry.worker_ids.append(worker.worker_id)
        return common_pb2.ListLoraAdaptersResponse(adapters=[merged[n] for n in sorted(merged)])


def _raise_first(name: str, verb: str, targets: list[WorkerHandle], results: list[Any],
                 done: list[WorkerHandle]) -> None:
    """Raise the first worker's error with its code, naming that worker and those that succeeded."""
    for worker, result in zip(targets, results):
        if isinstance(result, RadixMeshError):
            ok = f" ({verb} succeeded on {', '.join(w.worker_id for w in done)})" if done else ""
            raise RadixMeshError(result.code, f"worker {worker.worker_id}: {result.message}{ok}",
                                 result.param) from result
        if isinstance(result, BaseException):
            raise RadixMeshError(ErrorCode.INTERNAL, f"LoRA adapter {name!r}: {verb} on worker "
                                                     f"{worker.worker_id} failed: {result!r}") from result
