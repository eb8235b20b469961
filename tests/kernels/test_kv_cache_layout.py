"""The KV-cache layouts (kernels_pallas/kv_cache.py): the TPU's packed int32 words against the
standard layout, and the TPU kernel (interpret mode) against the reference over packed caches.

The TPU matrix is the one the device-compile tests compile for real TPUs: bf16, fp8 (e4m3 and
e5m2), float32, sliding window, soft cap, GQA groups 1/4/8, head dims 64 and 128, page sizes 16
and 32, every unused slot NaN (batches.py), so an out-of-context read fails the comparison.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import kernels_pallas
from kernels_pallas import AttentionSpec
from kernels_pallas.kv_cache import KVCacheLayout, convert_cache
from kernels_pallas.ragged_paged_attention.reference import ragged_paged_attention as reference

from .batches import make_batch, tolerance

BF16 = ml_dtypes.bfloat16


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("num_kv_heads,head_dim", [(1, 64), (3, 64), (2, 96), (8, 128), (3, 128)])
def test_pack_unpack_round_trip(dtype: str, num_kv_heads: int, head_dim: int) -> None:
    rng = np.random.default_rng(0)
    k, v = (jnp.asarray(rng.standard_normal((5, num_kv_heads, head_dim)), jnp.float32)
            for _ in range(2))
    values = kernels_pallas.KV_VALUE_DTYPES[dtype]
    want = np.asarray(jnp.stack([k, v], 2).reshape(5, 2 * num_kv_heads, head_dim).astype(values))
    for packed in (False, True):
        layout = KVCacheLayout(num_kv_heads, head_dim, dtype, packed=packed)
        rows = layout.pack(k, v)
        assert rows.shape == (5, *layout.token_shape) and rows.dtype == layout.storage_dtype
        got = np.asarray(layout.unpack(rows))
        np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))


def test_kv_cache_shape_per_platform() -> None:
    # The default model (3 KV heads of 64): CPU/GPU keep [2 * kvh, D] in the value dtype
    # (fp8 as uint8 bits; the CPU's bf16 as uint16 bits, which XLA's CPU scatter writes in
    # place); the TPU packs [k | v] per head into 128 lanes of int32 words (bf16: 2 heads a
    # row, so 3 heads take 2 rows).
    assert kernels_pallas.kv_cache_shape(10, 16, 3, 64, "bfloat16", "cpu") == (
        (10, 16, 6, 64), jnp.uint16)
    assert kernels_pallas.kv_cache_shape(10, 16, 3, 64, "bfloat16", "cuda") == (
        (10, 16, 6, 64), jnp.bfloat16)
    assert kernels_pallas.kv_cache_shape(10, 16, 3, 64, "fp8", "cuda") == ((10, 16, 6, 64), jnp.uint8)
    assert kernels_pallas.kv_cache_shape(10, 16, 3, 64, "bfloat16", "tpu") == ((10, 16, 256), jnp.int32)
    assert kernels_pallas.kv_cache_shape(10, 16, 3, 64, "fp8", "tpu") == ((10, 16, 128), jnp.int32)
    assert kernels_pallas.kv_cache_shape(10, 16, 3, 64, "float32", "tpu") == ((10, 16, 384), jnp.int32)
    # Llama-3-8B: 8 KV heads of 128, bf16: 8 * 2 * 128 values of 2 bytes = 1024 words a token,
    # with no padding even for one head a device (tensor parallel 8): k_h and v_h share a row.
    assert kernels_pallas.kv_cache_shape(10, 16, 8, 128, "bfloat16", "tpu") == ((10, 16, 1024), jnp.int32)
    assert kernels_pallas.kv_cache_shape(10, 16, 1, 128, "bfloat16", "tpu") == ((10, 16, 128), jnp.int32)
    assert kernels_pallas.kv_cache_shape(10, 16, 1, 128, "fp8", "tpu") == ((10, 16, 128), jnp.int32)
    with pytest.raises(ValueError, match="unknown KV cache dtype 'int4'"):
        kernels_pallas.kv_cache_shape(10, 16, 3, 64, "int4", "tpu")
    with pytest.raises(ValueError, match="unknown platform 'rocm'"):
        kernels_pallas.kv_cache_shape(10, 16, 3, 64, "bfloat16", "rocm")


def test_a_cache_comes_with_its_layout() -> None:
    # The TPU's packed cache cannot be read off its shape: new_kv_cache hands out the layout
    # the entry points take, and without it they say so.
    cache, layout = kernels_pallas.new_kv_cache(4, 16, 3, 64, "bfloat16", platform="tpu")
    assert (cache.shape, cache.dtype) == kernels_pallas.kv_cache_shape(4, 16, 3, 64, "bfloat16", "tpu")
    assert layout.packed and cache.shape[2:] == layout.token_shape
    k = v = jnp.ones((2, 3, 64), BF16)
    slots = jnp.asarray([16, 17], jnp.int32)
    written = kernels_pallas.update_kv_cache(cache, k, v, slots, layout=layout)
    q = jnp.ones((2, 6, 64), BF16)
    args = (jnp.asarray([2], jnp.int32), jnp.asarray([[1, 0, 0, 0]], jnp.int32),
            jnp.asarray([0, 2], jnp.int32), jnp.asarray([1], jnp.int32))
    out = kernels_pallas.ragged_paged_attention(
        q, written, *args, spec=AttentionSpec(sm_scale=0.125, layout=layout))
    np.testing.assert_allclose(np.asarray(out, np.float32), 1.0, rtol=1e-2)  # v is all ones
    with pytest.raises(ValueError, match="new_kv_cache"):
        kernels_pallas.ragged_paged_attention(q, written, *args, spec=AttentionSpec(sm_scale=0.125))


@functools.cache
def _reference_jit():
    return jax.jit(reference, static_argnames=("spec",))


# (q heads, kv heads) for GQA groups 1 / 4 / 8, head dim, page size, value dtype, options:
# a rotation, not a cross product (interpret mode is slow).
TPU_CASES = [
    ((4, 4), 64, 16, "bfloat16", {}),
    ((8, 2), 128, 32, "bfloat16", {"sliding_window": 20}),
    ((8, 1), 64, 32, "fp8_e4m3", {"soft_cap": 3.0}),
    ((16, 2), 128, 16, "fp8_e5m2", {}),
    ((12, 3), 64, 16, "bfloat16", {"soft_cap": 5.0, "sliding_window": 33}),
    ((8, 8), 128, 16, "float32", {}),
    ((9, 3), 64, 16, "fp8_e4m3", {"sliding_window": 17}),
]
SEQS = [(1, 40), (9, 9), (1, 1), (20, 53), (3, 35), (1, 17)]


@pytest.mark.parametrize("heads,head_dim,page_size,dtype,options", TPU_CASES,
                         ids=[f"g{h[0] // h[1]}-kvh{h[1]}-d{d}-p{p}-{t}-{'-'.join(o) or 'plain'}"
                              for h, d, p, t, o in TPU_CASES])
@pytest.mark.parametrize("tuning", [{}, {"block_q": 8, "pages_per_block": 1}], ids=["default", "small"])
def test_tpu_kernel_on_packed_cache_matches_reference(heads, head_dim, page_size, dtype, options,
                                                      tuning) -> None:
    num_q_heads, num_kv_heads = heads
    batch = make_batch(SEQS, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                       head_dim=head_dim, page_size=page_size, seed=num_kv_heads)
    q = jnp.asarray(batch.q, BF16 if dtype != "float32" else jnp.float32)
    standard = KVCacheLayout(num_kv_heads, head_dim, dtype)
    packed = dataclasses.replace(standard, packed=True)
    values = jnp.asarray(batch.kv_pages).astype(standard.value_dtype)  # NaN slots stay NaN
    cache = convert_cache(jax.lax.bitcast_convert_type(values, jnp.uint8) if standard.is_fp8
                          else values, standard, packed)
    assert cache.dtype == jnp.int32 and cache.shape[2:] == packed.token_shape
    scales = dict(k_scale=0.5, v_scale=2.0) if standard.is_fp8 else {}
    from kernels_pallas.ragged_paged_attention.tpu import TpuTuning

    spec = AttentionSpec(sm_scale=head_dim ** -0.5, **options, **scales)
    got = kernels_pallas.ragged_paged_attention(
        q, cache, *batch.args[2:], spec=dataclasses.replace(spec, layout=packed), backend="tpu",
        interpret=True, tuning=TpuTuning(**tuning))
    want = _reference_jit()(q, values, *batch.args[2:], spec=spec)
    n = batch.num_real_tokens
    got, want = np.asarray(got, np.float32)[:n], np.asarray(want, np.float32)[:n]
    assert np.isfinite(got).all(), "NaN in real rows: a read past kv_len or a bad page"
    np.testing.assert_allclose(got, want, **tolerance(np.float32 if dtype == "float32" else BF16))


@pytest.mark.parametrize("backend", kernels_pallas.list_backends())
def test_every_backend_takes_the_tpu_cache(backend: str) -> None:
    """The cache shape `kv_cache_shape(..., "tpu")` gives is accepted by every variant, for
    attention and for the KV write, with the same results as on a standard cache."""
    batch = make_batch(SEQS[:4], num_q_heads=6, num_kv_heads=3, head_dim=64, page_size=16, seed=7)
    standard = KVCacheLayout(3, 64, "bfloat16")
    packed = dataclasses.replace(standard, packed=True)
    q = jnp.asarray(batch.q, BF16)
    values = jnp.asarray(batch.kv_pages, BF16)
    cache = convert_cache(values, standard, packed)
    assert (cache.shape, cache.dtype) == kernels_pallas.kv_cache_shape(
        values.shape[0], 16, 3, 64, "bfloat16", "tpu")
    tuning = kernels_pallas.get_backend(backend).test_tuning[-1]
    spec = AttentionSpec(sm_scale=0.125)
    got = kernels_pallas.ragged_paged_attention(q, cache, *batch.args[2:],
                                                spec=dataclasses.replace(spec, layout=packed),
                                                backend=backend, interpret=True, tuning=tuning)
    want = _reference_jit()(q, values, *batch.args[2:], spec=spec)
    n = batch.num_real_tokens
    np.testing.assert_allclose(np.asarray(got, np.float32)[:n], np.asarray(want, np.float32)[:n],
                               **tolerance(BF16))
    rng = np.random.default_rng(3)
    k, v = (jnp.asarray(rng.standard_normal((4, 3, 64)), BF16) for _ in range(2))
    slots = jnp.asarray([17, 18, 40, 0], jnp.int32)  # the last one pads into the null page
    written = kernels_pallas.update_kv_cache(cache, k, v, slots, backend=backend,
                                             interpret=True, layout=packed)
    rows = packed.unpack(written.reshape(-1, *packed.token_shape))
    np.testing.assert_array_equal(np.asarray(rows[jnp.asarray([17, 18, 40])], np.float32),
                                  np.asarray(standard.pack(k, v)[:3], np.float32))
    untouched = np.setdiff1d(np.arange(16, rows.shape[0]), [17, 18, 40])
    np.testing.assert_array_equal(np.asarray(written.reshape(-1, cache.shape[2])[untouched]),
                                  np.asarray(cache.reshape(-1, cache.shape[2])[untouched]))
