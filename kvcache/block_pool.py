"""The pool of KV blocks: ref counts, free blocks in eviction order, the prefix-cache map.

A block is in one of three states:
- used: ref_cnt > 0, held by one or more requests (shared prefix blocks have ref_cnt > 1);
- free and cached: ref_cnt == 0, still keyed in the prefix cache (a later request with the
  same prefix can take it back with `touch`);
- free: ref_cnt == 0, no key.
Eviction is lazy: a free block keeps its key until `get_new_blocks` hands it out again.

Eviction order (`FreeBlocks`): unkeyed blocks first (they can never be hit), then cached
blocks by priority class, the worst class first, least recently freed first within a
class. A block's class is the most urgent priority among the requests that used it since
it was last handed out, so a low-priority load cannot evict an urgent tenant's cached
prompt while other cached blocks remain. Under fcfs every request has priority 0: one
class, plain LRU.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from kvcache.hashing import BlockHash


class KVCacheBlock:
    """One block of block_size token slots; `prev_free`/`next_free` link the free queue."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "priority", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        # The most urgent (smallest) priority of the requests that used the block since it
        # was last handed out: its eviction class once free and cached.
        self.priority = 0
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        key = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={key})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks; the head is evicted (reused) first.

    O(1) popleft, append, appendleft and remove from the middle (a prefix-cache hit takes a
    free block back out of the queue). Sentinel head and tail nodes keep the links simple.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        """Remove and return the block to evict next; IndexError when empty."""
        block = self._head.next_free
        if block is None or block is self._tail:
            raise IndexError("no free block")
        self.remove(block)
        return block

    def append(self, block: KVCacheBlock) -> None:
        """Put `block` at the tail (evicted last)."""
        self._link(block, self._tail.prev_free, self._tail)

    def appendleft(self, block: KVCacheBlock) -> None:
        """Put `block` at the head (evicted first)."""
        self._link(block, self._head, self._head.next_free)

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink `block` from anywhere in the queue; ValueError if it is not in it."""
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Free blocks in eviction order, head first."""
        node = self._head.next_free
        while node is not None and node is not self._tail:
            yield node
            node = node.next_free

    def __len__(self) -> int:
        """Number of free blocks."""
        return self.num_free_blocks

    def _link(
        self, block: KVCacheBlock, prev: KVCacheBlock | None, nxt: KVCacheBlock | None
    ) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        assert prev is not None and nxt is not None  # sentinels are always linked
        block.prev_free, block.next_free = prev, nxt
        prev.next_free = block
        nxt.prev_free = block
        self.num_free_blocks += 1


class FreeBlocks:
    """Every free block, in eviction order: unkeyed, then cached by class, worst first.

    One `FreeKVCacheBlockQueue` for unkeyed blocks and one per priority class of cached
    blocks; a block's queue follows from its key and class, which do not change while it
    is free. O(1) per block, plus a look over the (few) classes to find the worst one.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._unkeyed = FreeKVCacheBlockQueue(blocks)
        self._cached: dict[int, FreeKVCacheBlockQueue] = {}
        self.num_free_blocks = self._unkeyed.num_free_blocks  # cached or not

    def push(self, block: KVCacheBlock) -> None:
        """A block just freed: an unkeyed one goes first in line for eviction, a cached one
        last in its class."""
        if block.block_hash is None:
            self._unkeyed.appendleft(block)
        else:
            queue = self._cached.get(block.priority)
            if queue is None:
                queue = self._cached[block.priority] = FreeKVCacheBlockQueue(())
            queue.append(block)
        self.num_free_blocks += 1

    def pop(self) -> KVCacheBlock:
        """Remove and return the block to evict next; IndexError when none is free."""
        if self._unkeyed.num_free_blocks:
            block = self._unkeyed.popleft()
        elif self._cached:
            worst = max(self._cached)
            queue = self._cached[worst]
            block = queue.popleft()
            if not queue.num_free_blocks:
                del self._cached[worst]
        else:
            raise IndexError("no free block")
        self.num_free_blocks -= 1
        return block

    def remove(self, block: KVCacheBlock) -> None:
        """Take a free block out (a prefix-cache hit); ValueError if it is not free."""
        if block.block_hash is None:
            self._unkeyed.remove(block)
        else:
            queue = self._cached.get(block.priority)
            if queue is None:
                raise ValueError(f"block {block.block_id} is not in the free queue")
            queue.remove(block)
            if not queue.num_free_blocks:
                del self._cached[block.priority]
        self.num_free_blocks -= 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Free blocks in eviction order."""
        yield from self._unkeyed
        for priority in sorted(self._cached, reverse=True):
            yield from self._cached[priority]

    def __len__(self) -> int:
        """Number of free blocks."""
        return self.num_free_blocks


