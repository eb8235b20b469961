"""KVCacheManager: allocation, prefix lookup with chained hashes, free order, stats."""

import pytest

from jaxserve.engine_core.kv_cache_manager import KVCacheManager
from jaxserve.engine_core.kv_cache_utils import RequestBlockHasher, hash_block_tokens
from jaxserve.engine_core.request import Request
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
    assert len(new) == 3 and kv.get_num_free_blocks() == 9 - 3
    assert kv.get_block_ids("a") == [b.block_id for b in new]
    r.append_output_token_ids(99)  # 11 tokens: still 3 pages
    assert kv.allocate_slots(r, 1) == []
    r.num_computed_tokens += 1
    r.append_output_token_ids(98)
    r.append_output_token_ids(97)  # 13 tokens -> a 4th page
    assert len(kv.allocate_slots(r, 2)) == 1
    kv.free(r)
    assert kv.get_num_free_blocks() == 9 and kv.get_block_ids("a") == []


def test_allocate_returns_none_without_side_effects_when_it_cannot_fit():
    kv = KVCacheManager(num_blocks=4, block_size=BS, max_model_len=64)  # 3 real pages
    r = make_request("a", range(13))  # needs 4 pages
    assert kv.allocate_slots(r, 13) is None
    assert kv.get_num_free_blocks() == 3 and kv.get_block_ids("a") == []
    assert "a" not in kv.req_to_blocks


def test_num_new_tokens_must_be_positive():
    kv = KVCacheManager(num_blocks=4, block_size=BS, max_model_len=64)
    with pytest.raises(ValueError):
        kv.allocate_slots(make_request("a", [1]), 0)


def test_prefix_hit_shares_pages_and_never_covers_the_last_token():
    kv = KVCacheManager(num_blocks=20, block_size=BS, max_model_len=64)
    a = make_request("a", range(12))  # exactly 3 full pages
    admit(kv, a)
    b = make_request("b", range(12))
    blocks, hit = kv.get_computed_blocks(b)
    # 3 pages match, but the last prompt token must be computed: 2 pages.
    assert hit == 8 and len(blocks) == 2
    assert [x.block_id for x in blocks] == kv.get_block_ids("a")[:2]
    new, _ = admit(kv, b)
    assert len(new) == 1
    assert [x.ref_cnt for x in blocks] == [2, 2]


def test_hash_is_chained_from_the_parent():
    kv = KVCacheManager(num_blocks=20, block_size=BS, max_model_len=64)
    admit(kv, make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # Same second page, different first page: no hit at all.
    b = make_request("b", [0, 0, 0, 0, 5, 6, 7, 8, 9])
    assert kv.get_computed_blocks(b) == ([], 0)
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
    first, second, third = kv.get_block_ids("a")
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
    new, hit = admit(kv, b)
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
    new = kv.allocate_slots(a, 5, num_lookahead_tokens=12)  # chunk of 5, rest reserved
    assert len(new) == 5
    a.num_computed_tokens = 5
    assert kv.get_computed_blocks(make_request("b", range(17)))[1] == 4
    assert kv.allocate_slots(a, 8) == []  # already reserved
    a.num_computed_tokens = 13
    assert kv.get_computed_blocks(make_request("c", range(17)))[1] == 12


def test_only_real_tokens_are_cached():
    kv = KVCacheManager(num_blocks=20, block_size=BS, max_model_len=64)
    a = make_request("a", range(7))
    # Async scheduling: 7 real tokens + 1 placeholder scheduled; page 2 is not full of real tokens.
    kv.allocate_slots(a, 8)
    assert kv.num_cached_block["a"] == 1
    a.append_output_token_ids(70)
    kv.cache_blocks(a, 8)
    assert kv.num_cached_block["a"] == 2


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
    assert kv.get_computed_blocks(Request("b", range(9), SamplingParams())) == ([], 0)
    assert kv.block_pool.cached_block_hash_to_block == {}
    assert kv.make_prefix_cache_stats().queries == 0


def test_slots_are_capped_at_max_model_len():
    kv = KVCacheManager(num_blocks=20, block_size=BS, max_model_len=10)
    a = make_request("a", range(9))
    assert len(kv.allocate_slots(a, 9, num_lookahead_tokens=8)) == 3  # cdiv(10, 4)


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
