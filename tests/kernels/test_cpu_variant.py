"""The CPU variant's own work split, beyond the shared parametrized test: its decode path
with several query tokens per sequence, one-token steps, long contexts beside short ones,
and a plan built once and shared by several calls (as the model's layers share it)."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from kernels_pallas.ragged_paged_attention import cpu

from .batches import make_batch, naive_attention, tolerance


def _check(seqs, *, num_tokens=None, **tuning) -> None:
    batch = make_batch(seqs, num_q_heads=6, num_kv_heads=2, head_dim=64, page_size=16,
                       num_tokens=num_tokens, seed=len(seqs))
    fn = jax.jit(functools.partial(cpu.ragged_paged_attention, sm_scale=0.125, **tuning))
    got = np.asarray(fn(*batch.args))
    want = naive_attention(batch, sm_scale=0.125, sliding_window=tuning.get("sliding_window"))
    n = batch.num_real_tokens
    assert np.isfinite(got[:n]).all()
    np.testing.assert_allclose(got[:n], want[:n], **tolerance(np.float32))
    assert (got[n:] == 0).all()


def test_one_token_step() -> None:
    _check([(1, 37)], num_tokens=1)


def test_short_decodes_beside_a_long_one() -> None:
    _check([(1, 700), (1, 3), (1, 17), (1, 1), (1, 64)], decode_items=2)


@pytest.mark.parametrize("decode_q_len", [1, 4])
def test_multi_token_sequences_on_either_path(decode_q_len: int) -> None:
    # q_len 3 and 4 go to the decode path when decode_q_len=4 (speculative-decoding shapes).
    _check([(3, 90), (4, 4), (1, 33), (20, 200)], decode_q_len=decode_q_len, block_q=8)


def test_sliding_window_on_both_paths() -> None:
    _check([(1, 300), (40, 260), (2, 50)], sliding_window=37, block_q=16, pages_per_block=2)


def test_plan_built_once_serves_every_call() -> None:
    batch = make_batch([(5, 40), (1, 80), (1, 2)], num_q_heads=6, num_kv_heads=2, head_dim=64,
                       page_size=16, seed=3)
    plan = cpu.make_plan(batch.kv_lens, batch.page_indices, batch.cu_q_lens, batch.num_seqs,
                         num_tokens=batch.q.shape[0], page_size=16)
    with_plan = cpu.ragged_paged_attention(*batch.args, sm_scale=0.125, plan=plan)
    without = cpu.ragged_paged_attention(*batch.args, sm_scale=0.125)
    np.testing.assert_array_equal(np.asarray(with_plan), np.asarray(without))
