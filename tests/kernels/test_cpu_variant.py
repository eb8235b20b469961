"""The CPU variant's own work split, beyond the shared parametrized test: its decode path
with several query tokens per sequence, one-token steps, long contexts beside short ones,
and a plan built once and shared by several calls (as the model's layers share it). Each
decode case runs through both decode paths: the C++ kernel (decode_cpu.cc) and the XLA loop."""

from __future__ import annotations

import functools

import jax
import ml_dtypes
import numpy as np
import pytest

from kernels_pallas.ragged_paged_attention import _decode_cpu, cpu

from .batches import make_batch, naive_attention, tolerance

BF16 = ml_dtypes.bfloat16

KERNELS = pytest.mark.parametrize("decode_kernel", ["auto", "xla"], ids=["cpp", "xla"])


def _check(seqs, *, num_tokens=None, dtype=np.float32, page_size=16, num_q_heads=6,
           num_kv_heads=2, soft_cap=None, **tuning) -> None:
    batch = make_batch(seqs, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=64,
                       page_size=page_size, num_tokens=num_tokens, dtype=dtype, seed=len(seqs))
    fn = jax.jit(functools.partial(cpu.ragged_paged_attention, sm_scale=0.125,
                                   soft_cap=soft_cap, **tuning))
    got = np.asarray(fn(*batch.args), np.float32)
    want = naive_attention(batch, sm_scale=0.125, sliding_window=tuning.get("sliding_window"),
                           soft_cap=soft_cap)
    n = batch.num_real_tokens
    assert np.isfinite(got[:n]).all()
    np.testing.assert_allclose(got[:n], want[:n], **tolerance(dtype))
    assert (got[n:] == 0).all()


def test_the_decode_kernel_builds_here() -> None:
    """The machines the suite runs on have g++ and AVX2: the C++ path is the one tested."""
    assert _decode_cpu.available(), _decode_cpu.unavailable_reason()


@KERNELS
def test_one_token_step(decode_kernel: str) -> None:
    _check([(1, 37)], num_tokens=1, decode_kernel=decode_kernel)


@KERNELS
def test_short_decodes_beside_a_long_one(decode_kernel: str) -> None:
    # 700 keys: the C++ kernel splits the row into three 256-key chunks and merges them.
    _check([(1, 700), (1, 3), (1, 17), (1, 1), (1, 64)], decode_items=2,
           decode_kernel=decode_kernel)


@KERNELS
@pytest.mark.parametrize("decode_q_len", [1, 4])
def test_multi_token_sequences_on_either_path(decode_q_len: int, decode_kernel: str) -> None:
    # q_len 3 and 4 go to the decode path when decode_q_len=4 (speculative-decoding shapes).
    _check([(3, 90), (4, 4), (1, 33), (20, 200)], decode_q_len=decode_q_len, block_q=8,
           decode_kernel=decode_kernel)


@KERNELS
def test_sliding_window_on_both_paths(decode_kernel: str) -> None:
    _check([(1, 300), (40, 260), (2, 50)], sliding_window=37, block_q=16, pages_per_block=2,
           decode_kernel=decode_kernel)


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("page_size,num_q_heads,num_kv_heads", [(16, 6, 2), (32, 8, 1), (8, 4, 4)])
def test_decode_kernel_cache_dtypes_pages_and_groups(dtype, page_size: int, num_q_heads: int,
                                                      num_kv_heads: int) -> None:
    """Windows that start inside a tile and cross a 256-key chunk, soft capping, every cache
    dtype the kernel reads, page sizes of one and several tiles, GQA groups 1 to 8."""
    _check([(1, 530), (1, 9), (1, 257), (1, 256)], dtype=dtype, page_size=page_size,
           num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, sliding_window=301, soft_cap=5.0)


def test_decode_kernel_refuses_what_it_cannot_read() -> None:
    assert "fp8" in _decode_cpu.why_not(6, 2, 64, 16, np.uint8, "fp8_e4m3", True)
    assert "float16" in _decode_cpu.why_not(6, 2, 64, 16, np.float16, "float16", False)
    assert "page size" in _decode_cpu.why_not(6, 2, 64, 12, np.float32, "auto", False)
    assert "head_dim" in _decode_cpu.why_not(6, 2, 60, 16, np.float32, "auto", False)
    assert _decode_cpu.why_not(6, 2, 64, 16, np.float32, "auto", False) is None


def test_decode_kernel_name_is_checked() -> None:
    batch = make_batch([(1, 5)], num_q_heads=2, num_kv_heads=2, head_dim=64, page_size=16)
    with pytest.raises(ValueError, match="decode_kernel"):
        cpu.ragged_paged_attention(*batch.args, sm_scale=0.125, decode_kernel="fast")


def test_plan_built_once_serves_every_call() -> None:
    batch = make_batch([(5, 40), (1, 80), (1, 2)], num_q_heads=6, num_kv_heads=2, head_dim=64,
                       page_size=16, seed=3)
    plan = cpu.make_plan(batch.kv_lens, batch.page_indices, batch.cu_q_lens, batch.num_seqs,
                         num_tokens=batch.q.shape[0], page_size=16)
    with_plan = cpu.ragged_paged_attention(*batch.args, sm_scale=0.125, plan=plan)
    without = cpu.ragged_paged_attention(*batch.args, sm_scale=0.125)
    np.testing.assert_array_equal(np.asarray(with_plan), np.asarray(without))
