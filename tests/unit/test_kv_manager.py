"""KV bookkeeping of requests (engine/kv_manager.py) on its own: prefix matches and locks, slots with eviction,
rows, caching a chunk's KV and re-locking it, release into the radix tree, and the flush. Every slot stays in
exactly one place: free, in the tree, or in a live request's row."""

from __future__ import annotations

import torch

from radixmesh.engine.request import Req

from .manager_factory import make_kv, req, slots_accounted


def computed(kv: object, r: Req) -> None:
    """Give `r` a row and slots for its whole prompt, as a prefill pass would."""
    assert kv.assign_row(r)  # type: ignore[attr-defined]
    todo = len(r.origin_input_ids) - r.kv_len
    slots = kv.alloc_slots(todo)  # type: ignore[attr-defined]
    assert slots is not None and r.req_pool_idx is not None
    kv.req_pool.write(r.req_pool_idx, r.kv_len, slots)  # type: ignore[attr-defined]
    r.kv_len = len(r.origin_input_ids)


def test_accounting_of_a_fresh_pool() -> None:
    kv = make_kv(num_tokens=32)
    assert kv.capacity == 32 and kv.available_tokens() == 32 and kv.used_tokens() == 0


def test_a_released_request_leaves_its_kv_cached_and_evictable() -> None:
    kv = make_kv(num_tokens=32)
    a = req("a", prompt_len=10)
    kv.match(a)
    kv.lock(a)
    computed(kv, a)
    assert kv.used_tokens() == 10 and slots_accounted(kv, held_by_requests=10)
    kv.release(a)
    assert a.req_pool_idx is None and a.kv_len == 0 and a.last_node is None
    assert kv.tree.total_size() == 10 and kv.tree.evictable_size() == 10 and kv.used_tokens() == 0
    assert slots_accounted(kv)


def test_a_match_finds_the_cached_prefix_and_a_lock_protects_it() -> None:
    kv = make_kv(num_tokens=32)
    first = req("first", prompt_len=8)
    kv.match(first)
    kv.lock(first)
    computed(kv, first)
    kv.release(first)
    again = req("again", prompt_len=12)
    kv.match(again)
    assert len(again.prefix_indices) == 8 and again.matched_node is not None and again.last_node is None
    kv.lock(again)
    assert kv.tree.protected_size() == 8 and kv.tree.evictable_size() == 0 and again.matched_node is None
    assert kv.assign_row(again) and again.kv_len == 8  # the row starts with the cached slots
    assert again.req_pool_idx is not None
    row = kv.req_pool.req_to_token[again.req_pool_idx][:8]
    assert torch.equal(row.cpu(), again.prefix_indices.cpu())
    kv.unlock(again)
    assert kv.tree.protected_size() == 0
    kv.req_pool.free(again.req_pool_idx)


def test_a_match_never_takes_the_whole_prompt() -> None:
    kv = make_kv(num_tokens=32)
    first = req("first", prompt_len=8)
    kv.match(first)
    kv.lock(first)
    computed(kv, first)
    kv.release(first)
    same = req("same", prompt_len=8)
    kv.match(same)
    assert len(same.prefix_indices) == 7  # one token is always computed: its logits sample the next


def test_slots_come_from_evicting_unlocked_cache_and_not_from_locked_cache() -> None:
    kv = make_kv(num_tokens=16)
    cached, locked = req("cached", prompt_len=8), req("locked", prompt_len=6, first_id=50)
    for r in (cached, locked):
        kv.match(r)
        kv.lock(r)
        computed(kv, r)
    kv.release(cached)  # 8 evictable, 6 held, 2 free
    assert kv.available_tokens() == 10
    slots = kv.alloc_slots(9)
    assert slots is not None and kv.tree.total_size() == 0  # the cached prompt was evicted for them
    assert kv.alloc_slots(2) is None  # only 1 left: the locked request's slots are never taken
    assert kv.alloc_slots(0) is not None and kv.alloc_slots(0).numel() == 0
    kv.allocator.free(slots)
    kv.release(locked)
    assert slots_accounted(kv)


def test_rows_run_out() -> None:
    kv = make_kv(num_tokens=64, num_rows=2)
    a, b, c = req("a"), req("b", first_id=20), req("c", first_id=40)
    for r in (a, b, c):
        kv.match(r)
    assert kv.assign_row(a) and kv.assign_row(b) and not kv.assign_row(c)
    assert kv.assign_row(a)  # a row it has already is kept
    kv.req_pool.free(a.req_pool_idx)
    kv.req_pool.free(b.req_pool_idx)


def test_caching_a_chunk_re_locks_it_as_the_new_prefix() -> None:
    kv = make_kv(num_tokens=32)
    long = req("long", prompt_len=12)
    kv.match(long)
    kv.lock(long)
    assert kv.assign_row(long)
    slots = kv.alloc_slots(5)
    assert slots is not None and long.req_pool_idx is not None
    kv.req_pool.write(long.req_pool_idx, 0, slots)
    long.kv_len = 5  # its first chunk ran
    kv.cache_unfinished(long)
    assert len(long.prefix_indices) == 5 and long.last_node is not None
    assert kv.tree.total_size() == 5 and kv.tree.protected_size() == 5  # cached, and locked for its next chunk
    kv.release(long)
    assert kv.tree.protected_size() == 0 and slots_accounted(kv)


def test_kv_computed_twice_keeps_the_trees_copy_and_frees_the_duplicate() -> None:
    kv = make_kv(num_tokens=32)
    a, b = req("a", prompt_len=6), req("b", prompt_len=6)  # the same prompt, computed side by side
    for r in (a, b):
        kv.match(r)
        kv.lock(r)
        computed(kv, r)
    kv.release(a)
    kv.release(b)  # b's slots duplicate the tree's: freed
    assert kv.tree.total_size() == 6 and kv.allocator.available_size() == 26 and slots_accounted(kv)


def test_flush_refuses_while_kv_is_held_and_empties_the_cache_otherwise() -> None:
    kv = make_kv(num_tokens=32)
    r = req("r", prompt_len=6)
    kv.match(r)
    kv.lock(r)
    computed(kv, r)
    assert kv.flush() is False
    kv.release(r)
    assert kv.tree.total_size() == 6 and kv.flush() is True
    assert kv.tree.total_size() == 0 and kv.allocator.available_size() == 32


def test_releasing_a_request_without_a_row_only_unlocks() -> None:
    kv = make_kv(num_tokens=32)
    first = req("first", prompt_len=8)
    kv.match(first)
    kv.lock(first)
    computed(kv, first)
    kv.release(first)
    waiting = req("waiting", prompt_len=10)
    kv.match(waiting)
    kv.lock(waiting)
    kv.release(waiting)  # aborted between admission's lock and its row
    assert kv.tree.protected_size() == 0 and slots_accounted(kv)
