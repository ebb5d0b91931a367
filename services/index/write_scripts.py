"""Server-side writes of the index: one round trip and one command per batch, however many blocks.

A batch of block events as separate pipelined commands costs the writer's event loop about
a hundred microseconds of Python per command (encoding and parsing each one); a 4k-token
prompt is 256 blocks and 512 commands, which delayed the first token of the request that
stored them. These scripts take the block hashes packed into one string (16 lowercase hex
digits each, as `radixmesh.index.keys` writes them) and build the key names in Redis, as
the lookup script (`radixmesh.index.chain_script`) does.

    APPLY_EVENTS  KEYS[1] the worker's `wb` set of the current epoch
                  ARGV    namespace, worker id, epoch, events: one '+' (stored) or '-' (removed)
                          and 16 hex digits per event, applied in order
                  reply   the number of events applied
    SET_SPECULATIVE  ARGV namespace, worker id, TTL in ms, block hashes (16 hex digits each)
                     reply the number of entries set
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

EVENT_WIDTH = 17
"""Characters per packed event: the operation and the block hash."""

APPLY_EVENTS = """
local ns, wid, epoch, events = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
for i = 1, #events, 17 do
  local hash = string.sub(events, i + 1, i + 16)
  if string.sub(events, i, i) == '+' then
    redis.call('HSET', ns .. ':b:' .. hash, wid, epoch)
    redis.call('SADD', KEYS[1], hash)
  else
    redis.call('HDEL', ns .. ':b:' .. hash, wid)
    redis.call('SREM', KEYS[1], hash)
  end
end
return #events / 17
"""

SET_SPECULATIVE = """
local ns, wid, ttl, chain = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
for i = 1, #chain, 16 do
  redis.call('SET', ns .. ':spec:' .. string.sub(chain, i, i + 15), wid, 'PX', ttl)
end
return #chain / 16
"""


def pack_events(events: Iterable[tuple[bool, int]]) -> str:
    """(stored?, block hash) pairs as APPLY_EVENTS reads them."""
    return "".join(f"{'+' if stored else '-'}{h:016x}" for stored, h in events)


def pack_hashes(block_hashes: Sequence[int]) -> str:
    """Block hashes as one string of 16 hex digits each (SET_SPECULATIVE and the lookup script)."""
    return "".join(f"{h:016x}" for h in block_hashes)
