"""One KV cache group's block tables (vLLM's `SingleTypeKVCacheManager`): the pages each request
holds for the group's layers, how long a prefix it can take from the cache, which pages it
needs for the next tokens and when they go back. One subclass per kind of layer state; each
owns its request tables and its rules, so a new kind adds a class, not a branch.

    full attention   every page of the context, reserved ahead for a chunked prompt; a prefix
                     hit is the leading run of cached pages
    sliding window   only the pages the window of the next token reads (the earlier ones go
                     back, the null page takes their place); a prefix hit needs only the pages
                     the window reads before the hit's end
    recurrent state  state slots of a pool of their own, one table entry per state block
                     (`state_block_size` tokens): the entry of the block the request is in is
                     its live state, updated in place; the entries before it are the states
                     at the block boundaries it passed, registered in the prefix cache and
                     given back (the null slot takes their place); a prefix hit lands only on
                     a boundary whose state is cached
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxserve.engine_core.block_pool import BlockPool, KVCacheBlock
from jaxserve.engine_core.kv_cache_utils import BlockHash, cdiv, group_key
from jaxserve.engine_core.request import Request
from jaxserve.kv_cache_spec import KVCacheGroupSpec


class SingleTypeKVCacheManager:
    """The block tables of one group, over the pool every group shares."""

    def __init__(self, spec: KVCacheGroupSpec, group: int, block_pool: BlockPool,
                 block_size: int) -> None:
        self.spec = spec
        self.group = group  # its index: the prefix cache registers its pages under this key
        self.block_pool = block_pool
        self.block_size = block_size  # tokens per entry of its table
        self.page_size = block_size  # tokens per page hash (the prefix cache's unit)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Per request: its leading pages already registered in the prefix cache.
        self.num_cached_block: dict[str, int] = {}
        self.num_pages = 0  # the pages this group holds (a page shared by requests once)

    # --- what each kind decides ----------------------------------------------------------

    def tokens_to_hold(self, end: int, reserve: int) -> int:
        """How many tokens' pages a request needs to compute up to token `end`, with
        `reserve` >= `end` the tokens later steps of its chunked prompt will reach."""
        raise NotImplementedError

    def find_longest_cache_hit(self, hashes: Sequence[BlockHash], max_pages: int
                               ) -> list[KVCacheBlock]:
        """The longest prefix hit of at most `max_pages` pages, as the pages this group's
        block table starts with (null pages where it reads nothing)."""
        raise NotImplementedError

    def remove_skipped_blocks(self, req_id: str, num_computed_tokens: int) -> None:
        """Give back the pages no query from token `num_computed_tokens` on reads."""

    def new_step(self) -> None:
        """A step is being scheduled: the previous one's work is dispatched."""

    # --- shared by every kind ------------------------------------------------------------

    def cached(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.block_pool.cached_block_hash_to_block.get(group_key(block_hash, self.group))

    def num_held(self, req_id: str) -> int:
        return len(self.req_to_blocks.get(req_id, ()))

    def hit_pages(self, blocks: Sequence[KVCacheBlock]) -> int:
        """The pages (prefix-cache units) a hit of `blocks` entries covers."""
        return len(blocks) * (self.block_size // self.page_size)

    def chunk_limit(self, num_computed_tokens: int) -> int | None:
        """The most tokens a step may compute from `num_computed_tokens` on (None: any)."""
        return None

    def num_new_blocks(self, req_id: str, end: int, reserve: int, hit: int = 0) -> int:
        """The pages to add so the request holds `tokens_to_hold(end, reserve)`, after a
        prefix hit of `hit` pages."""
        need = cdiv(self.tokens_to_hold(end, reserve), self.block_size)
        return max(need - self.num_held(req_id) - hit, 0)

    def save_new_computed_blocks(self, req_id: str, blocks: list[KVCacheBlock]) -> None:
        """Start the request's table with a prefix hit (admission only): its pages are
        registered already."""
        assert not self.req_to_blocks.get(req_id), "a prefix hit is only applied at admission"
        self.num_pages += self.block_pool.touch(blocks)
        self.req_to_blocks[req_id] = list(blocks)
        self.num_cached_block[req_id] = len(blocks)

    def allocate_new_blocks(self, req_id: str, blocks: list[KVCacheBlock]) -> None:
        self.req_to_blocks.setdefault(req_id, []).extend(blocks)
        self.num_cached_block.setdefault(req_id, 0)
        self.num_pages += len(blocks)

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's pages that are full within its first `num_tokens` tokens."""
        num_full_blocks = num_tokens // self.block_size
        num_cached = self.num_cached_block.get(request.req_id)
        if num_cached is None or num_full_blocks <= num_cached:
            return
        self.block_pool.cache_full_blocks(request, self.req_to_blocks[request.req_id],
                                          num_cached, num_full_blocks, self.group)
        self.num_cached_block[request.req_id] = num_full_blocks

    def free(self, req_id: str, num_computed_tokens: int) -> None:
        """Release the request's pages, last page first, so the deepest pages of a prefix
        are evicted before the shared shallow ones. Pages registered past its first
        `num_computed_tokens` tokens (a step scheduled them, then the request was preempted
        in the same schedule(): never computed) leave the prefix cache."""
        blocks = self.req_to_blocks.pop(req_id, [])
        num_cached = self.num_cached_block.pop(req_id, None) or 0
        for block in blocks[num_computed_tokens // self.block_size:num_cached]:
            self.block_pool.uncache_block(block)
        self.num_pages -= self.block_pool.free_blocks(b for b in reversed(blocks) if not b.is_null)

    def get_block_ids(self, req_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(req_id, ())]


class FullAttentionManager(SingleTypeKVCacheManager):
    """Every page of the context."""

    def tokens_to_hold(self, end: int, reserve: int) -> int:
        return reserve

    def find_longest_cache_hit(self, hashes: Sequence[BlockHash], max_pages: int
                               ) -> list[KVCacheBlock]:
        found: list[KVCacheBlock] = []
        for block_hash in hashes[:max_pages]:
            block = self.cached(block_hash)
            if block is None:
                break
            found.append(block)
        return found


class PassedBlocksManager(SingleTypeKVCacheManager):
    """A kind whose leading entries stop being read as the request grows: they go back to the
    pool (cached ones stay in the prefix cache) and the null block takes their place."""

    def __init__(self, spec: KVCacheGroupSpec, group: int, block_pool: BlockPool,
                 block_size: int) -> None:
        super().__init__(spec, group, block_pool, block_size)
        # Per request: its leading entries given back (the null block in their place).
        self.num_skipped_block: dict[str, int] = {}

    def num_passed(self, num_computed_tokens: int) -> int:
        """How many leading entries no step from `num_computed_tokens` on reads."""
        raise NotImplementedError

    def remove_skipped_blocks(self, req_id: str, num_computed_tokens: int) -> None:
        blocks = self.req_to_blocks.get(req_id)
        if blocks is None:
            return
        skipped = self.num_skipped_block[req_id]
        n = min(self.num_passed(num_computed_tokens), len(blocks))
        if n > skipped:
            passed = [b for b in blocks[skipped:n] if not b.is_null]
            blocks[skipped:n] = [self.block_pool.null_block] * (n - skipped)
            self.num_skipped_block[req_id] = n
            self.num_pages -= self.block_pool.free_blocks(reversed(passed))

    def save_new_computed_blocks(self, req_id: str, blocks: list[KVCacheBlock]) -> None:
        super().save_new_computed_blocks(req_id, blocks)
        self.num_skipped_block[req_id] = sum(1 for b in blocks if b.is_null)

    def allocate_new_blocks(self, req_id: str, blocks: list[KVCacheBlock]) -> None:
        super().allocate_new_blocks(req_id, blocks)
        self.num_skipped_block.setdefault(req_id, 0)

    def free(self, req_id: str, num_computed_tokens: int) -> None:
        super().free(req_id, num_computed_tokens)
        self.num_skipped_block.pop(req_id, None)


class SlidingWindowManager(PassedBlocksManager):
    """The pages the window of the request's next token reads: about window / block_size
    pages however long the request grows. Pages are added as the tokens reach them (never
    reserved ahead: they would be given back before they are read)."""

    def __init__(self, spec: KVCacheGroupSpec, group: int, block_pool: BlockPool,
                 block_size: int) -> None:
        super().__init__(spec, group, block_pool, block_size)
        assert spec.sliding_window is not None
        self.window: int = spec.sliding_window

    def tokens_to_hold(self, end: int, reserve: int) -> int:
        return end

    def find_longest_cache_hit(self, hashes: Sequence[BlockHash], max_pages: int
                               ) -> list[KVCacheBlock]:
        """vLLM's rule: a hit of m pages needs only the pages the window of token
        m * block_size reads to be cached; the ones before them are null."""
        need = cdiv(self.window - 1, self.block_size)
        null = self.block_pool.null_block
        if need == 0:
            return [null] * max_pages
        run: list[KVCacheBlock] = []  # the cached pages from i on, the last first
        for i in range(max_pages - 1, -1, -1):
            block = self.cached(hashes[i])
            if block is None:
                run = []
                continue
            run.append(block)
            if len(run) >= need:
                return [null] * i + run[::-1][:need]
        return run[::-1]


    def num_passed(self, num_computed_tokens: int) -> int:
        return max(num_computed_tokens - self.window + 1, 0) // self.block_size


class RecurrentStateManager(PassedBlocksManager):
    """State slots of linear-attention layers (vLLM's MambaManager, its "align" mode), over
    the state pool. Entry i of a request's table is the state after its first
    (i + 1) * state_block_size tokens; the request reads the entry of its last computed
    token's block and writes the entry of the step's last token, the same one but in the
    first step after a boundary (the scheduler ends chunks on boundaries: `chunk_limit`), so
    each boundary's state survives its request's next step. Without kept states
    (state_block_size 0, or no prefix caching) one entry covers the whole context: one slot,
    updated in place."""

    def __init__(self, spec: KVCacheGroupSpec, group: int, block_pool: BlockPool,
                 block_size: int, max_model_len: int) -> None:
        super().__init__(spec, group, block_pool, block_size)
        assert spec.recurrent and spec.state_block_size % block_size == 0
        # Kept for the prefix cache only: without it, one slot updated in place.
        self.keeps_states = spec.state_block_size > 0 and block_pool.enable_caching
        self.block_size = spec.state_block_size if self.keeps_states else max_model_len
        # States a step scheduled so far computes: registered when the next step is scheduled
        # (a request of the same step would read its initial state before this one's write).
        self._pending: list[tuple[str, KVCacheBlock, BlockHash]] = []

    def tokens_to_hold(self, end: int, reserve: int) -> int:
        return end  # a state block's entry is taken when the request reaches it

    def chunk_limit(self, num_computed_tokens: int) -> int | None:
        if not self.keeps_states:
            return None
        return self.block_size - num_computed_tokens % self.block_size

    def find_longest_cache_hit(self, hashes: Sequence[BlockHash], max_pages: int
                               ) -> list[KVCacheBlock]:
        """The longest hit ending on a boundary whose state is cached: the null slot for
        each boundary before it, then that state."""
        if not self.keeps_states:
            return []
        ratio = self.block_size // self.page_size
        for k in range(max_pages // ratio, 0, -1):
            state = self.cached(hashes[k * ratio - 1])
            if state is not None:
                return [self.block_pool.null_block] * (k - 1) + [state]
        return []


    def num_passed(self, num_computed_tokens: int) -> int:
        """The entries before the one the next step reads (the state after the request's last
        computed token); the cached ones stay in the prefix cache."""
        return max(num_computed_tokens - 1, 0) // self.block_size

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the states at the boundaries within the request's first `num_tokens`
        tokens, each under the hash of the page that ends at its boundary."""
        if not self.keeps_states:
            return
        req_id = request.req_id
        num_cached = self.num_cached_block.get(req_id)
        blocks = self.req_to_blocks.get(req_id)
        num_full = num_tokens // self.block_size
        if num_cached is None or blocks is None or num_full <= num_cached:
            return
        ratio = self.block_size // self.page_size
        for i in range(num_cached, min(num_full, len(blocks))):
            self._pending.append((req_id, blocks[i], request.block_hashes[(i + 1) * ratio - 1]))
        self.num_cached_block[req_id] = num_full

    def new_step(self) -> None:
        """Register the states the previous step computed. One its request no longer holds
        (preempted before its step ran, or aborted) may never have been written: skipped."""
        for req_id, block, page_hash in self._pending:
            if any(b is block for b in self.req_to_blocks.get(req_id, ())):
                self.block_pool.cache_block(block, page_hash, self.group)
        self._pending.clear()


def make_manager(spec: KVCacheGroupSpec, group: int, block_pool: BlockPool, block_size: int,
                 max_model_len: int, state_pool: BlockPool | None = None
                 ) -> SingleTypeKVCacheManager:
    """The manager of the group's kind of layer state (a recurrent one over `state_pool`)."""
    if spec.recurrent:
        if state_pool is None:
            raise ValueError("a recurrent-state group needs a pool of state slots")
        return RecurrentStateManager(spec, group, state_pool, block_size, max_model_len)
    kind = SlidingWindowManager if spec.sliding_window is not None else FullAttentionManager
    return kind(spec, group, block_pool, block_size)
