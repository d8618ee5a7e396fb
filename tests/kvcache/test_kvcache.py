"""Block pool, free queue, hashing and the KV cache manager, without a scheduler."""

from __future__ import annotations

import pytest

from kvcache.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from kvcache.config import CacheConfig
from kvcache.hashing import BlockHash, extend_block_hashes, hash_block_tokens
from kvcache.kv_cache_manager import KVCacheManager


class Req:
    """The minimum a request must offer the manager."""

    def __init__(self, request_id: str, token_ids: list[int], priority: int = 0) -> None:
        self.request_id = request_id
        self.all_token_ids = token_ids
        self.priority = priority
        self.num_computed_tokens = 0
        self.block_hashes: list[BlockHash] = []
        self.cache_salt: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


def make_manager(num_blocks: int = 8, block_size: int = 4, caching: bool = True) -> KVCacheManager:
    return KVCacheManager(CacheConfig(num_blocks, block_size, caching))


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_queue]


def state(manager: KVCacheManager) -> tuple[object, ...]:
    pool = manager.pool
    return (
        free_ids(pool),
        [b.ref_cnt for b in pool.blocks],
        [b.block_hash for b in pool.blocks],
        dict(manager._req_block_ids),
        manager.prefix_cache_queries_tokens,
        manager.prefix_cache_hits_tokens,
    )


def compute(manager: KVCacheManager, req: Req, num_tokens: int) -> None:
    """Allocate and 'compute' num_tokens tokens, as a scheduler step would."""
    assert manager.allocate_slots(req, num_tokens) is not None
    req.num_computed_tokens += num_tokens
    manager.cache_blocks(req, req.num_computed_tokens)


# ---- free queue ----


def blocks(n: int) -> list[KVCacheBlock]:
    return [KVCacheBlock(i) for i in range(n)]


def test_free_queue_starts_in_order_and_pops_from_head() -> None:
    bs = blocks(4)
    queue = FreeKVCacheBlockQueue(bs)
    assert len(queue) == 4
    assert [b.block_id for b in queue] == [0, 1, 2, 3]
    assert queue.popleft() is bs[0]
    assert queue.popleft() is bs[1]
    assert [b.block_id for b in queue] == [2, 3]


def test_free_queue_remove_from_middle_and_reinsert() -> None:
    bs = blocks(5)
    queue = FreeKVCacheBlockQueue(bs)
    queue.remove(bs[2])
    assert [b.block_id for b in queue] == [0, 1, 3, 4]
    assert bs[2].prev_free is None and bs[2].next_free is None
    queue.append(bs[2])
    assert [b.block_id for b in queue] == [0, 1, 3, 4, 2]
    queue.remove(bs[0])
    queue.appendleft(bs[0])
    assert [b.block_id for b in queue] == [0, 1, 3, 4, 2]
    queue.remove(bs[4])
    queue.appendleft(bs[4])
    assert [b.block_id for b in queue] == [4, 0, 1, 3, 2]
    assert len(queue) == 5


def test_free_queue_errors() -> None:
    bs = blocks(2)
    queue = FreeKVCacheBlockQueue(bs)
    with pytest.raises(ValueError):
        queue.append(bs[0])  # already queued
    queue.popleft()
    queue.popleft()
    with pytest.raises(IndexError):
        queue.popleft()
    with pytest.raises(ValueError):
        queue.remove(bs[0])


# ---- hashing ----


def test_block_hash_is_deterministic_and_chained() -> None:
    root = hash_block_tokens(None, [1, 2, 3, 4])
    assert root == hash_block_tokens(None, [1, 2, 3, 4])
    assert root != hash_block_tokens(None, [1, 2, 3, 5])
    child = hash_block_tokens(root, [5, 6, 7, 8])
    other_parent = hash_block_tokens(hash_block_tokens(None, [9, 9, 9, 9]), [5, 6, 7, 8])
    assert child != other_parent  # same tokens, different prefix
    assert child != hash_block_tokens(None, [5, 6, 7, 8])


def test_extend_block_hashes_is_incremental_and_full_blocks_only() -> None:
    tokens = list(range(11))
    hashes: list[BlockHash] = []
    extend_block_hashes(hashes, tokens[:5], 4)
    assert len(hashes) == 1
    extend_block_hashes(hashes, tokens, 4)
    assert len(hashes) == 2  # 11 tokens: 2 full blocks
    all_at_once: list[BlockHash] = []
    extend_block_hashes(all_at_once, tokens, 4)
    assert hashes == all_at_once
    assert hashes[1] == hash_block_tokens(hashes[0], tokens[4:8])


