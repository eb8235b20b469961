"""The KV cache groups' managers behind one interface (vLLM's `KVCacheCoordinator`): a prefix
hit every group agrees on, and the pages each group needs for the next tokens.

    group 0  full attention    FullAttentionManager    hit: 5 pages
    group 1  sliding window    SlidingWindowManager    hit at 5 pages: window's pages cached? no -> 3
    group 0 again at 3 pages: its first 3 pages, still a hit          -> every group at 3 pages

A full-attention hit stays a hit when cut shorter (it is a prefix); a sliding-window hit at
fewer pages needs other pages cached, and a recurrent state hit lands only on a state block's
boundary, so those groups are asked again until all agree. Attention groups share the pool
of pages; recurrent groups take slots from the pool of states.
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxserve.engine_core.block_pool import BlockPool, KVCacheBlock
from jaxserve.engine_core.kv_cache_utils import BlockHash
from jaxserve.engine_core.request import Request
from jaxserve.engine_core.single_type_kv_cache_manager import (
    FullAttentionManager,
    SingleTypeKVCacheManager,
    make_manager,
)
from jaxserve.kv_cache_spec import KVCacheGroups

# Pages of each group, one list per KV cache group (vLLM's KVCacheBlocks.blocks).
GroupBlocks = tuple[list[KVCacheBlock], ...]


class KVCacheCoordinator:
    """One manager per KV cache group, over one BlockPool."""

    def __init__(self, kv_cache_groups: KVCacheGroups, block_pool: BlockPool,
                 block_size: int, max_model_len: int,
                 state_pool: BlockPool | None = None) -> None:
        self.block_pool = block_pool
        self.state_pool = state_pool
        self.block_size = block_size
        self.managers: tuple[SingleTypeKVCacheManager, ...] = tuple(
            make_manager(spec, g, block_pool, block_size, max_model_len, state_pool)
            for g, spec in enumerate(kv_cache_groups.groups))
        self.pools = tuple({id(m.block_pool): m.block_pool for m in self.managers}.values())
        # Full attention first: its hit only ever shrinks the others'.
        self._hit_order = sorted(self.managers,
                                 key=lambda m: not isinstance(m, FullAttentionManager))

    def empty(self) -> GroupBlocks:
        return tuple([] for _ in self.managers)

    def find_longest_cache_hit(self, hashes: Sequence[BlockHash]) -> tuple[GroupBlocks, int]:
        """The longest prefix of `hashes` every group can take from the cache: (each group's
        pages, the number of pages)."""
        n = len(hashes)
        hits: dict[int, list[KVCacheBlock]] = {}
        changed = True
        while changed:
            changed = False
            for m in self._hit_order:
                if m.group in hits and (isinstance(m, FullAttentionManager)
                                        or m.hit_pages(hits[m.group]) == n):
                    continue  # still a hit at n pages
                hits[m.group] = m.find_longest_cache_hit(hashes, n)
                if m.hit_pages(hits[m.group]) < n:
                    n, changed = m.hit_pages(hits[m.group]), True
        # Every group but full attention's now covers exactly n pages.
        return tuple(hits[m.group][:n] for m in self.managers), n

    def get_num_blocks_to_allocate(self, req_id: str, end: int, reserve: int,
                                   hit: GroupBlocks) -> list[int]:
        """Each group's pages (or state slots) to add, after the prefix hit `hit`."""
        return [m.num_new_blocks(req_id, end, reserve, len(h))
                for m, h in zip(self.managers, hit)]

    def fits(self, counts: list[int], hit: GroupBlocks) -> bool:
        """Whether each pool has the free blocks `counts` asks of it. A hit block nobody holds
        sits in its pool's free queue: touching it takes it from there, so it counts too."""
        for pool in self.pools:
            need = 0
            for m, count, blocks in zip(self.managers, counts, hit):
                if m.block_pool is pool:
                    need += count + sum(1 for b in blocks if b.ref_cnt == 0 and not b.is_null)
            if need > pool.get_num_free_blocks():
                return False
        return True

    def chunk_limit(self, num_computed_tokens: int) -> int | None:
        """The most tokens a step may compute from `num_computed_tokens` on, so that it ends
        on a state block's boundary if it reaches one (None: any)."""
        limits = [n for m in self.managers if (n := m.chunk_limit(num_computed_tokens))]
        return min(limits) if limits else None

    def new_step(self) -> None:
        for m in self.managers:
            m.new_step()

    def remove_skipped_blocks(self, req_id: str, num_computed_tokens: int) -> None:
        for m in self.managers:
            m.remove_skipped_blocks(req_id, num_computed_tokens)

    def save_new_computed_blocks(self, req_id: str, hit: GroupBlocks) -> None:
        for m, blocks in zip(self.managers, hit):
            m.save_new_computed_blocks(req_id, blocks)

    def allocate_new_blocks(self, req_id: str, counts: list[int]) -> GroupBlocks:
        """Take `counts[g]` free blocks of its pool for each group g; returns them."""
        added = self.empty()
        for m, count in zip(self.managers, counts):
            if count:
                added[m.group].extend(m.block_pool.get_new_blocks(count))
            m.allocate_new_blocks(req_id, added[m.group])
        return added

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register each group's blocks complete within the request's first
        `num_computed_tokens` tokens."""
        for m in self.managers:
            m.cache_blocks(request, num_computed_tokens)

    def free(self, req_id: str, num_computed_tokens: int) -> None:
        for m in self.managers:
            m.free(req_id, num_computed_tokens)

    def get_blocks(self, req_id: str) -> GroupBlocks | None:
        """The request's pages per group; None when it holds none."""
        if all(req_id not in m.req_to_blocks for m in self.managers):
            return None
        return tuple(m.req_to_blocks.get(req_id, []) for m in self.managers)

    def get_block_ids(self, req_id: str) -> tuple[list[int], ...]:
        return tuple(m.get_block_ids(req_id) for m in self.managers)
