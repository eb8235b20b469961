"""KVCacheManager: allocation, prefix lookup with chained hashes, free order, stats; sliding
window groups giving pages back, and their prefix hits."""

import pytest

from jaxserve.engine_core.kv_cache_manager import KVCacheManager
from jaxserve.engine_core.kv_cache_utils import RequestBlockHasher, group_key, hash_block_tokens
from jaxserve.engine_core.request import Request
from jaxserve.kv_cache_spec import KVCacheGroups, KVCacheGroupSpec
from jaxserve.sampling_params import SamplingParams

BS = 4


def make_request(req_id, tokens, salt=None):
    r = Request(req_id, tokens, SamplingParams(max_tokens=64), cache_salt=salt)
    r.set_block_hasher(RequestBlockHasher(BS), BS)
    return r


def admit(kv, request, num_tokens=None):
    """Prefix lookup + allocation for the whole remaining prompt, as the scheduler does."""
    blocks, hit = kv.get_computed_blocks(request)
    n = request.num_tokens - hit if num_tokens is None else num_tokens
    new = kv.allocate_slots(request, n, hit, blocks)
    if new is not None:
        request.num_computed_tokens = hit + n
    return new, hit


def test_allocate_and_free_page_counts():
    kv = KVCacheManager(num_blocks=10, block_size=BS, max_model_len=64)
    r = make_request("a", range(10))  # 10 tokens -> 3 pages
    new, _ = admit(kv, r)
    (new,) = new
    assert len(new) == 3 and kv.get_num_free_blocks() == 9 - 3
    assert kv.get_block_ids("a") == ([b.block_id for b in new],)
    r.append_output_token_ids(99)  # 11 tokens: still 3 pages
    assert kv.allocate_slots(r, 1) == ([],)
    r.num_computed_tokens += 1
    r.append_output_token_ids(98)
    r.append_output_token_ids(97)  # 13 tokens -> a 4th page
    assert len(kv.allocate_slots(r, 2)[0]) == 1
    kv.free(r)
    assert kv.get_num_free_blocks() == 9 and kv.get_block_ids("a") == ([],)


def test_allocate_returns_none_without_side_effects_when_it_cannot_fit():
    kv = KVCacheManager(num_blocks=4, block_size=BS, max_model_len=64)  # 3 real pages
    r = make_request("a", range(13))  # needs 4 pages
    assert kv.allocate_slots(r, 13) is None
    assert kv.get_num_free_blocks() == 3 and kv.get_block_ids("a") == ([],)
    assert kv.get_blocks("a") is None


def test_num_new_tokens_must_be_positive():
    kv = KVCacheManager(num_blocks=4, block_size=BS, max_model_len=64)
    with pytest.raises(ValueError):
        kv.allocate_slots(make_request("a", [1]), 0)


def test_prefix_hit_shares_pages_and_never_covers_the_last_token():
    kv = KVCacheManager(num_blocks=20, block_size=BS, max_model_len=64)
    a = make_request("a", range(12))  # exactly 3 full pages
    admit(kv, a)
    b = make_request("b", range(12))
    (blocks,), hit = kv.get_computed_blocks(b)
    # 3 pages match, but the last prompt token must be computed: 2 pages.
    assert hit == 8 and len(blocks) == 2
    assert [x.block_id for x in blocks] == kv.get_block_ids("a")[0][:2]
    (new,), _ = admit(kv, b)
    assert len(new) == 1
    assert [x.ref_cnt for x in blocks] == [2, 2]


