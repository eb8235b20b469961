"""BlockPool and its O(1) free queue: null page, LRU order, touch, eviction."""

import pytest

from jaxserve.engine_core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from jaxserve.engine_core.kv_cache_utils import hash_block_tokens


def ids(blocks):
    return [b.block_id for b in blocks]


class _Req:
    """Just what cache_full_blocks reads."""

    def __init__(self, block_hashes):
        self.block_hashes = block_hashes


def test_free_queue_popleft_remove_append():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    assert q.num_free_blocks == 5
    assert q.popleft().block_id == 0
    q.remove(blocks[2])  # from the middle
    assert ids(q.get_all_free_blocks()) == [1, 3, 4]
    q.append(blocks[2])
    assert ids(q.get_all_free_blocks()) == [1, 3, 4, 2]
    assert ids(q.popleft_n(3)) == [1, 3, 4]
    q.append_n([blocks[0], blocks[1]])
    assert ids(q.get_all_free_blocks()) == [2, 0, 1]
    assert q.num_free_blocks == 3
    assert blocks[3].prev_free_block is None and blocks[3].next_free_block is None


def test_free_queue_errors():
    blocks = [KVCacheBlock(i) for i in range(2)]
    q = FreeKVCacheBlockQueue(blocks)
    with pytest.raises(ValueError):
        q.popleft_n(3)
    q.popleft_n(2)
    with pytest.raises(ValueError):
        q.popleft()
    with pytest.raises(RuntimeError):
        q.remove(blocks[0])  # not in the queue


def test_null_page_is_never_handed_out():
    pool = BlockPool(num_blocks=4, enable_caching=True)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.get_num_free_blocks() == 3
    got = pool.get_new_blocks(3)
    assert 0 not in ids(got)
    assert all(b.ref_cnt == 1 for b in got)
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)


def test_num_blocks_must_leave_a_real_page():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(num_blocks=1, enable_caching=False)


def test_freed_pages_are_reused_in_lru_order():
    pool = BlockPool(num_blocks=6, enable_caching=False)
    a = pool.get_new_blocks(2)  # 1, 2
    b = pool.get_new_blocks(2)  # 3, 4
    pool.free_blocks(reversed(a))  # tail first: 2 then 1
    pool.free_blocks(reversed(b))
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [5, 2, 1, 4, 3]
    assert ids(pool.get_new_blocks(3)) == [5, 2, 1]


def test_double_free_is_caught():
    pool = BlockPool(num_blocks=3, enable_caching=False)
    (blk,) = pool.get_new_blocks(1)
    pool.free_blocks([blk])
    with pytest.raises(AssertionError, match="double free"):
        pool.free_blocks([blk])


def test_cache_full_blocks_registers_hashes_and_reuse_evicts_them():
    pool = BlockPool(num_blocks=4, enable_caching=True)
    h0 = hash_block_tokens(None, [1, 2])
    h1 = hash_block_tokens(h0, [3, 4])
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(_Req([h0, h1]), blocks, 0, 2)
    assert pool.get_cached_block(h0) is blocks[0] and blocks[1].block_hash == h1
    pool.free_blocks(reversed(blocks))
    # Freed but still cached: a prefix hit can take it back.
    assert pool.get_cached_block(h1) is blocks[1]
    # Handing the page out again evicts its hash.
    pool.get_new_blocks(2)  # page 3, then page 2 (= blocks[1], freed first)
    assert pool.get_cached_block(h1) is None and blocks[1].block_hash is None
    assert pool.get_cached_block(h0) is blocks[0]


def test_duplicate_content_keeps_the_first_page():
    pool = BlockPool(num_blocks=4, enable_caching=True)
    h = hash_block_tokens(None, [7, 7])
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks(_Req([h]), [a], 0, 1)
    pool.cache_full_blocks(_Req([h]), [b], 0, 1)
    assert pool.get_cached_block(h) is a and b.block_hash is None
    # Evicting the uncached duplicate must not drop the registered page.
    pool.free_blocks([b])
    pool.get_new_blocks(2)
    assert pool.get_cached_block(h) is a


def test_touch_takes_a_free_cached_page_out_of_the_free_queue():
    pool = BlockPool(num_blocks=4, enable_caching=True)
    h = hash_block_tokens(None, [1])
    (blk,) = pool.get_new_blocks(1)
    pool.cache_full_blocks(_Req([h]), [blk], 0, 1)
    pool.free_blocks([blk])
    assert pool.get_num_free_blocks() == 3
    pool.touch([blk])
    assert blk.ref_cnt == 1 and pool.get_num_free_blocks() == 2
    assert blk not in pool.free_block_queue.get_all_free_blocks()
    pool.touch([blk])  # a second user of an in-use page
    assert blk.ref_cnt == 2 and pool.get_num_free_blocks() == 2
    pool.free_blocks([blk])
    assert pool.get_num_free_blocks() == 2
    pool.free_blocks([blk])
    assert pool.get_num_free_blocks() == 3


def test_usage_excludes_the_null_page():
    pool = BlockPool(num_blocks=5, enable_caching=False)
    assert pool.get_usage() == 0.0
    pool.get_new_blocks(2)
    assert pool.get_usage() == 0.5
    pool.get_new_blocks(2)
    assert pool.get_usage() == 1.0


def test_reset_prefix_cache_refused_while_pages_are_in_use():
    pool = BlockPool(num_blocks=4, enable_caching=True)
    h = hash_block_tokens(None, [1])
    (blk,) = pool.get_new_blocks(1)
    pool.cache_full_blocks(_Req([h]), [blk], 0, 1)
    assert not pool.reset_prefix_cache()
    pool.free_blocks([blk])
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(h) is None and blk.block_hash is None
