"""Server-side writes of the index: one round trip and one command per batch, however many blocks.

A batch of block events as separate pipelined commands costs the writer's event loop about
a hundred microseconds of Python per command (encoding and parsing each one); a 4k-token
prompt is 256 blocks and 512 commands, which delayed the first token of the request that
stored them. These scripts take the block hashes packed into one string (16 lowercase hex
digits each, as `radixmesh.index.keys` writes them) and build the key names in Redis, as
the lookup script (`radixmesh.index.chain_script`) does.

    APPLY_EVENTS  KEYS    the worker's `wb` (device) and `wbh` (host tier) sets of the current epoch
                  ARGV    namespace, worker id, epoch, events: per event the old tier, the new tier
                          ('d' device, 'h' host, '-' none: a new block, or a removed one) and 16 hex
                          digits, applied in order (a move between tiers drops the old entry, adds the new)
                  reply   the number of events applied
    SET_SPECULATIVE  ARGV namespace, worker id, TTL in ms, block hashes (16 hex digits each)
                     reply the number of entries set
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence

from radixmesh.index.keys import DEVICE_TIER, HOST_TIER

EVENT_WIDTH = 18
"""Characters per packed event: old tier, new tier, block hash."""
_TIER_CODE = {None: "-", DEVICE_TIER: "d", HOST_TIER: "h"}

APPLY_EVENTS = """
local ns, wid, epoch, events = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local prefix = {d = ns .. ':b:', h = ns .. ':bh:'}
local members = {d = KEYS[1], h = KEYS[2]}
for i = 1, #events, 18 do
  local old, new = string.sub(events, i, i), string.sub(events, i + 1, i + 1)
  local hash = string.sub(events, i + 2, i + 17)
  if old ~= '-' then
    redis.call('HDEL', prefix[old] .. hash, wid)
    redis.call('SREM', members[old], hash)
  end
  if new ~= '-' then
    redis.call('HSET', prefix[new] .. hash, wid, epoch)
    redis.call('SADD', members[new], hash)
  end
end
return #events / 18
"""

SET_SPECULATIVE = """
local ns, wid, ttl, chain = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
for i = 1, #chain, 16 do
  redis.call('SET', ns .. ':spec:' .. string.sub(chain, i, i + 15), wid, 'PX', ttl)
end
return #chain / 16
"""


def pack_events(events: Iterable[tuple[int, str | None, str | None]]) -> str:
    """(block hash, new tier or None when removed, old tier or None when new) as APPLY_EVENTS reads them."""
    return "".join(f"{_TIER_CODE[old]}{_TIER_CODE[new]}{h:016x}" for h, new, old in events)


def pack_hashes(block_hashes: Sequence[int]) -> str:
    """Block hashes as one string of 16 hex digits each (SET_SPECULATIVE and the lookup script)."""
    return struct.pack(f">{len(block_hashes)}Q", *block_hashes).hex()
