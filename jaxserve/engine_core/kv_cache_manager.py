"""Makes sure each scheduled token has a KV slot (vLLM's `KVCacheManager`).

A request owns a list of pages, its block table; token i lives in page
`blocks[i // block_size]` at offset `i % block_size`:

    tokens:  [t0 .. t15][t16 .. t31][t32 t33 _ _ ...]
    pages:   [   7     ][    3     ][     12        ]    block_ids = [7, 3, 12]
              cached      cached      partial (not cached)

With prefix caching the leading full pages may be shared with other requests
(found by hash at admission); only full pages of real tokens are registered.
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxserve.engine_core.block_pool import BlockPool, KVCacheBlock
from jaxserve.engine_core.kv_cache_utils import RequestBlockHasher, cdiv
from jaxserve.engine_core.request import Request
from jaxserve.engine_core.stats import PrefixCacheStats


class KVCacheManager:
    """Block tables of the running requests over one BlockPool."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        enable_prefix_caching: bool = True,
    ) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks, enable_prefix_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Number of leading pages of each request already registered in the cache.
        self.num_cached_block: dict[str, int] = {}
        self.block_hasher = RequestBlockHasher(block_size) if enable_prefix_caching else None
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """Counters since the previous call; resets them."""
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of `request`, as (pages, number of tokens).

        NOTE: the hit never covers the last token: its logits are needed to
        sample the next token, so at least one token is always computed.
        """
        pooling = request.pooling_params
        if (not self.enable_caching or request.sampling_params.prompt_logprobs is not None
                or (pooling is not None and not pooling.uses_prefix_cache)):
            # Prompt logprobs, MEAN and CLS pooling need every prompt position computed.
            return [], 0
        cached = self.block_pool.cached_block_hash_to_block
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = cached.get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Sequence[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Add pages so `request` can compute `num_new_tokens` more tokens.

        `new_computed_blocks` / `num_new_computed_tokens` are a prefix hit from
        get_computed_blocks (admission only). `num_lookahead_tokens` reserves
        pages for tokens scheduled in later steps (the rest of a chunked
        prompt) without registering them in the prefix cache.

        Returns the newly added pages ([] if none were needed), or None, with
        nothing changed, when the free pages are not enough.
        """
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be > 0, got {num_new_tokens}")
        req_id = request.req_id
        req_blocks = self.req_to_blocks.get(req_id)
        if req_blocks is not None and not new_computed_blocks:
            # Fast path (most decode steps): the request's pages already hold
            # the new tokens. Same result as the general path below.
            end = request.num_computed_tokens + num_new_tokens
            if end + num_lookahead_tokens <= len(req_blocks) * self.block_size:
                if self.enable_caching:
                    num_tokens = request.num_tokens
                    if (end if end < num_tokens else num_tokens) // self.block_size > (
                        self.num_cached_block[req_id]
                    ):
                        self.cache_blocks(request, min(end, num_tokens))
                return []
        is_new = req_blocks is None
        if req_blocks is None:
            req_blocks = self.req_to_blocks[req_id] = []
            self.num_cached_block[req_id] = 0
        computed = new_computed_blocks or ()
        if computed:
            assert not req_blocks, "a prefix hit is only applied at admission"

        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        num_tokens_need_slot = min(
            num_computed_tokens + num_new_tokens + num_lookahead_tokens, self.max_model_len
        )
        num_new_blocks = (
            cdiv(num_tokens_need_slot, self.block_size) - len(req_blocks) - len(computed)
        )
        pool = self.block_pool
        if num_new_blocks > 0 or computed:
            # NOTE: a hit page with ref_cnt 0 sits in the free queue; touching
            # it removes it from there, so it costs a free page too.
            num_evictable = sum(1 for b in computed if b.ref_cnt == 0)
            if max(num_new_blocks, 0) + num_evictable > pool.free_block_queue.num_free_blocks:
                if is_new:
                    del self.req_to_blocks[req_id], self.num_cached_block[req_id]
                return None
            if computed:
                pool.touch(computed)
                req_blocks.extend(computed)
                self.num_cached_block[req_id] = len(computed)
        if request.num_computed_tokens == 0 and self.enable_caching:
            # First allocation since admission: count the lookup once here
            # rather than in get_computed_blocks, which may be retried.
            stats = self.prefix_cache_stats
            stats.requests += 1
            stats.queries += request.num_tokens
            stats.hits += num_new_computed_tokens

        new_blocks = pool.get_new_blocks(num_new_blocks) if num_new_blocks > 0 else []
        if new_blocks:
            req_blocks.extend(new_blocks)
        if self.enable_caching:
            # NOTE: pages are registered when scheduled, before the device
            # computes them. A request that hits them later is scheduled in a
            # later step (or later in this step's batch, whose KV writes
            # precede its attention reads), so it never reads them unwritten.
            # Capped at num_tokens: placeholders are not real tokens yet.
            self.cache_blocks(
                request, min(num_computed_tokens + num_new_tokens, request.num_tokens)
            )
        return new_blocks

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's pages that are full within its first
        `num_computed_tokens` tokens."""
        req_id = request.req_id
        num_full_blocks = num_computed_tokens // self.block_size
        num_cached = self.num_cached_block.get(req_id)
        if num_cached is None or num_full_blocks <= num_cached:
            return
        self.block_pool.cache_full_blocks(
            request, self.req_to_blocks[req_id], num_cached, num_full_blocks
        )
        self.num_cached_block[req_id] = num_full_blocks

    def cache_filled_pages(self, request: Request, num_new_tokens: int) -> None:
        """Async scheduling: `num_new_tokens` real tokens just replaced placeholders. If a
        page filled, register it now (dispatched steps compute its KV) rather than at the
        request's next allocation."""
        num_tokens, bs = request.num_tokens, self.block_size
        if (
            self.enable_caching
            and request.num_computed_tokens > 0  # holds pages (was not preempted)
            and num_tokens // bs != (num_tokens - num_new_tokens) // bs
        ):
            self.cache_blocks(request, min(request.num_computed_tokens, num_tokens))

    def free(self, request: Request) -> None:
        """Release the request's pages, last page first, so the deepest pages
        of a prefix are evicted before the shared shallow ones."""
        blocks = self.req_to_blocks.pop(request.req_id, None)
        self.num_cached_block.pop(request.req_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def get_blocks(self, req_id: str) -> list[KVCacheBlock]:
        return self.req_to_blocks.get(req_id, [])

    def get_block_ids(self, req_id: str) -> list[int]:
        """The request's block table as page ids."""
        return [b.block_id for b in self.req_to_blocks.get(req_id, ())]

    def reset_prefix_cache(self) -> bool:
        """Drop every cached page hash (e.g. after new weights are loaded)."""
        return self.block_pool.reset_prefix_cache()
