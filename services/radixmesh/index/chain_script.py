"""The server-side walk of a prompt's block chain: one round trip per lookup, however long the chain.

A Lua script runs the walk inside Redis so the router never waits on more than one round
trip, and the reply is a handful of counts instead of every block's entries (parsing
hundreds of replies in Python costs more than the network on loopback). It only reads.

    KEYS   the `wb` and `wbh` sets of each live worker (two per worker, in ARGV order)
    ARGV   the namespace; the chain's block hashes as one string of 16 hex digits each (the
           script builds the `b:`, `bh:` and `spec:` key names itself: packing hundreds of separate
           arguments costs the client more than the walk costs Redis); then worker id and lease
           epoch of every live worker
    reply  [counts, speculative, footprints, odd, device_counts, lease_version] where counts is worker, blocks, ...
           (leading blocks held in either tier); speculative lists the workers whose count includes a
           speculative entry; footprints is worker, total blocks (both tiers), ...; odd is block index,
           worker, value, tier (d | h) of up to 64 entries that are stale (no lease, or an older epoch)
           or malformed (not an integer); device_counts is worker, blocks, ... of the leading blocks held
           on the device (a speculative entry counts as on the device: the prompt is computed there);
           lease_version is the `leasever` counter (nil before any lease was written), which tells the
           reader whether the leases it passed may be out of date
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MAX_ODD = 64

SCRIPT = """
local ns, chain = ARGV[1], ARGV[2]
local n = #chain / 16
local epochs, order = {}, {}
for i = 3, #ARGV, 2 do
  epochs[ARGV[i]] = ARGV[i + 1]
  table.insert(order, ARGV[i])
end
local counts, dcounts, spec, odd = {}, {}, {}, {}
local function scan(fields, i, tier)
  local extended = false
  for j = 1, #fields, 2 do
    local w, e = fields[j], fields[j + 1]
    local current = epochs[w]
    if current == e then
      if (counts[w] or 0) == i - 1 then
        counts[w] = i
        extended = true
      end
      if tier == 'd' and (dcounts[w] or 0) == i - 1 then
        dcounts[w] = i
      end
    elseif #odd < 4 * MAX_ODD then
      local value = tonumber(e)
      if value == nil or current == nil or value < tonumber(current) then
        table.insert(odd, i - 1); table.insert(odd, w); table.insert(odd, e); table.insert(odd, tier)
      end
    end
  end
  return extended
end
for i = 1, n do
  local hash = string.sub(chain, 16 * i - 15, 16 * i)
  local extended = scan(redis.call('HGETALL', ns .. ':b:' .. hash), i, 'd')
  extended = scan(redis.call('HGETALL', ns .. ':bh:' .. hash), i, 'h') or extended
  local s = redis.call('GET', ns .. ':spec:' .. hash)
  if s and epochs[s] and (counts[s] or 0) == i - 1 then
    counts[s] = i
    if (dcounts[s] or 0) == i - 1 then dcounts[s] = i end
    spec[s] = true
    extended = true
  end
  if not extended then break end
end
local out_counts, out_spec, out_foot, out_dev = {}, {}, {}, {}
for w, c in pairs(counts) do table.insert(out_counts, w); table.insert(out_counts, c) end
for w, c in pairs(dcounts) do table.insert(out_dev, w); table.insert(out_dev, c) end
for w, _ in pairs(spec) do table.insert(out_spec, w) end
for k, w in ipairs(order) do
  table.insert(out_foot, w)
  table.insert(out_foot, redis.call('SCARD', KEYS[2 * k - 1]) + redis.call('SCARD', KEYS[2 * k]))
end
return {out_counts, out_spec, out_foot, odd, out_dev, redis.call('GET', ns .. ':leasever')}
""".replace("MAX_ODD", str(MAX_ODD))


@dataclass
class ChainWalk:
    """The parsed reply of one walk."""

    counts: dict[str, int] = field(default_factory=dict)
    speculative: set[str] = field(default_factory=set)
    footprint: dict[str, int] = field(default_factory=dict)
    odd: list[tuple[int, str, str, str]] = field(default_factory=list)
    """(block index, worker, stored value, tier: device | host) of stale or malformed entries."""
    device_counts: dict[str, int] = field(default_factory=dict)
    """Leading blocks each worker holds on its device (the rest of its count is in its host tier)."""
    lease_version: int = 0
    """The index's lease counter when the walk ran (0: no lease was ever written)."""


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def parse_reply(reply: list[Any]) -> ChainWalk:
    counts_raw, spec_raw, foot_raw, odd_raw, dev_raw, version_raw = reply
    walk = ChainWalk()
    walk.counts = {_text(counts_raw[i]): int(counts_raw[i + 1]) for i in range(0, len(counts_raw), 2)}
    walk.speculative = {_text(w) for w in spec_raw}
    walk.footprint = {_text(foot_raw[i]): int(foot_raw[i + 1]) for i in range(0, len(foot_raw), 2)}
    walk.odd = [(int(odd_raw[i]), _text(odd_raw[i + 1]), _text(odd_raw[i + 2]),
                 "host" if _text(odd_raw[i + 3]) == "h" else "device") for i in range(0, len(odd_raw), 4)]
    walk.device_counts = {_text(dev_raw[i]): int(dev_raw[i + 1]) for i in range(0, len(dev_raw), 2)}
    walk.lease_version = parse_lease_version(version_raw)
    return walk


def parse_lease_version(raw: Any) -> int:
    """The `leasever` counter as Redis returned it (None or a missing key: 0)."""
    try:
        return int(raw) if raw is not None else 0
    except (TypeError, ValueError):
        return 0