def test_hash_is_chained_from_the_parent():
    kv = KVCacheManager(num_blocks=20, block_size=BS, max_model_len=64)
    admit(kv, make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # Same second page, different first page: no hit at all.
    b = make_request("b", [0, 0, 0, 0, 5, 6, 7, 8, 9])
    assert kv.get_computed_blocks(b) == (([],), 0)
    # Same first page only: one page.
    c = make_request("c", [1, 2, 3, 4, 0, 0, 0, 0, 9])
    assert kv.get_computed_blocks(c)[1] == 4
    assert b.block_hashes[1] != make_request("a2", [1, 2, 3, 4, 5, 6, 7, 8]).block_hashes[0]


def test_cache_salt_separates_tenants():
    kv = KVCacheManager(num_blocks=20, block_size=BS, max_model_len=64)
    admit(kv, make_request("a", range(9), salt="alice"))
    assert kv.get_computed_blocks(make_request("b", range(9), salt="bob"))[1] == 0
    assert kv.get_computed_blocks(make_request("c", range(9)))[1] == 0
    assert kv.get_computed_blocks(make_request("d", range(9), salt="alice"))[1] == 8


def test_block_hashes_match_hash_block_tokens():
    r = make_request("a", range(9))
    h0 = hash_block_tokens(None, [0, 1, 2, 3])
    assert r.block_hashes == [h0, hash_block_tokens(h0, [4, 5, 6, 7])]
    r.append_output_token_ids([20, 21, 22])  # page 3 becomes full
    assert len(r.block_hashes) == 3


def test_free_is_tail_first_so_deepest_pages_are_evicted_first():
    kv = KVCacheManager(num_blocks=6, block_size=BS, max_model_len=64)
    a = make_request("a", range(12))
    admit(kv, a)
    (first, second, third), = kv.get_block_ids("a")
    kv.free(a)
    free_order = [b.block_id for b in kv.block_pool.free_block_queue.get_all_free_blocks()]
    assert free_order[-3:] == [third, second, first]
    # Taking 4 of the 5 free pages evicts `third` and `second` but keeps the root page.
    admit(kv, make_request("x", [99] * 16))
    assert kv.get_computed_blocks(make_request("b", range(12)))[1] == 4


def test_freed_pages_stay_cached_until_reused():
    kv = KVCacheManager(num_blocks=10, block_size=BS, max_model_len=64)
    a = make_request("a", range(9))
    admit(kv, a)
    kv.free(a)
    assert kv.get_num_free_blocks() == 9
    b = make_request("b", range(9))
    (new,), hit = admit(kv, b)
    assert hit == 8 and len(new) == 1
    assert kv.get_num_free_blocks() == 9 - 3


def test_hit_on_free_pages_counts_against_free_pages():
    kv = KVCacheManager(num_blocks=4, block_size=BS, max_model_len=64)  # 3 real pages
    a = make_request("a", range(9))
    admit(kv, a)
    kv.free(a)
    b = make_request("b", list(range(9)) + [50, 51, 52, 53])  # 2 hit pages + 2 new = 4 > 3
    new, hit = admit(kv, b)
    assert new is None
    assert kv.get_num_free_blocks() == 3
    assert all(blk.ref_cnt == 0 for blk in kv.block_pool.blocks)


def test_lookahead_reserves_pages_but_only_computed_pages_are_cached():
    kv = KVCacheManager(num_blocks=20, block_size=BS, max_model_len=64)
    a = make_request("a", range(17))
    (new,) = kv.allocate_slots(a, 5, num_lookahead_tokens=12)  # chunk of 5, rest reserved
    assert len(new) == 5
    a.num_computed_tokens = 5
    assert kv.get_computed_blocks(make_request("b", range(17)))[1] == 4
    assert kv.allocate_slots(a, 8) == ([],)  # already reserved
    a.num_computed_tokens = 13
    assert kv.get_computed_blocks(make_request("c", range(17)))[1] == 12


def test_pages_scheduled_but_never_computed_leave_the_prefix_cache_when_freed():
    """A step registers the pages it fills when it is scheduled; a request preempted later in
    that same schedule() (a better one needs its pages) never computes them, so freeing it
    drops them from the prefix cache: only the pages of its computed tokens stay hits."""
    kv = KVCacheManager(num_blocks=10, block_size=BS, max_model_len=64)
    r = make_request("a", range(100, 106))
    admit(kv, r)  # positions 0-5 computed: page 0 full
    r.append_output_token_ids(7)
    r.append_output_token_ids(8)  # 8 tokens: with two drafts, positions 6-9 this step
    assert kv.allocate_slots(r, 4) is not None  # registers page 1 (positions 4-7)
    kv.free(r)  # preempted in the same schedule(): num_computed_tokens is still 6
    again = make_request("b", [*range(100, 106), 7, 8, 9])
    assert kv.get_computed_blocks(again)[1] == BS


def test_only_real_tokens_are_cached():
    kv = KVCacheManager(num_blocks=20, block_size=BS, max_model_len=64)
    a = make_request("a", range(7))
    # Async scheduling: 7 real tokens + 1 placeholder scheduled; page 2 is not full of real tokens.
    kv.allocate_slots(a, 8)
    assert [m.num_cached_block["a"] for m in kv.coordinator.managers] == [1]
    a.append_output_token_ids(70)
    kv.cache_blocks(a, 8)
    assert [m.num_cached_block["a"] for m in kv.coordinator.managers] == [2]


def test_prefix_cache_stats_count_admissions_and_reset():
    kv = KVCacheManager(num_blocks=20, block_size=BS, max_model_len=64)
    admit(kv, make_request("a", range(9)))
    b = make_request("b", range(9))
    kv.get_computed_blocks(b)  # a lookup that is retried later is not counted twice
    admit(kv, b)
    stats = kv.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (2, 18, 8)
    assert stats.hit_rate == pytest.approx(8 / 18)
    fresh = kv.make_prefix_cache_stats()
    assert (fresh.requests, fresh.queries, fresh.hits) == (0, 0, 0)


def test_prefix_caching_disabled():
    kv = KVCacheManager(num_blocks=20, block_size=BS, max_model_len=64, enable_prefix_caching=False)
    a = Request("a", range(9), SamplingParams())
    assert a.block_hashes == []
    kv.allocate_slots(a, 9)
    a.num_computed_tokens = 9
    assert kv.get_computed_blocks(Request("b", range(9), SamplingParams())) == (([],), 0)
    assert kv.block_pool.cached_block_hash_to_block == {}
    assert kv.make_prefix_cache_stats().queries == 0


def test_slots_are_capped_at_max_model_len():
    kv = KVCacheManager(num_blocks=20, block_size=BS, max_model_len=10)
    a = make_request("a", range(9))
    assert len(kv.allocate_slots(a, 9, num_lookahead_tokens=8)[0]) == 3  # cdiv(10, 4)


def test_usage_and_reset_prefix_cache():
    kv = KVCacheManager(num_blocks=5, block_size=BS, max_model_len=64)
    a = make_request("a", range(8))
    admit(kv, a)
    assert kv.usage == 0.5
    assert not kv.reset_prefix_cache()
    kv.free(a)
    assert kv.usage == 0.0
    assert kv.reset_prefix_cache()
    assert kv.get_computed_blocks(make_request("b", range(9)))[1] == 0


# --- sliding-window groups --------------------------------------------------------


def hybrid(*windows):
    return KVCacheGroups(tuple(KVCacheGroupSpec((g,), w) for g, w in enumerate(windows)),
                         num_slots=1 if len(windows) > 1 else None)


def decode(kv, r, n):
    """Allocate and compute n decode steps of r, one token each."""
    for i in range(n):
        r.append_output_token_ids(90 + i)
        assert kv.allocate_slots(r, 1) is not None
        r.num_computed_tokens += 1


def test_a_sliding_group_gives_back_pages_its_window_passed():
    kv = KVCacheManager(num_blocks=40, block_size=BS, max_model_len=64,
                        kv_cache_groups=hybrid(None, 6))
    r = make_request("a", range(10))
    admit(kv, r)
    for _ in range(30):
        decode(kv, r, 1)
        full, sliding = kv.get_block_ids("a")
        held = [p for p in sliding if p]
        # Decoding: the window's pages and the next token's, ceil(window / page) + 1 at most.
        assert len(held) <= -(-6 // BS) + 1
        # Every page the next token's window reads is still held.
        first = r.num_computed_tokens - 6 + 1
        assert all(sliding[i] for i in range(max(first, 0) // BS, len(sliding)))
        assert len(full) == len(sliding) and all(full)
    assert kv.get_num_free_blocks() == 39 - len(full) - len(held)
    assert kv.group_usage() == [len(full) / 39, len(held) / 39]
    kv.free(r)
    assert kv.get_num_free_blocks() == 39 and kv.group_usage() == [0, 0]


def test_a_sliding_prefix_hit_needs_only_the_window_pages():
    kv = KVCacheManager(num_blocks=40, block_size=BS, max_model_len=64,
                        kv_cache_groups=hybrid(None, 6))
    a = make_request("a", range(25))
    admit(kv, a)  # the whole prompt in one chunk: every page registered in both groups
    kv.free(a)
    b = make_request("b", range(25))
    (full, sliding), hit = kv.get_computed_blocks(b)
    assert hit == 24 and len(full) == len(sliding) == 6
    # Token 24's window (6) starts at 19: pages 4 and 5; the four before are null.
    assert [p.is_null for p in sliding] == [True] * 4 + [False] * 2
    (new_full, new_sliding), _ = admit(kv, b)
    assert len(new_full) == len(new_sliding) == 1
    assert sum(1 for p in kv.get_block_ids("b")[1] if p) == 3

    # Evict the sliding group's page 5 (its key differs from the full group's page 5): the hit
    # falls back to the longest prefix whose window pages are all cached.
    kv.free(b)
    del kv.block_pool.cached_block_hash_to_block[group_key(b.block_hashes[5], 1)]
    c = make_request("c", range(25))
    (full, sliding), hit = kv.get_computed_blocks(c)
    assert hit == 20 and len(full) == len(sliding) == 5
    assert [p.is_null for p in sliding] == [True] * 3 + [False] * 2


def test_an_all_sliding_model_has_one_group():
    groups = KVCacheGroups.for_layers([4096] * 3)
    assert len(groups.groups) == 1 and not groups.hybrid
    assert groups.groups[0].sliding_window == 4096 and groups.slots(3) == 3


def test_hybrid_groups_take_the_rarer_kinds_count():
    # Gemma 3: every sixth layer full.
    windows = [None if (i + 1) % 6 == 0 else 1024 for i in range(34)]
    groups = KVCacheGroups.for_layers(windows)
    assert groups.num_slots == 5 and len(groups.groups) == 7
    assert groups.groups[0].layers == (5, 11, 17, 23, 29)
    assert groups.groups[-1].layers == (30, 31, 32, 33)
    group_of, slot_of = groups.layer_group_slot(34)
    assert (group_of[29], slot_of[29]) == (0, 4) and (group_of[33], slot_of[33]) == (6, 3)
    # At 32k, 16-token pages: one full group of 2048 pages and six of 65 sliding ones.
    assert groups.pages_per_request(32768, 16) == 2048 + 6 * 65
    assert KVCacheGroups.for_layers(windows, hybrid=False).slots(34) == 34


# --- recurrent-state groups (linear attention) ----------------------------------------


def with_state(keep_every: int) -> KVCacheGroups:
    """A full-attention group and a recurrent one keeping its state every `keep_every` tokens."""
    return KVCacheGroups((KVCacheGroupSpec((0,)),
                          KVCacheGroupSpec((1,), recurrent=True, state_block_size=keep_every)),
                         num_slots=1)


def prefill_in_chunks(kv, r):
    """The scheduler's chunks for r's prompt: each ends on a kept state's boundary."""
    chunks = []
    while r.num_computed_tokens < r.num_tokens:
        n = min(r.num_tokens - r.num_computed_tokens, kv.chunk_limit(r.num_computed_tokens) or 99)
        kv.new_step()
        assert kv.allocate_slots(r, n) is not None
        r.num_computed_tokens += n
        chunks.append(n)
    kv.new_step()
    return chunks


def test_a_state_is_kept_at_each_boundary_and_a_hit_lands_only_on_one():
    kv = KVCacheManager(num_blocks=40, block_size=BS, max_model_len=64,
                        kv_cache_groups=with_state(8), num_state_slots=10)
    a = make_request("a", range(1, 21))
    assert prefill_in_chunks(kv, a) == [8, 8, 4]  # steps end on the boundaries 8 and 16
    full, state = kv.get_blocks("a")
    # Entry 1 (the state after 16 tokens) is kept for the step after the boundary; entry 2 is
    # the live state; entry 0 went back to the pool, cached.
    assert [b.is_null for b in state] == [True, False, False] and len(full) == 5
    assert kv.state_usage == 2 / 9
    # 13 tokens in common: full attention could take 12, the state only its boundary at 8.
    b = make_request("b", [*range(1, 14), 77, 78, 79])
    (full_hit, state_hit), hit = kv.get_computed_blocks(b)
    assert hit == 8 and len(full_hit) == 2 and [s.is_null for s in state_hit] == [False]
    assert state_hit[0].block_id not in kv.get_block_ids("a")[1]  # a gave it back; still cached
    # 19 in common: the boundary at 16.
    c = make_request("c", [*range(1, 20), 55])
    (_, state_hit), hit = kv.get_computed_blocks(c)
    assert hit == 16 and state_hit[1] is state[1]
    # The hit's next step writes a fresh slot; the cached state is only read.
    c.num_computed_tokens = 0
    new = kv.allocate_slots(c, 4, 16, kv.get_computed_blocks(c)[0])
    assert new is not None and len(new[1]) == 1 and new[1][0] not in state
    kv.free(a)
    kv.free(c)
    assert kv.state_usage == 0


def test_a_state_computed_in_a_step_is_hit_only_from_the_next_step():
    """A request of the same step reads its initial state before the step writes it."""
    kv = KVCacheManager(num_blocks=40, block_size=BS, max_model_len=64,
                        kv_cache_groups=with_state(8), num_state_slots=10)
    a = make_request("a", range(1, 13))
    kv.new_step()
    assert kv.allocate_slots(a, 8) is not None
    a.num_computed_tokens = 8
    b = make_request("b", range(1, 13))
    assert kv.get_computed_blocks(b)[1] == 0  # the same step: not yet
    kv.new_step()
    assert kv.get_computed_blocks(b)[1] == 8


def test_without_prefix_caching_a_request_holds_one_state_slot():
    kv = KVCacheManager(num_blocks=40, block_size=BS, max_model_len=64, enable_prefix_caching=False,
                        kv_cache_groups=with_state(8), num_state_slots=3)
    a = make_request("a", range(1, 30))
    assert kv.chunk_limit(0) is None
    admit(kv, a)
    decode(kv, a, 10)
    assert [len(t) for t in kv.get_block_ids("a")] == [10, 1]


def test_state_slots_run_out_apart_from_pages():
    kv = KVCacheManager(num_blocks=40, block_size=BS, max_model_len=64,
                        kv_cache_groups=with_state(8), num_state_slots=2)
    a, b = make_request("a", range(1, 5)), make_request("b", range(50, 54))
    assert admit(kv, a)[0] is not None
    assert admit(kv, b)[0] is None  # the one slot is a's; pages are plenty
    assert kv.usage < 0.2 and kv.state_usage == 1.0
    with pytest.raises(ValueError, match="num_state_slots"):
        KVCacheManager(num_blocks=40, block_size=BS, max_model_len=64,
                       kv_cache_groups=with_state(8))