# ---- block pool ----


def test_pool_get_new_blocks_and_free() -> None:
    pool = BlockPool(4)
    got = pool.get_new_blocks(3)
    assert [b.block_id for b in got] == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in got)
    assert pool.num_free_blocks == 1
    assert pool.usage == pytest.approx(0.75)
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)
    pool.free_blocks(got)
    assert pool.num_free_blocks == 4
    assert pool.usage == 0.0
    pool.check_integrity()
    with pytest.raises(ValueError):
        pool.free_blocks([got[0]])  # ref_cnt already 0


def test_pool_lazy_eviction_keeps_key_until_reuse() -> None:
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    key = hash_block_tokens(None, [1])
    assert pool.cache_full_block(block, key)
    pool.free_blocks([block])
    assert pool.get_cached_block(key) is block  # free but still cached
    assert pool.num_cached_blocks == 1
    pool.get_new_blocks(1)  # takes the unkeyed block 1 first
    assert pool.get_cached_block(key) is block
    (reused,) = pool.get_new_blocks(1)
    assert reused is block and block.block_hash is None
    assert pool.get_cached_block(key) is None
    pool.check_integrity()


def test_pool_free_puts_unkeyed_blocks_first_in_eviction_order() -> None:
    pool = BlockPool(4)
    got = pool.get_new_blocks(4)
    for i in (0, 2):
        pool.cache_full_block(got[i], hash_block_tokens(None, [i]))
    pool.free_blocks(got)  # keyed 0 then 2 to the tail; unkeyed 1 then 3 to the head
    assert free_ids(pool) == [3, 1, 0, 2]


def test_pool_touch_takes_free_cached_block_back() -> None:
    pool = BlockPool(3)
    got = pool.get_new_blocks(1)
    pool.cache_full_block(got[0], b"k")
    pool.free_blocks(got)
    assert pool.num_free_blocks == 3
    pool.touch(got)
    assert got[0].ref_cnt == 1 and pool.num_free_blocks == 2
    pool.touch(got)  # a second holder: shared
    assert got[0].ref_cnt == 2 and pool.num_free_blocks == 2
    pool.check_integrity()


def test_pool_cache_full_block_keeps_first_block_per_key() -> None:
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    assert pool.cache_full_block(a, b"k")
    assert not pool.cache_full_block(b, b"k")
    assert not pool.cache_full_block(a, b"other")  # already keyed
    assert b.block_hash is None and pool.get_cached_block(b"k") is a
    no_cache = BlockPool(1, enable_caching=False)
    (c,) = no_cache.get_new_blocks(1)
    assert not no_cache.cache_full_block(c, b"k")


def test_pool_integrity_detects_corruption() -> None:
    pool = BlockPool(3)
    pool.get_new_blocks(1)
    pool.check_integrity()
    pool.blocks[0].ref_cnt = 0  # used block that is not in the free queue
    with pytest.raises(RuntimeError, match="free"):
        pool.check_integrity()


# ---- manager ----


def test_allocate_then_free_returns_every_block() -> None:
    manager = make_manager()
    req = Req("a", list(range(10)))
    new = manager.allocate_slots(req, 10)
    assert new is not None and len(new) == 3
    assert manager.get_block_ids("a") == [b.block_id for b in new]
    assert manager.num_free_blocks == 5
    assert manager.usage == pytest.approx(3 / 8)
    manager.check_integrity()
    manager.free(req)
    assert manager.num_free_blocks == 8 and manager.usage == 0.0
    assert manager.get_block_ids("a") == []
    manager.free(req)  # no-op
    manager.check_integrity()


def test_allocate_grows_only_when_the_last_block_is_full() -> None:
    manager = make_manager()
    req = Req("a", list(range(5)))
    compute(manager, req, 5)  # 2 blocks, 3 free slots left
    req.all_token_ids.append(99)
    assert manager.allocate_slots(req, 1) == []
    req.num_computed_tokens += 1
    req.all_token_ids += [100, 101, 102]
    req.num_computed_tokens += 2
    new = manager.allocate_slots(req, 1)  # token 9 opens block 3
    assert new is not None and len(new) == 1
    assert len(manager.get_block_ids("a")) == 3


