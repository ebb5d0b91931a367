"""Block events of the radix cache: what it stores and evicts, as the index's block keys."""

from __future__ import annotations

import random

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from radixmesh.engine.kv_events import BlockEventRecorder, token_path
from radixmesh.engine.memory import KVSlotAllocator
from radixmesh.engine.radix_cache import RadixCache
from radixmesh.wire.block_hash import block_hashes
from radixmesh.wire.kv_events import AllBlocksCleared, BlocksRemoved, BlocksStored, KVEventsMsg
from radixmesh.wire.messages import encoder, from_scheduler_decoder
from tests.unit.scheduler_factory import make_requests, make_scheduler

B = 4


def make_cache(size: int = 512, block_size: int = B) -> tuple[KVSlotAllocator, RadixCache, BlockEventRecorder]:
    allocator = KVSlotAllocator(size, "cpu", check_double_free=True)
    recorder = BlockEventRecorder(block_size)
    return allocator, RadixCache(allocator, listener=recorder), recorder


def insert(allocator: KVSlotAllocator, cache: RadixCache, key: list[int]) -> None:
    slots = allocator.alloc(len(key))
    assert slots is not None
    allocator.free(slots[: cache.insert(key, slots)])


def held_blocks(events: list[object]) -> set[int]:
    """Replays events into the set of blocks a subscriber believes the cache holds."""
    held: set[int] = set()
    for event in events:
        if isinstance(event, BlocksStored):
            assert not held & set(event.block_hashes), "a block was stored twice"
            held |= set(event.block_hashes)
        elif isinstance(event, BlocksRemoved):
            assert set(event.block_hashes) <= held, "a block was removed that was never stored"
            held -= set(event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            held.clear()
    return held


def tree_blocks(cache: RadixCache) -> set[int]:
    """Every full block of every cached path, computed from scratch."""
    blocks: set[int] = set()
    stack = [cache.root]
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        if node is not cache.root:
            blocks |= set(block_hashes(token_path(node), B))
    return blocks


def test_insert_reports_only_new_full_blocks() -> None:
    allocator, cache, recorder = make_cache()
    insert(allocator, cache, list(range(10)))  # blocks 0, 1 full; 2 tokens left over
    assert recorder.events == [BlocksStored(block_hashes(list(range(10)), B))]
    recorder.events.clear()
    insert(allocator, cache, list(range(13)))  # extends the path: block 2 (tokens 8..11) is new
    assert recorder.events == [BlocksStored(block_hashes(list(range(12)), B)[2:])]
    recorder.events.clear()
    insert(allocator, cache, [*range(6), 99, 98, 97])  # branches inside block 1: a new block 1 on that path
    assert recorder.events == [BlocksStored(block_hashes([*range(6), 99, 98], B)[1:])]
    recorder.events.clear()
    insert(allocator, cache, list(range(13)))  # already cached: nothing
    insert(allocator, cache, [1, 2])  # no full block
    assert recorder.events == []


def test_evict_reports_blocks_of_the_removed_leaf() -> None:
    allocator, cache, recorder = make_cache()
    insert(allocator, cache, list(range(12)))
    insert(allocator, cache, [*range(8), 50, 51, 52, 53, 54])
    log = list(recorder.events)
    recorder.events.clear()
    cache.evict(1)  # the older leaf goes first: tokens 8..11 of the first path (its block 2)
    assert recorder.events == [BlocksRemoved(block_hashes(list(range(12)), B)[2:])]
    log.extend(recorder.events)
    recorder.events.clear()
    assert held_blocks(log) == tree_blocks(cache) == set(block_hashes([*range(8), 50, 51, 52, 53], B))
    cache.evict(10_000)
    log.extend(recorder.events)
    assert held_blocks(log) == tree_blocks(cache) == set()


def test_reset_clears_and_drain_batches() -> None:
    allocator, cache, recorder = make_cache()
    insert(allocator, cache, list(range(8)))
    msg = recorder.drain()
    assert msg == KVEventsMsg([BlocksStored(block_hashes(list(range(8)), B))], B)
    assert recorder.drain() is None
    cache.reset()
    assert recorder.drain() == KVEventsMsg([AllBlocksCleared()], B)


def test_message_round_trips_over_the_channel() -> None:
    msg = KVEventsMsg([BlocksStored([2**64 - 1, 0]), BlocksRemoved([7]), AllBlocksCleared()], 16)
    decoded = from_scheduler_decoder.decode(encoder.encode(msg))
    assert decoded == msg


def test_disabled_cache_reports_nothing() -> None:
    allocator = KVSlotAllocator(64, "cpu")
    recorder = BlockEventRecorder(B)
    cache = RadixCache(allocator, disable=True, listener=recorder)
    slots = allocator.alloc(8)
    assert slots is not None
    cache.insert(list(range(8)), slots)
    assert recorder.events == []


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 40), st.integers(1, 30)), min_size=1, max_size=40))
def test_events_replay_to_exactly_the_tree_blocks(ops: list[tuple[bool, int, int]]) -> None:
    allocator, cache, recorder = make_cache(size=256)
    rng = random.Random(len(ops))
    log: list[object] = []
    for is_insert, seed, amount in ops:
        if is_insert:
            base = [seed % 3] * (seed % 7)  # shared prefixes of varying length
            key = base + [rng.randrange(4) for _ in range(amount)]
            if allocator.available_size() < len(key):
                cache.evict(len(key))
            if allocator.available_size() >= len(key):
                insert(allocator, cache, key)
        else:
            cache.evict(amount)
        log.extend(recorder.events)
        recorder.events.clear()
        assert held_blocks(log) == tree_blocks(cache)


def test_scheduler_emits_events_for_what_it_caches() -> None:
    sched, _ = make_scheduler(max_total_tokens=4096)
    recorder = BlockEventRecorder(B)
    sched.kv.tree.listener = recorder
    for req in make_requests(4, seed=3, shared_prefix_len=9, max_new_tokens=3):
        sched.add_request(req)
    while sched.has_work:
        sched.step()
    assert held_blocks(list(recorder.events)) == tree_blocks(sched.kv.tree) != set()
    assert msgspec.json.encode(recorder.drain())  # serialisable
