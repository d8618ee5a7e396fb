"""Block tables of requests over the block pool: prefix-cache lookup, allocate, cache, free.

Ask-then-do: `allocate_slots` either allocates everything asked for or returns None and
changes nothing (but the early release below), so the scheduler can try, then preempt,
then try again.

Sliding window (CacheConfig.sliding_window, when every layer of the model has one): the
leading blocks of a request that lie wholly behind the window of its next query are
released (freed; still keyed in the prefix cache) when its table grows. Its block table
keeps their ids, which no attention reads again; it holds only the blocks after them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Protocol

from kvcache.block_pool import BlockPool, KVCacheBlock
from kvcache.config import CacheConfig
from kvcache.hashing import BlockHash, extend_block_hashes


class KVCacheRequest(Protocol):
    """What the manager reads of a request (the scheduler's `Request` fits)."""

    @property
    def request_id(self) -> str: ...

    @property
    def all_token_ids(self) -> Sequence[int]: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_computed_tokens(self) -> int: ...

    @property
    def priority(self) -> int:
        """Lower is more urgent: the eviction class of the cached blocks it uses."""
        ...

    @property
    def block_hashes(self) -> list[BlockHash]:
        """Keys of the request's full blocks; the manager appends to it."""
        ...

    @property
    def cache_salt(self) -> str | None:
        """Blocks of different salts never share prefix-cache keys (None: unsalted)."""
        ...


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(-a // b)


class KVCacheManager:
    """Owns the block pool and every request's block table."""

    def __init__(self, cache_config: CacheConfig) -> None:
        self.block_size = cache_config.block_size
        self.enable_caching = cache_config.enable_prefix_caching
        self.sliding_window = cache_config.sliding_window
        self.pool = BlockPool(cache_config.num_blocks, self.enable_caching)
        self._req_blocks: dict[str, list[KVCacheBlock]] = {}
        # Kept beside _req_blocks so building a step's block tables is one list copy each.
        self._req_block_ids: dict[str, list[int]] = {}
        # How many of a request's leading blocks are keyed (or were found keyed) already.
        self._num_cached_req_blocks: dict[str, int] = {}
        # How many of a request's leading blocks fell behind the sliding window and were
        # released; only requests that released any are here.
        self._num_released: dict[str, int] = {}
        self.prefix_cache_queries_tokens = 0
        self.prefix_cache_hits_tokens = 0

    @property
    def num_blocks(self) -> int:
        """Total blocks in the pool."""
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks not held by any request (prefix-cached ones included)."""
        return self.pool.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks keyed in the prefix cache, used or free."""
        return self.pool.num_cached_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, from 0 to 1."""
        return self.pool.usage

    def get_computed_blocks(self, request: KVCacheRequest) -> tuple[list[KVCacheBlock], int]:
        """Longest prefix of `request`'s full blocks found in the prefix cache.

        Returns the blocks and the number of tokens they hold. Never the whole sequence:
        at least its last token is left to compute, since the runner needs that token's
        logits to sample. Changes nothing (pass the blocks to `allocate_slots` to take them).
        """
        if not self.enable_caching:
            return [], 0
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size,
                            request.cache_salt)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request: KVCacheRequest,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        num_lookahead_tokens: int = 0,
        num_reserved_blocks: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Grow `request`'s block table to hold its next `num_new_tokens` tokens.

        The table will cover request.num_computed_tokens + the tokens of
        `new_computed_blocks` (prefix-cache hits from `get_computed_blocks`, only on a
        request's first allocation) + num_new_tokens + num_lookahead_tokens (slots reserved
        now for tokens computed in later steps). Allocation must leave at least
        `num_reserved_blocks` blocks free (the admission watermark).

        Returns the newly allocated blocks (possibly none), or None when the pool cannot
        satisfy the request; on None nothing has changed. A request's first allocation
        (admission, or resume after preemption) counts as one prefix-cache query of its
        num_tokens, hitting the tokens of `new_computed_blocks`. With a sliding window, the
        blocks behind the window of request.num_computed_tokens are released first, even
        when None is returned (they are not needed either way).
        """
        if num_new_tokens < 0 or num_lookahead_tokens < 0:
            raise ValueError("num_new_tokens and num_lookahead_tokens must be >= 0")
        request_id = request.request_id
        blocks = self._req_blocks.get(request_id)
        if new_computed_blocks and blocks is not None:
            raise ValueError(f"request {request_id} already has a block table: no prefix hits")
        if self.sliding_window is not None and blocks is not None:
            self._release_behind_window(request, blocks, self.sliding_window)
        num_held = len(blocks) if blocks is not None else 0
        num_tokens = (
            request.num_computed_tokens
            + len(new_computed_blocks) * self.block_size
            + num_new_tokens
            + num_lookahead_tokens
        )
        num_new_blocks = cdiv(num_tokens, self.block_size) - num_held - len(new_computed_blocks)
        if blocks is not None and num_new_blocks <= 0:
            return []  # the decode fast path: the last block still has room
        # Free prefix hits sit in the free queue: taking them uses up free blocks too.
        num_free_hits = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        if num_new_blocks + num_free_hits > self.pool.num_free_blocks - num_reserved_blocks:
            return None

        if blocks is None:
            blocks = self._req_blocks[request_id] = []
            self._req_block_ids[request_id] = []
            self._num_cached_req_blocks[request_id] = len(new_computed_blocks)
            if self.enable_caching:
                self.prefix_cache_queries_tokens += request.num_tokens
                self.prefix_cache_hits_tokens += len(new_computed_blocks) * self.block_size
        self.pool.touch(new_computed_blocks, request.priority)
        new_blocks = self.pool.get_new_blocks(num_new_blocks, request.priority)
        block_ids = self._req_block_ids[request_id]
        for block in (*new_computed_blocks, *new_blocks):
            blocks.append(block)
            block_ids.append(block.block_id)
        return new_blocks

    def cache_blocks(self, request: KVCacheRequest, num_computed_tokens: int) -> None:
        """Key in the prefix cache every block of `request` now full of computed tokens.

        Call after a step has computed the tokens (the KV is in the blocks then), with the
        request's new num_computed_tokens.
        """
        if not self.enable_caching:
            return
        request_id = request.request_id
        num_done = self._num_cached_req_blocks.get(request_id)
        num_full = num_computed_tokens // self.block_size
        if num_done is None or num_full <= num_done:
            return
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size,
                            request.cache_salt)
        blocks = self._req_blocks[request_id]
        for i in range(num_done, num_full):
            self.pool.cache_full_block(blocks[i], request.block_hashes[i])
        self._num_cached_req_blocks[request_id] = num_full

    def _release_behind_window(
        self, request: KVCacheRequest, blocks: list[KVCacheBlock], window: int
    ) -> None:
        """Key, then free, the leading blocks that no query from position
        request.num_computed_tokens on can see.

        NOTE: a step still in flight (overlapped steps) may still compute or read them, but
        a step that reads them for a prefix hit, or writes them for another request, runs
        after it (steps run in launch order); so they are keyed now, as update() would.
        """
        first_seen = request.num_computed_tokens - window + 1
        num_behind = min(max(0, first_seen) // self.block_size, len(blocks))
        num_released = self._num_released.get(request.request_id, 0)
        if num_behind <= num_released:
            return
        self.cache_blocks(request, num_behind * self.block_size)
        self.pool.free_blocks(reversed(blocks[num_released:num_behind]))
        self._num_released[request.request_id] = num_behind

    def free(self, request: KVCacheRequest) -> None:
        """Release every block of `request` (no-op if it holds none).

        NOTE: in reverse order, so that the request's tail blocks are evicted before its
        head: the head is the prefix most likely shared with later requests.
        """
        blocks = self._req_blocks.pop(request.request_id, None)
        if blocks is None:
            return
        del self._req_block_ids[request.request_id]
        del self._num_cached_req_blocks[request.request_id]
        num_released = self._num_released.pop(request.request_id, 0)
        self.pool.free_blocks(reversed(blocks[num_released:]))

    def get_block_ids(self, request_id: str) -> list[int]:
        """The block table of `request_id`: the manager's own list, which only grows at its
        end while the request holds blocks (read, do not mutate); empty when it holds none.
        With a sliding window its leading ids may be of blocks it released."""
        return self._req_block_ids.get(request_id, [])

    def get_leading_blocks(self, request_id: str, num_blocks: int) -> list[KVCacheBlock]:
        """The first `num_blocks` blocks `request_id` holds (fewer if it holds fewer), to
        share with a request of the same prefix through `allocate_slots`; none once it
        released any (sliding window)."""
        if request_id in self._num_released:
            return []
        return self._req_blocks.get(request_id, [])[:num_blocks]

    def num_held_blocks(self, request_id: str) -> int:
        """How many blocks `request_id` holds (its table less the blocks it released)."""
        table = self._req_block_ids.get(request_id, ())
        return len(table) - self._num_released.get(request_id, 0)

    def holders(self) -> set[str]:
        """Ids of the requests holding blocks."""
        return set(self._req_blocks)

    def num_blocks_freed_by(self, requests: Iterable[KVCacheRequest]) -> int:
        """How many blocks would become free if all of `requests` were freed.

        A block shared with a request outside the set stays used.
        """
        holds: Counter[int] = Counter()
        for request in requests:
            held = self._req_block_ids.get(request.request_id, [])
            holds.update(held[self._num_released.get(request.request_id, 0):])
        return sum(
            1 for block_id, n in holds.items() if self.pool.blocks[block_id].ref_cnt == n
        )

    def check_integrity(self) -> None:
        """RuntimeError unless free + used == total and every ref count equals the number
        of block tables holding that block (released blocks not counted)."""
        self.pool.check_integrity()
        holds: Counter[int] = Counter()
        for request_id, blocks in self._req_blocks.items():
            block_ids = [block.block_id for block in blocks]
            if block_ids != self._req_block_ids[request_id]:
                raise RuntimeError(f"block table of {request_id} out of sync")
            block_ids = block_ids[self._num_released.get(request_id, 0):]
            if len(set(block_ids)) != len(block_ids):
                raise RuntimeError(f"request {request_id} holds a block twice")
            holds.update(block_ids)
        for block in self.pool.blocks:
            if block.ref_cnt != holds[block.block_id]:
                raise RuntimeError(
                    f"block {block.block_id} has ref_cnt {block.ref_cnt} but "
                    f"{holds[block.block_id]} holders"
                )
