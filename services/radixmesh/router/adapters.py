"""LoRA adapter affinity: which workers a request of an adapter may go to, before the policy picks among them.

Workers publish their loaded adapters in the KV-cache index (their lease names them, rewritten at every load and
unload) and in GetLoad (`WorkerLoad.lora_adapters`, polled with the health probes). A worker's lease, when the
router reads the index and the worker's lease names its LoRA batch width, is the fresher of the two and wins; the
router reads it from the reader's cached lease set, never waiting on Redis (a Redis outage leaves GetLoad). Loads
and unloads this router made count at once, until both sources agree. A request of adapter A goes to the
workers holding A (the policy then prefers the one holding its prefix: adapters' block hashes carry their own extra
key). When no worker holds A, or A is hot (every holder is busier than `spread_ratio` times the least loaded
LoRA-serving worker, plus `spread_slack` requests), the least loaded other worker gets A loaded first, when the
router knows where A's files are (`--lora-paths NAME=PATH`, a path on the workers' file system); without a path a
request of an adapter no worker holds is NOT_FOUND here, naming it.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from radixmesh.common.errors import ErrorCode, RadixMeshError, not_found
from radixmesh.index.lease import WorkerLease
from radixmesh.index.reader import KVIndexReader
from radixmesh.router import metrics
from radixmesh.router.config import AdapterConfig
from radixmesh.router.policies.scoring import num_requests
from radixmesh.router.workers import WorkerHandle

logger = logging.getLogger(__name__)


@dataclass
class AdapterAffinity:
    """Narrows a request's candidate workers to those holding its adapter, loading it where needed."""

    config: AdapterConfig
    reader: KVIndexReader | None = None
    """The KV-cache index, whose leases name each worker's adapters (None: GetLoad alone)."""
    loading: dict[tuple[str, str], asyncio.Future[None]] = field(default_factory=dict)
    """(worker id, adapter) -> its load in progress (concurrent requests wait for one load)."""
    loaded_here: set[tuple[str, str]] = field(default_factory=set)
    """(worker id, adapter) loads this router made, until the worker's published list names them."""
    unloaded_here: set[tuple[str, str]] = field(default_factory=set)
    """(worker id, adapter) unloads this router made, until the worker's published list drops them."""
    num_loads: int = 0

    def leases(self) -> dict[str, WorkerLease]:
        """Index id -> lease, from the reader's cache (empty without a reader or before its first read)."""
        return self.reader.cached_leases() if self.reader is not None else {}

    @staticmethod
    def published(worker: WorkerHandle, leases: dict[str, WorkerLease]) -> tuple[frozenset[str], int]:
        """The adapters a worker publishes and its LoRA batch width: its lease's when that names a batch width
        (rewritten at every change), else its last GetLoad's."""
        lease = leases.get(worker.index_id or worker.worker_id)
        if lease is not None and lease.max_loras_per_batch > 0:
            return frozenset(lease.lora_adapters), lease.max_loras_per_batch
        return worker.load.adapter_names, worker.load.max_loras_per_batch

    def holds(self, worker: WorkerHandle, name: str, leases: dict[str, WorkerLease] | None = None) -> bool:
        key = (worker.worker_id, name)
        if key in self.loaded_here:
            return True
        return key not in self.unloaded_here and name in self.published(worker, leases or {})[0]

    async def narrow(self, name: str, candidates: list[WorkerHandle]) -> list[WorkerHandle]:
        """The workers a request of adapter `name` may go to (all of `candidates` for the base model)."""
        if not name:
            return candidates
        leases = self.leases()
        self.forget_listed(candidates, leases)
        serving = [w for w in candidates if self.published(w, leases)[1] > 0] or candidates
        holders = [w for w in serving if self.holds(w, name, leases)]
        others = [w for w in serving if not self.holds(w, name, leases)]
        path = dict(self.config.lora_paths).get(name)
        if holders and (not (path and others) or not self._hot(holders, others)):
            metrics.LORA_DECISIONS.labels(name, "holder").inc()
            return holders
        if not others or path is None:
            raise not_found(f"LoRA adapter {name!r} is not loaded on any worker (and the router has no "
                            "--lora-paths entry for it)", "lora_name")
        target = min(others, key=num_requests)
        await self._load(target, name, path)
        metrics.LORA_DECISIONS.labels(name, "spread" if holders else "loaded").inc()
        return [*holders, target] if holders else [target]

    def _hot(self, holders: list[WorkerHandle], others: list[WorkerHandle]) -> bool:
        busiest_ok = min(num_requests(w) for w in holders)
        idle = min(num_requests(w) for w in others)
        return busiest_ok > self.config.spread_ratio * idle + self.config.spread_slack

    async def _load(self, worker: WorkerHandle, name: str, path: str) -> None:
        key = (worker.worker_id, name)
        pending = self.loading.get(key)
        if pending is not None:
            await asyncio.shield(pending)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.loading[key] = fut
        try:
            await worker.client.load_lora_adapter(name, path)
            self.num_loads += 1
            metrics.LORA_LOADS.labels(name, "route").inc()
            logger.info("loaded LoRA adapter %s on worker %s", name, worker.worker_id)
        except RadixMeshError as exc:
            if not (exc.code is ErrorCode.INVALID_ARGUMENT and "already loaded" in exc.message):
                fut.set_exception(exc)
                fut.exception()  # retrieved here: waiters re-raise it
                raise
        finally:
            self.loading.pop(key, None)
        self.loaded_here.add(key)
        self.unloaded_here.discard(key)
        if not fut.done():
            fut.set_result(None)

    def on_loaded(self, worker: WorkerHandle, name: str) -> None:
        """A load this router sent (a user's, through the gateway) succeeded: route there at once."""
        self.loaded_here.add((worker.worker_id, name))
        self.unloaded_here.discard((worker.worker_id, name))

    def on_unloaded(self, worker: WorkerHandle, name: str) -> None:
        """An unload this router sent succeeded: route elsewhere at once."""
        self.loaded_here.discard((worker.worker_id, name))
        self.unloaded_here.add((worker.worker_id, name))

    def forget_listed(self, workers: list[WorkerHandle], leases: dict[str, WorkerLease] | None = None) -> None:
        """Drop local records of loads and unloads that the workers' published lists now show."""
        for worker in workers:
            names = self.published(worker, leases or {})[0]
            self.loaded_here -= {(worker.worker_id, n) for n in names}
            self.unloaded_here = {(w, n) for w, n in self.unloaded_here if w != worker.worker_id or n in names}
