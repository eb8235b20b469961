"""Makes sure each scheduled token has a KV slot (vLLM's `KVCacheManager`): what the scheduler
asks of the cache, over the groups' managers (kv_cache_coordinator.py,
single_type_kv_cache_manager.py) and one pool of pages (block_pool.py).

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

A recurrent group (linear-attention layers: Gated DeltaNet) holds state slots of a pool of
their own, one table entry per state block (here 32 tokens, 2 pages), shown after a step
that ended on the boundary at token 64:

    tokens:    [t0 ........ t31][t32 ....... t63][t64 ...
    recurrent: [     null      ][      21       ][      5         state_block_size 32
                 the state at     the state at     the next step reads 21, writes 5 (and
                 32: cached,      64: cached       5 in place until the boundary at 96)
                 given back

The scheduler ends a step on each boundary it reaches, so the state at the boundary is the
step's result; it is registered once the next step is scheduled (a request of the same step
would read it before it is written), and a later request with that prefix starts from it.
"""

from __future__ import annotations

from jaxserve.engine_core.block_pool import BlockPool
from jaxserve.engine_core.kv_cache_coordinator import GroupBlocks, KVCacheCoordinator
from jaxserve.engine_core.kv_cache_utils import RequestBlockHasher
from jaxserve.engine_core.request import Request
from jaxserve.engine_core.stats import PrefixCacheStats
from jaxserve.kv_cache_spec import FULL_ATTENTION, KVCacheGroups


class KVCacheManager:
    """Block tables of the running requests, one per group, over one BlockPool."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        enable_prefix_caching: bool = True,
        kv_cache_groups: KVCacheGroups = FULL_ATTENTION,
        num_state_slots: int = 0,
    ) -> None:
        """`num_state_slots`: the pool of the recurrent groups' states (slot 0 the null
        one), for models with linear-attention layers."""
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_prefix_caching
        self.kv_cache_groups = kv_cache_groups
        self.block_pool = BlockPool(num_blocks, enable_prefix_caching)
        self.state_pool: BlockPool | None = None
        if kv_cache_groups.has_recurrent:
            if num_state_slots < 2:
                raise ValueError(f"a model with recurrent layers needs num_state_slots >= 2 "
                                 f"(slot 0 is the null one), got {num_state_slots}")
            self.state_pool = BlockPool(num_state_slots, enable_prefix_caching)
        self.coordinator = KVCacheCoordinator(kv_cache_groups, self.block_pool, block_size,
                                              max_model_len, self.state_pool)
        self.block_hasher = RequestBlockHasher(block_size) if enable_prefix_caching else None
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def num_groups(self) -> int:
        return len(self.coordinator.managers)

    def empty(self) -> GroupBlocks:
        return self.coordinator.empty()

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def state_usage(self) -> float:
        """The fraction of state slots in use (0 without recurrent layers)."""
        return self.state_pool.get_usage() if self.state_pool is not None else 0.0

    def group_usage(self) -> list[float]:
        """The fraction of its pool each group holds: the attention groups' add up to
        `usage`, the recurrent groups' to `state_usage`."""
        return [m.num_pages / (m.block_pool.num_blocks - 1) for m in self.coordinator.managers]

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

    def new_step(self) -> None:
        """The scheduler starts a step (the previous one is dispatched)."""
        self.coordinator.new_step()

    # --- prefix cache ---------------------------------------------------------

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
        hits, n = self.coordinator.find_longest_cache_hit(hashes)
        return hits, n * self.block_size

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
        coordinator = self.coordinator
        computed = new_computed_blocks if new_computed_blocks and any(new_computed_blocks) else None
        coordinator.remove_skipped_blocks(req_id, request.num_computed_tokens)
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        end = min(num_computed + num_new_tokens, self.max_model_len)
        reserve = min(end + num_lookahead_tokens, self.max_model_len)
        hit = computed or self.empty()
        counts = coordinator.get_num_blocks_to_allocate(req_id, end, reserve, hit)
        if computed is None and not any(counts) and coordinator.get_blocks(req_id) is not None:
            # Fast path (most decode steps): the pages already hold the new tokens.
            if self.enable_caching:
                coordinator.cache_blocks(request, min(end, request.num_tokens))
            return self.empty()
        if not coordinator.fits(counts, hit):
            return None
        if computed is not None:
            coordinator.save_new_computed_blocks(req_id, computed)
        if request.num_computed_tokens == 0 and self.enable_caching:
            # First allocation since admission: count the lookup once here
            # rather than in get_computed_blocks, which may be retried.
            stats = self.prefix_cache_stats
            stats.requests += 1
            stats.queries += request.num_tokens
            stats.hits += num_new_computed_tokens
        added = coordinator.allocate_new_blocks(req_id, counts)
        if self.enable_caching:
            # NOTE: pages are registered when scheduled, before the device
            # computes them. A request that hits them later is scheduled in a
            # later step (or later in this step's batch, whose KV writes
            # precede its attention reads), so it never reads them unwritten;
            # if this request is preempted before its step runs, free() drops them.
            # Capped at num_tokens: placeholders are not real tokens yet.
            coordinator.cache_blocks(request, min(end, request.num_tokens))
        return added

    def chunk_limit(self, num_computed_tokens: int) -> int | None:
        """The most tokens a request at `num_computed_tokens` may compute in one step, so
        that a step reaching a kept state's boundary ends there (None: any)."""
        return self.coordinator.chunk_limit(num_computed_tokens)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register each group's pages that are full within the request's first
        `num_computed_tokens` tokens."""
        self.coordinator.cache_blocks(request, num_computed_tokens)

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
        of a prefix are evicted before the shared shallow ones; pages registered for tokens
        it has not computed (preempted in the schedule() that scheduled them) are no hits."""
        self.coordinator.free(request.req_id, request.num_computed_tokens)

    def get_blocks(self, req_id: str) -> GroupBlocks | None:
        """The request's pages per group; None when it holds none."""
        return self.coordinator.get_blocks(req_id)

    def get_block_ids(self, req_id: str) -> tuple[list[int], ...]:
        """The request's block tables as page ids, one list per group."""
        return self.coordinator.get_block_ids(req_id)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached page hash (e.g. after new weights are loaded)."""
        return self.block_pool.reset_prefix_cache()