class BlockPool:
    """All KV blocks of the cache, their ref counts, the free queue and the prefix cache."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlocks(self.blocks)
        # Key -> the one block holding it. A second block filled with the same tokens
        # (two requests computing one prefix at once) stays unkeyed.
        self.cached_blocks: dict[BlockHash, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref_cnt 0 (cached or not): what `get_new_blocks` can hand out."""
        return self.free_queue.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks keyed in the prefix cache, used or free."""
        return len(self.cached_blocks)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (ref_cnt > 0), from 0 to 1."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_new_blocks(self, num_blocks: int, priority: int = 0) -> list[KVCacheBlock]:
        """Take the next `num_blocks` blocks in eviction order, evicting their keys, for a
        request of `priority`.

        Each returned block has ref_cnt 1. ValueError if fewer blocks are free.
        """
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"cannot get {num_blocks} blocks: {self.num_free_blocks} free")
        blocks = []
        for _ in range(num_blocks):
            block = self.free_queue.pop()
            self._evict(block)
            block.ref_cnt = 1
            block.priority = priority
            blocks.append(block)
        return blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The block keyed `block_hash` (used or free), or None."""
        return self.cached_blocks.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock], priority: int = 0) -> None:
        """Take a reference on prefix-cache hits for a request of `priority`, pulling free
        ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1
            block.priority = min(block.priority, priority)

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; a block reaching 0 joins the free blocks
        (`FreeBlocks.push`: unkeyed ones are reused first, cached ones by class and age)."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} freed with ref_cnt {block.ref_cnt}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.push(block)

    def cache_full_block(self, block: KVCacheBlock, block_hash: BlockHash) -> bool:
        """Key a full, computed block in the prefix cache; False if the key is taken already
        (or the block is keyed, or caching is off)."""
        if not self.enable_caching or block.block_hash is not None:
            return False
        if block_hash in self.cached_blocks:
            return False
        block.block_hash = block_hash
        self.cached_blocks[block_hash] = block
        return True

    def check_integrity(self) -> None:
        """RuntimeError unless the free queue, ref counts and prefix-cache map agree."""
        seen: set[int] = set()
        for block in self.free_queue:
            if block.block_id in seen:
                raise RuntimeError(f"block {block.block_id} twice in the free queue")
            seen.add(block.block_id)
            if block.ref_cnt != 0:
                raise RuntimeError(f"free block {block.block_id} has ref_cnt {block.ref_cnt}")
        if len(seen) != self.num_free_blocks:
            raise RuntimeError(
                f"free queue holds {len(seen)} blocks but counts {self.num_free_blocks}"
            )
        num_used = sum(1 for block in self.blocks if block.ref_cnt > 0)
        if num_used + self.num_free_blocks != self.num_blocks:
            raise RuntimeError(
                f"free ({self.num_free_blocks}) + used ({num_used}) != total "
                f"({self.num_blocks}): a block with ref_cnt 0 is missing from the free queue"
            )
        for block_hash, block in self.cached_blocks.items():
            if block.block_hash != block_hash:
                raise RuntimeError(f"cache map and block {block.block_id} disagree on its key")
        num_keyed = sum(1 for block in self.blocks if block.block_hash is not None)
        if num_keyed != len(self.cached_blocks):
            raise RuntimeError(f"{num_keyed} keyed blocks but {len(self.cached_blocks)} in map")

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            del self.cached_blocks[block.block_hash]
            block.block_hash = None
