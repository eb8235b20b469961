"""Makes sure each scheduled token has a KV slot (vLLM's `KVCacheManager`, with its hybrid
coordinator's groups: kv_cache_spec.py).

A request owns one list of pages per KV cache group, its block tables; token i of a group lives
in page `blocks[i // block_size]` at offset `i % block_size`:

    tokens:  [t0 .. t15][t16 .. t31][t32 t33 _ _ ...]
    full:    [   7     ][    3     ][     12        ]    block_ids = [7, 3, 12]
    sliding: [  null   ][    9     ][     4         ]    window 20: t0..t15 are never read again
              cached      cached      partial (not cached)

A sliding-window group gives back each page that falls wholly before the window of the
request's next token (the null page 0 takes its place), so it holds about window / block_size
pages however long the request grows. With prefix caching the leading full pages may be shared
with other requests (found by hash at admission); only full pages of real tokens are
registered, each group's under its own key.
"""

from __future__ import annotations

from jaxserve.engine_core.block_pool import BlockPool, KVCacheBlock
from jaxserve.engine_core.kv_cache_utils import BlockHash, RequestBlockHasher, cdiv, group_key
from jaxserve.engine_core.request import Request
from jaxserve.engine_core.stats import PrefixCacheStats
from jaxserve.kv_cache_spec import FULL_ATTENTION, KVCacheGroups

# Pages of each group, one list per KV cache group (vLLM's KVCacheBlocks.blocks).
GroupBlocks = tuple[list[KVCacheBlock], ...]


