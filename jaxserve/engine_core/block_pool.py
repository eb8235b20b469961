"""Every KV page with its reference count, the free queue and the prefix-cache map.

    blocks:       [0=null] [1] [2] [3] [4] [5] [6] ...
    ref_cnt:          -     2   1   0   0   1   0
    free queue:   head <-> 3 <-> 6 <-> 4 <-> tail     (LRU: evict from the head)
    hash map:     h(A) -> 1, h(AB) -> 2, h(X) -> 3     (page 3 is free but still cached)

A freed page keeps its hash and stays findable until it is handed out again, so
a later request with the same prefix can take it back (`touch`). Page 0 is the
null page that padded tokens write into; it is never handed out.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from jaxserve.engine_core.kv_cache_utils import BlockHash, group_key

if TYPE_CHECKING:
    from jaxserve.engine_core.request import Request


class KVCacheBlock:
    """One KV page: its id (index into the device cache), users and hash."""

    __slots__ = (
        "block_id", "ref_cnt", "block_hash", "prev_free_block", "next_free_block", "is_null"
    )

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Set while the page is full and registered in the prefix cache.
        self.block_hash: BlockHash | None = None
        # Links of the free queue; None while the page is in use.
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None
        self.is_null = False

    def __repr__(self) -> str:
        h = None if self.block_hash is None else self.block_hash[:4].hex()
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={h})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free pages in eviction order, all operations O(1).

    A Python deque cannot remove from the middle in O(1), which a prefix-cache
    hit on a free page needs; so the links live in the blocks themselves,
    between two sentinel blocks.
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self.fake_head = KVCacheBlock(-1)
        self.fake_tail = KVCacheBlock(-1)
        prev = self.fake_head
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = self.fake_tail
        self.fake_tail.prev_free_block = prev

    def popleft(self) -> KVCacheBlock:
        """Take the least recently freed page."""
        block = self.fake_head.next_free_block
        if block is self.fake_tail or block is None:
            raise ValueError("no free KV pages")
        self._unlink(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} free KV pages, {self.num_free_blocks} free")
        out = []
        block = self.fake_head.next_free_block
        for _ in range(n):
            assert block is not None
            out.append(block)
            nxt = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            block = nxt
        self.fake_head.next_free_block = block
        assert block is not None
        block.prev_free_block = self.fake_head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        """Take a page out of the middle (a prefix hit on a free cached page)."""
        if block.prev_free_block is None or block.next_free_block is None:
            raise RuntimeError(f"{block} is not in the free queue")
        self._unlink(block)

    def _unlink(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        assert prev is not None and nxt is not None
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put a page at the tail: evicted after every page freed before it."""
        last = self.fake_tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self.fake_tail
        self.fake_tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            self.append(block)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Free pages in eviction order (for tests and debugging; O(n))."""
        out = []
        block = self.fake_head.next_free_block
        while block is not None and block is not self.fake_tail:
            out.append(block)
            block = block.next_free_block
        return out


class BlockPool:
    """Owns every KV page: hands them out, takes them back, and remembers the
    hashes of full pages so equal prefixes share pages."""

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (page 0 is the null page), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # NOTE: one page per hash. When two requests computed the same page
        # concurrently, the second copy stays unregistered and is evicted first.
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Hand out `num_blocks` pages from the head of the free queue,
        dropping the prefix-cache entry of any page that was still cached."""
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            assert block.ref_cnt == 0, block
            if block.block_hash is not None:
                self._evict_cached_block(block)
            block.ref_cnt = 1
        return blocks

    def uncache_block(self, block: KVCacheBlock) -> None:
        """Drop `block` from the prefix cache if it is registered (its KV was never written)."""
        if block.block_hash is not None:
            self._evict_cached_block(block)

    def _evict_cached_block(self, block: KVCacheBlock) -> None:
        block_hash = block.block_hash
        assert block_hash is not None
        block.block_hash = None
        if self.cached_block_hash_to_block.get(block_hash) is block:
            del self.cached_block_hash_to_block[block_hash]

    def touch(self, blocks: Iterable[KVCacheBlock]) -> int:
        """Take a reference to prefix-hit pages, pulling free ones out of the
        free queue so they cannot be evicted while this request uses them.
        Returns how many were free."""
        taken = 0
        for block in blocks:
            if block.is_null:  # a sliding window's passed page: nobody's
                continue
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
                taken += 1
            block.ref_cnt += 1
        return taken

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> int:
        """Drop one reference from each page; pages nobody uses join the tail of
        the free queue in the given order (the first is evicted first), so
        callers pass a request's pages tail first. Returns how many became free."""
        queue = self.free_block_queue
        freed = 0
        for block in ordered_blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0 and not block.is_null:
                queue.append(block)
                freed += 1
        return freed

    def cache_full_blocks(
        self,
        request: Request,
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        group: int = 0,
    ) -> None:
        """Register pages num_cached_blocks:num_full_blocks of `request` (now
        full of real tokens) under the request's page hashes, as KV cache group
        `group`'s."""
        cache = self.cached_block_hash_to_block
        block_hashes = request.block_hashes
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.block_hash is not None or block.is_null:
                continue
            block_hash = group_key(block_hashes[i], group)
            if block_hash in cache:
                continue
            block.block_hash = block_hash
            cache[block_hash] = block

    def cache_block(self, block: KVCacheBlock, page_hash: BlockHash, group: int) -> None:
        """Register one block (a recurrent group's state at a boundary) under the hash of the
        page that ends there, as group `group`'s."""
        if block.block_hash is not None or block.is_null:
            return
        block_hash = group_key(page_hash, group)
        if block_hash not in self.cached_block_hash_to_block:
            block.block_hash = block_hash
            self.cached_block_hash_to_block[block_hash] = block

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of pages in use (the null page excluded), 0..1."""
        return 1.0 - self.free_block_queue.num_free_blocks / (self.num_blocks - 1)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any page is in use,
        because running requests would lose their registered pages."""
        if self.get_num_free_blocks() != self.num_blocks - 1:
            return False
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block.block_hash = None
        return True