def test_allocate_slots_none_leaves_state_unchanged() -> None:
    manager = make_manager(num_blocks=4)
    first = Req("first", list(range(8)))
    compute(manager, first, 8)
    manager.free(first)  # 2 cached free blocks
    holder = Req("holder", list(range(100, 104)))
    compute(manager, holder, 4)
    req = Req("b", list(range(8)) + list(range(50, 58)))
    hits, num_hit_tokens = manager.get_computed_blocks(req)
    assert num_hit_tokens == 8
    before = state(manager)  # 3 free blocks, 2 of them the hits
    assert manager.allocate_slots(req, 8, hits) is None
    assert state(manager) == before
    assert manager.allocate_slots(req, 4, hits, num_lookahead_tokens=4) is None
    assert state(manager) == before
    assert manager.allocate_slots(req, 4, hits, num_reserved_blocks=1) is None
    assert state(manager) == before
    assert manager.allocate_slots(req, 4, hits) is not None
    manager.check_integrity()


def test_allocate_respects_reserved_blocks() -> None:
    manager = make_manager(num_blocks=4)
    req = Req("a", list(range(12)))
    assert manager.allocate_slots(req, 12, num_reserved_blocks=2) is None
    assert manager.allocate_slots(req, 8, num_reserved_blocks=2) is not None
    assert manager.num_free_blocks == 2


def test_lookahead_reserves_blocks_for_later_chunks() -> None:
    manager = make_manager()
    req = Req("a", list(range(16)))
    new = manager.allocate_slots(req, 4, num_lookahead_tokens=12)
    assert new is not None and len(new) == 4
    req.num_computed_tokens = 4
    assert manager.allocate_slots(req, 4) == []  # next chunk already has its blocks


def test_prefix_reuse_across_requests() -> None:
    manager = make_manager()
    a = Req("a", list(range(10)))
    compute(manager, a, 10)
    assert manager.num_cached_blocks == 2  # 2 full blocks computed
    b = Req("b", list(range(8)) + [77, 78, 79])
    hits, num_hit_tokens = manager.get_computed_blocks(b)
    assert num_hit_tokens == 8
    assert hits == [manager.pool.blocks[i] for i in manager.get_block_ids("a")[:2]]
    new = manager.allocate_slots(b, 3, hits)
    assert new is not None and len(new) == 1
    b.num_computed_tokens = 8
    assert manager.get_block_ids("b")[:2] == manager.get_block_ids("a")[:2]
    assert [blk.ref_cnt for blk in hits] == [2, 2]
    manager.check_integrity()
    manager.free(a)
    assert [blk.ref_cnt for blk in hits] == [1, 1]
    manager.free(b)
    manager.check_integrity()
    assert manager.num_free_blocks == 8


def test_prefix_hit_on_free_cached_blocks() -> None:
    manager = make_manager(num_blocks=4)
    a = Req("a", list(range(9)))
    compute(manager, a, 9)
    manager.free(a)
    b = Req("b", list(range(9)))
    hits, num_hit_tokens = manager.get_computed_blocks(b)
    assert num_hit_tokens == 8
    free_before = manager.num_free_blocks
    assert manager.allocate_slots(b, 1, hits) is not None
    assert manager.num_free_blocks == free_before - 3  # 2 hits left the free queue + 1 new


def test_never_hits_the_whole_sequence() -> None:
    manager = make_manager()
    a = Req("a", list(range(8)))
    compute(manager, a, 8)
    b = Req("b", list(range(8)))  # exactly the 2 cached blocks
    hits, num_hit_tokens = manager.get_computed_blocks(b)
    assert num_hit_tokens == 4  # the last token must be computed for its logits
    assert len(hits) == 1


def test_hit_stops_at_first_missing_block() -> None:
    manager = make_manager()
    a = Req("a", list(range(12)))
    compute(manager, a, 12)
    b = Req("b", [0, 1, 2, 3, 9, 9, 9, 9, 8, 9, 10, 11, 12])
    assert manager.get_computed_blocks(b)[1] == 4  # chained: block 3 differs by prefix


def test_blocks_cached_only_once_computed() -> None:
    manager = make_manager()
    a = Req("a", list(range(12)))
    assert manager.allocate_slots(a, 6, num_lookahead_tokens=6) is not None
    a.num_computed_tokens = 6
    manager.cache_blocks(a, 6)
    assert manager.num_cached_blocks == 1
    b = Req("b", list(range(12)))
    assert manager.get_computed_blocks(b)[1] == 4