class KVCacheManager:
    """Block tables of the running requests, one per group, over one BlockPool."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        enable_prefix_caching: bool = True,
        kv_cache_groups: KVCacheGroups = FULL_ATTENTION,
    ) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_prefix_caching
        self.kv_cache_groups = kv_cache_groups
        self.windows = tuple(g.sliding_window for g in kv_cache_groups.groups)
        # The sliding groups and their windows.
        self.sliding_windows = {g: w for g, w in enumerate(self.windows) if w is not None}
        self.sliding = tuple(self.sliding_windows)
        self.block_pool = BlockPool(num_blocks, enable_prefix_caching)
        self.req_to_blocks: dict[str, GroupBlocks] = {}
        # Per request and group: leading pages already registered in the prefix cache, and
        # leading pages a sliding window no longer reads (given back, the null page instead).
        self.num_cached_block: dict[str, list[int]] = {}
        self.num_skipped_block: dict[str, list[int]] = {}
        self.group_pages = [0] * len(self.windows)  # pages each group holds (shared: once)
        self.block_hasher = RequestBlockHasher(block_size) if enable_prefix_caching else None
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def empty(self) -> GroupBlocks:
        return tuple([] for _ in self.windows)

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def group_usage(self) -> list[float]:
        """The fraction of all pages each group holds (they add up to `usage`)."""
        return [n / (self.block_pool.num_blocks - 1) for n in self.group_pages]

    def usage_by_kind(self) -> dict[str, float]:
        """`group_usage` summed by the groups' kind, for /debug."""
        out: dict[str, float] = {}
        for spec, share in zip(self.kv_cache_groups.groups, self.group_usage()):
            out[spec.kind] = out.get(spec.kind, 0.0) + share
        return out

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """Counters since the previous call; resets them."""
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    # --- prefix cache ---------------------------------------------------------

    def _cached(self, block_hash: BlockHash, group: int) -> KVCacheBlock | None:
        return self.block_pool.cached_block_hash_to_block.get(group_key(block_hash, group))

    def get_computed_blocks(self, request: Request) -> tuple[GroupBlocks, int]:
        """Longest cached prefix of `request`, as (pages per group, number of tokens).

        A full-attention group needs every page of the prefix; a sliding-window group only
        the pages the window of the first uncomputed token reads (vLLM's rule), the others
        are null. NOTE: the hit never covers the last token: its logits are needed to sample
        the next token, so at least one token is always computed.
        """
        pooling = request.pooling_params
        if (not self.enable_caching or request.sampling_params.prompt_logprobs is not None
                or (pooling is not None and not pooling.uses_prefix_cache)):
            # Prompt logprobs, MEAN and CLS pooling need every prompt position computed.
            return self.empty(), 0
        hashes = request.block_hashes[: (request.num_tokens - 1) // self.block_size]
        hits: list[list[KVCacheBlock]] = [[] for _ in self.windows]
        n = len(hashes)
        for g, window in enumerate(self.windows):
            if window is None:
                found = hits[g]
                for block_hash in hashes[:n]:
                    block = self._cached(block_hash, g)
                    if block is None:
                        break
                    found.append(block)
                n = len(found)
        changed = bool(self.sliding)
        while changed:  # each sliding group's hit at n, until they all agree on n
            changed = False
            for g in self.sliding:
                m, hits[g] = self._window_hit(hashes, n, g)
                changed |= m < n
                n = min(n, m)
        return tuple(h[:n] for h in hits), n * self.block_size

    def _window_hit(self, hashes: list[BlockHash], n: int, group: int
                    ) -> tuple[int, list[KVCacheBlock]]:
        """The longest hit m <= n pages for a sliding group: the pages its window reads before
        token m * block_size are cached (those before them are null)."""
        need = cdiv(self.sliding_windows[group] - 1, self.block_size)
        null = self.block_pool.null_block
        run: list[KVCacheBlock] = []  # the cached pages from i on, the last first
        for i in range(n - 1, -1, -1):
            block = self._cached(hashes[i], group)
            if block is None:
                run = []
                continue
            run.append(block)
            if len(run) >= need:
                return i + need, [null] * i + run[::-1][:need]
        if need == 0:
            return n, [null] * n
        return len(run), run[::-1]

    # --- allocation -----------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: GroupBlocks | None = None,
        num_lookahead_tokens: int = 0,
    ) -> GroupBlocks | None:
        """Add pages so `request` can compute `num_new_tokens` more tokens.

        `new_computed_blocks` / `num_new_computed_tokens` are a prefix hit from
        get_computed_blocks (admission only). `num_lookahead_tokens` reserves full-attention
        pages for tokens scheduled in later steps (the rest of a chunked prompt) without
        registering them in the prefix cache; a sliding group takes its pages step by step.

        Returns each group's added pages (all [] if none were needed), or None, with nothing
        changed but the pages windows have passed, when the free pages are not enough.
        """
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be > 0, got {num_new_tokens}")
        req_id = request.req_id
        req_blocks = self.req_to_blocks.get(req_id)
        computed = new_computed_blocks if new_computed_blocks and any(new_computed_blocks) else None
        if req_blocks is not None and self.sliding:
            self._free_passed(req_id, request.num_computed_tokens)
        bs = self.block_size
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        end = min(num_computed + num_new_tokens, self.max_model_len)
        reserve = min(end + num_lookahead_tokens, self.max_model_len)
        if req_blocks is not None and computed is None and all(
                len(blocks) * bs >= (end if w is not None else reserve)
                for blocks, w in zip(req_blocks, self.windows)):
            # Fast path (most decode steps): the pages already hold the new tokens.
            if self.enable_caching:
                self.cache_blocks(request, min(end, request.num_tokens))
            return self.empty()
        is_new = req_blocks is None
        if req_blocks is None:
            req_blocks = self.req_to_blocks[req_id] = self.empty()
            self.num_cached_block[req_id] = [0] * self.num_groups
            self.num_skipped_block[req_id] = [0] * self.num_groups
        hit = computed or self.empty()
        if computed is not None:
            assert not any(req_blocks), "a prefix hit is only applied at admission"
        # Per group: how many pages to add (a sliding group's table never starts past its
        # window: tokens are scheduled in order, so its pages are added as they are reached).
        counts = [max(cdiv(end if w is not None else reserve, bs) - len(blocks) - len(h), 0)
                  for blocks, h, w in zip(req_blocks, hit, self.windows)]
        num_new_blocks = sum(counts)
        pool = self.block_pool
        # NOTE: a hit page with ref_cnt 0 sits in the free queue; touching it removes it from
        # there, so it costs a free page too.
        num_evictable = sum(1 for blocks in hit for b in blocks if b.ref_cnt == 0 and not b.is_null)
        if num_new_blocks + num_evictable > pool.free_block_queue.num_free_blocks:
            if is_new:
                del self.req_to_blocks[req_id], self.num_cached_block[req_id]
                del self.num_skipped_block[req_id]
            return None
        if computed is not None:
            for g, blocks in enumerate(computed):
                self.group_pages[g] += pool.touch(blocks)
                req_blocks[g].extend(blocks)
                self.num_cached_block[req_id][g] = len(blocks)
                self.num_skipped_block[req_id][g] = sum(1 for b in blocks if b.is_null)
        if request.num_computed_tokens == 0 and self.enable_caching:
            # First allocation since admission: count the lookup once here
            # rather than in get_computed_blocks, which may be retried.
            stats = self.prefix_cache_stats
            stats.requests += 1
            stats.queries += request.num_tokens
            stats.hits += num_new_computed_tokens

        fresh = pool.get_new_blocks(num_new_blocks) if num_new_blocks else []
        added, start = self.empty(), 0
        for g, count in enumerate(counts):
            added[g].extend(fresh[start : start + count])
            self.group_pages[g] += count
            req_blocks[g].extend(added[g])
            start += count
        if self.enable_caching:
            # NOTE: pages are registered when scheduled, before the device
            # computes them. A request that hits them later is scheduled in a
            # later step (or later in this step's batch, whose KV writes
            # precede its attention reads), so it never reads them unwritten.
            # Capped at num_tokens: placeholders are not real tokens yet.
            self.cache_blocks(request, min(end, request.num_tokens))
        return added

    def _free_passed(self, req_id: str, num_computed_tokens: int) -> None:
        """Give back each sliding group's pages wholly before the window of the request's
        next token (position `num_computed_tokens`): no later query reads them."""
        blocks, skipped = self.req_to_blocks[req_id], self.num_skipped_block[req_id]
        null = self.block_pool.null_block
        for g in self.sliding:
            first_read = num_computed_tokens - self.sliding_windows[g] + 1
            n = min(max(first_read, 0) // self.block_size, len(blocks[g]))
            if n > skipped[g]:
                passed = [b for b in blocks[g][skipped[g] : n] if not b.is_null]
                blocks[g][skipped[g] : n] = [null] * (n - skipped[g])
                skipped[g] = n
                self.group_pages[g] -= self.block_pool.free_blocks(reversed(passed))

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register each group's pages that are full within the request's first
        `num_computed_tokens` tokens."""
        req_id = request.req_id
        num_full_blocks = num_computed_tokens // self.block_size
        num_cached = self.num_cached_block.get(req_id)
        if num_cached is None:
            return
        for g, blocks in enumerate(self.req_to_blocks[req_id]):
            if num_full_blocks > num_cached[g]:
                self.block_pool.cache_full_blocks(request, blocks, num_cached[g],
                                                  num_full_blocks, g)
                num_cached[g] = num_full_blocks

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
        groups = self.req_to_blocks.pop(request.req_id, None)
        self.num_cached_block.pop(request.req_id, None)
        self.num_skipped_block.pop(request.req_id, None)
        for g, blocks in enumerate(groups or ()):
            self.group_pages[g] -= self.block_pool.free_blocks(
                b for b in reversed(blocks) if not b.is_null)

    def get_block_ids(self, req_id: str) -> tuple[list[int], ...]:
        """The request's block tables as page ids, one list per group."""
        groups = self.req_to_blocks.get(req_id)
        if groups is None:
            return tuple([] for _ in self.windows)
        return tuple([b.block_id for b in blocks] for blocks in groups)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached page hash (e.g. after new weights are loaded)."""
        return self.block_pool.reset_prefix_cache()

