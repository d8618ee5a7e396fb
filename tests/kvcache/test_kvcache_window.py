"""The KV cache manager of a model windowed in every layer (CacheConfig.sliding_window):
the blocks behind a request's window are keyed and released as its table grows."""

from __future__ import annotations

from kvcache.config import CacheConfig
from kvcache.kv_cache_manager import KVCacheManager
from tests.kvcache.test_kvcache import Req, compute


def windowed(window: int | None, num_blocks: int = 16, caching: bool = True) -> KVCacheManager:
    return KVCacheManager(CacheConfig(num_blocks, 4, caching, sliding_window=window))


def test_blocks_behind_the_window_are_released_when_the_table_grows() -> None:
    manager = windowed(6)
    req = Req("a", list(range(40)))
    compute(manager, req, 20)  # positions 0..19 in blocks 0..4
    assert manager.num_held_blocks("a") == 5
    compute(manager, req, 1)  # the query at 20 sees 15..20: blocks 0..2 are behind
    table = manager.get_block_ids("a")
    assert len(table) == 6 and manager.num_held_blocks("a") == 3
    held = {b.block_id for b in manager.pool.blocks if b.ref_cnt}
    assert held == set(table[3:])
    assert manager.num_free_blocks == 16 - 3
    manager.check_integrity()
    # released, they stay keyed in the prefix cache: the same prompt hits all of them
    again = Req("b", list(range(40)))
    hits, num_tokens = manager.get_computed_blocks(again)
    assert [b.block_id for b in hits[:3]] == table[:3] and num_tokens == 20
    manager.free(req)
    manager.check_integrity()
    assert manager.num_free_blocks == 16 and manager.usage == 0


def test_a_long_sequence_holds_a_window_of_blocks() -> None:
    manager = windowed(8, num_blocks=5)
    req = Req("a", list(range(200)))
    compute(manager, req, 7)
    for _ in range(150):  # decodes, far past what the pool could hold whole
        compute(manager, req, 1)
        assert manager.num_held_blocks("a") <= 4  # ceil((8 - 1) / 4) + 1 + the new one
    manager.check_integrity()


def test_without_a_window_nothing_is_released() -> None:
    manager = windowed(None)
    req = Req("a", list(range(40)))
    compute(manager, req, 20)
    compute(manager, req, 9)
    assert manager.num_held_blocks("a") == len(manager.get_block_ids("a")) == 8


def test_a_block_released_before_its_step_was_read_is_keyed_first() -> None:
    # overlapped steps: the next step is scheduled (and the blocks behind its window
    # released) before the last step's update keys the blocks it filled
    manager = windowed(4)
    req = Req("a", list(range(40)))
    assert manager.allocate_slots(req, 16) is not None
    req.num_computed_tokens = 16
    assert manager.allocate_slots(req, 1) is not None  # blocks 0..2 released
    table = manager.get_block_ids("a")
    hits, num_tokens = manager.get_computed_blocks(Req("b", list(range(40))))
    assert [b.block_id for b in hits] == table[:3] and num_tokens == 12
    manager.cache_blocks(req, 17)  # the update: block 3 keyed too
    assert manager.get_computed_blocks(Req("c", list(range(40))))[1] == 16
    manager.check_integrity()


def test_a_request_that_released_blocks_shares_none_from_its_table() -> None:
    manager = windowed(4)
    req = Req("a", list(range(40)))
    compute(manager, req, 16)
    assert len(manager.get_leading_blocks("a", 3)) == 3
    compute(manager, req, 1)
    assert manager.get_leading_blocks("a", 3) == []


def test_num_blocks_freed_by_counts_held_blocks_only() -> None:
    manager = windowed(4)
    req = Req("a", list(range(40)))
    compute(manager, req, 16)
    compute(manager, req, 1)
    assert manager.num_blocks_freed_by([req]) == manager.num_held_blocks("a") == 2
