"""Removes index entries that no longer count: old epochs of a worker, and workers whose lease lapsed.

Deletion is conditional (a Lua script deletes a block's field only while it still holds the
stale epoch), so a janitor racing a worker that republishes never removes fresh entries.
Several routers may sweep at once; every step is idempotent.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from redis.asyncio import Redis

from radixmesh.index.keys import TIERS, IndexKeys, parse_block_member
from radixmesh.index.lease import WorkerLease

logger = logging.getLogger(__name__)

SCAN_COUNT = 512

# KEYS: block keys; ARGV[1]: worker id; ARGV[2]: the stale epoch. Deletes field ARGV[1] where it equals ARGV[2].
_HDEL_IF_EQUAL = """
local n = 0
for _, key in ipairs(KEYS) do
  if redis.call('HGET', key, ARGV[1]) == ARGV[2] then
    redis.call('HDEL', key, ARGV[1])
    n = n + 1
  end
end
return n
"""


class IndexJanitor:
    """Cleans stale entries of one namespace."""

    def __init__(self, redis: Redis, keys: IndexKeys) -> None:
        self.redis = redis
        self.keys = keys
        self._hdel_if_equal: Any = redis.register_script(_HDEL_IF_EQUAL)

    async def delete_if_epoch(self, worker_id: str, epoch: str, block_keys: list[str]) -> int:
        """Delete `worker_id`'s field from each block key whose value is still `epoch`."""
        if not block_keys:
            return 0
        removed: int = await self._hdel_if_equal(keys=block_keys, args=[worker_id, epoch])
        return removed

    async def clean_epoch(self, worker_id: str, epoch: int) -> int:
        """Remove every entry `worker_id` wrote in `epoch` (both tiers); returns how many block fields were deleted."""
        removed = 0
        for tier in TIERS:
            set_key = self.keys.tier_blocks(worker_id, epoch, tier)
            cursor = 0
            while True:
                cursor, members = await self.redis.sscan(set_key, cursor=cursor, count=SCAN_COUNT)
                hashes = [h for h in (parse_block_member(m) for m in members) if h is not None]
                removed += await self.delete_if_epoch(worker_id, str(epoch),
                                                      [self.keys.tier_block(h, tier) for h in hashes])
                if cursor == 0:
                    break
        pipe = self.redis.pipeline(transaction=False)
        for tier in TIERS:
            pipe.delete(self.keys.tier_blocks(worker_id, epoch, tier))
        pipe.srem(self.keys.worker_epochs(worker_id), str(epoch))
        await pipe.execute()
        if removed:
            logger.info("index: removed %d entries of worker %s epoch %d", removed, worker_id, epoch)
        return removed

    async def clean_worker(self, worker_id: str, keep_epoch: int | None) -> int:
        """Remove `worker_id`'s entries of every epoch except `keep_epoch` (all of them when None)."""
        members = await self.redis.smembers(self.keys.worker_epochs(worker_id))
        removed = 0
        for epoch in _epochs(members, worker_id):
            if epoch != keep_epoch:
                removed += await self.clean_epoch(worker_id, epoch)
        return removed

    async def sweep(self, live: Mapping[str, WorkerLease]) -> int:
        """Clean every worker against the live leases: lapsed workers entirely, live ones' old epochs."""
        removed = 0
        for raw in await self.redis.smembers(self.keys.workers):
            worker_id = raw.decode() if isinstance(raw, bytes) else str(raw)
            lease = live.get(worker_id)
            removed += await self.clean_worker(worker_id, lease.epoch if lease else None)
            if lease is None and not await self.redis.scard(self.keys.worker_epochs(worker_id)):
                # A live worker re-adds itself on every heartbeat, so a race here heals quickly.
                await self.redis.srem(self.keys.workers, worker_id)
        return removed


def _epochs(members: Iterable[bytes | str], worker_id: str) -> list[int]:
    epochs = []
    for member in members:
        text = member.decode() if isinstance(member, bytes) else member
        try:
            epochs.append(int(text))
        except ValueError:
            logger.warning("index: ignoring malformed epoch %r of worker %s", text, worker_id)
    return sorted(epochs)