def test_free_evicts_tail_blocks_first() -> None:
    manager = make_manager(num_blocks=4)
    a = Req("a", list(range(12)))
    compute(manager, a, 12)  # blocks 0, 1, 2 keyed
    manager.free(a)
    assert free_ids(manager.pool)[-3:] == [2, 1, 0]  # the head of the prompt is kept longest
    c = Req("c", list(range(100, 108)))
    assert manager.allocate_slots(c, 8) is not None  # takes block 3 then evicts block 2
    b = Req("b", list(range(13)))
    assert manager.get_computed_blocks(b)[1] == 8  # blocks 0 and 1 still cached, 2 evicted


def test_prefix_cache_stats_counted_once_per_allocation() -> None:
    manager = make_manager()
    a = Req("a", list(range(10)))
    compute(manager, a, 10)
    assert (manager.prefix_cache_queries_tokens, manager.prefix_cache_hits_tokens) == (10, 0)
    b = Req("b", list(range(10)))
    hits, _ = manager.get_computed_blocks(b)
    manager.get_computed_blocks(b)  # looking twice does not count
    assert manager.allocate_slots(b, 2, hits) is not None
    assert (manager.prefix_cache_queries_tokens, manager.prefix_cache_hits_tokens) == (20, 8)


def test_prefix_caching_disabled() -> None:
    manager = make_manager(caching=False)
    a = Req("a", list(range(10)))
    compute(manager, a, 10)
    assert manager.num_cached_blocks == 0
    assert manager.get_computed_blocks(Req("b", list(range(10)))) == ([], 0)
    assert manager.prefix_cache_queries_tokens == 0


def test_prefix_hits_only_on_first_allocation() -> None:
    manager = make_manager()
    a = Req("a", list(range(10)))
    compute(manager, a, 10)
    hits, _ = manager.get_computed_blocks(Req("x", list(range(10))))
    with pytest.raises(ValueError):
        manager.allocate_slots(a, 1, hits)


def test_num_blocks_freed_by_counts_shared_blocks_once() -> None:
    manager = make_manager()
    a = Req("a", list(range(9)))
    compute(manager, a, 9)
    b = Req("b", list(range(8)) + [50, 51])
    hits, _ = manager.get_computed_blocks(b)
    assert manager.allocate_slots(b, 2, hits) is not None
    assert manager.num_blocks_freed_by([a]) == 1  # blocks 0, 1 are shared with b
    assert manager.num_blocks_freed_by([b]) == 1
    assert manager.num_blocks_freed_by([a, b]) == 4


def test_integrity_detects_ref_count_mismatch() -> None:
    manager = make_manager()
    a = Req("a", list(range(6)))
    compute(manager, a, 6)
    manager.check_integrity()
    manager.pool.blocks[manager.get_block_ids("a")[0]].ref_cnt += 1
    with pytest.raises(RuntimeError, match="ref_cnt"):
        manager.check_integrity()


def test_eviction_takes_unkeyed_then_worst_priority_class_then_lru() -> None:
    manager = make_manager(num_blocks=8, block_size=4)
    pool = manager.pool
    urgent = Req("urgent", list(range(8)), priority=-10)  # 2 full blocks
    low = Req("low", list(range(100, 108)), priority=10)
    mid = Req("mid", list(range(200, 208)), priority=0)
    for req in (urgent, low, mid):
        compute(manager, req, 8)
    spare = Req("spare", [1, 2, 3], priority=0)
    compute(manager, spare, 3)  # a partial block: never keyed
    for req in (urgent, mid, low, spare):
        manager.free(req)
    by_id = {b.block_id: b for b in pool.blocks}
    order = [b.block_id for b in pool.free_queue]
    classes = [by_id[i].priority if by_id[i].block_hash is not None else None for i in order]
    num_unkeyed = classes.count(None)
    assert classes[:num_unkeyed] == [None] * num_unkeyed
    assert classes[num_unkeyed:] == [10, 10, 0, 0, -10, -10]
    # a hit by a more urgent request moves a block to the urgent class
    again = Req("again", list(range(100, 108)) + [9], priority=-20)
    hits, _ = manager.get_computed_blocks(again)
    assert manager.allocate_slots(again, 1, hits) is not None
    manager.free(again)
    tail = [by_id[i].priority for i in list(b.block_id for b in pool.free_queue)[-2:]]
    assert tail == [-20, -20]
    pool.check_integrity()

