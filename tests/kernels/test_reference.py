"""The jax.numpy reference (the CPU serving path and every kernel's oracle) against NumPy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import kernels_pallas
from kernels_pallas import AttentionSpec
from kernels_pallas.ragged_paged_attention.reference import ReferenceTuning, ragged_paged_attention

from .batches import make_batch, naive_attention, tolerance

CASES = {
    "decode_only": [(1, 17), (1, 1), (1, 32), (1, 50)],
    "prefill_only": [(20, 20), (7, 7), (33, 33)],
    "mixed": [(1, 40), (12, 12), (1, 5), (9, 9)],
    "chunked_prefill": [(10, 45), (16, 16 + 32), (5, 100)],
    "one_token": [(1, 1)],
    "page_boundaries": [(16, 16), (1, 33), (17, 32), (1, 64)],
    "empty_q_seq": [(3, 3), (0, 10), (2, 9)],
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (8, 1)], ids=["gqa1", "gqa3", "gqa8"])
def test_reference_matches_numpy(case: str, heads: tuple[int, int]) -> None:
    batch = make_batch(CASES[case], num_q_heads=heads[0], num_kv_heads=heads[1], head_dim=64,
                       page_size=16, seed=len(case))
    scale = 64 ** -0.5
    got = jax.jit(ragged_paged_attention, static_argnames="spec")(
        *batch.args, spec=AttentionSpec(sm_scale=scale))
    assert got.dtype == batch.q.dtype and got.shape == batch.q.shape
    np.testing.assert_allclose(np.asarray(got), naive_attention(batch, sm_scale=scale),
                               **tolerance(np.float32))


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("page_size,head_dim", [(16, 128), (32, 64)])
def test_reference_dtypes_and_shapes(dtype, page_size: int, head_dim: int) -> None:
    batch = make_batch(CASES["mixed"] + [(3, 70)], num_q_heads=6, num_kv_heads=2,
                       head_dim=head_dim, page_size=page_size, dtype=dtype, seed=3)
    got = ragged_paged_attention(*batch.args, spec=AttentionSpec(sm_scale=0.1))
    assert got.dtype == dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), naive_attention(batch, sm_scale=0.1),
                               **tolerance(dtype))


@pytest.mark.parametrize("sliding_window,soft_cap", [(8, None), (None, 5.0), (20, 2.0)])
def test_reference_sliding_window_and_soft_cap(sliding_window, soft_cap) -> None:
    batch = make_batch(CASES["chunked_prefill"] + [(1, 70)], num_q_heads=4, num_kv_heads=2,
                       head_dim=64, page_size=16, seed=5)
    spec = AttentionSpec(sm_scale=0.2, sliding_window=sliding_window, soft_cap=soft_cap)
    got = ragged_paged_attention(*batch.args, spec=spec)
    want = naive_attention(batch, sm_scale=0.2, sliding_window=sliding_window, soft_cap=soft_cap)
    np.testing.assert_allclose(np.asarray(got), want, **tolerance(np.float32))


def test_reference_attention_sinks() -> None:
    """GPT-OSS's sinks, some far above the scores (their weight takes nearly all of the row)
    and some far below, with a window, against the oracle's extra softmax column."""
    batch = make_batch(CASES["chunked_prefill"] + [(1, 70)], num_q_heads=4, num_kv_heads=2,
                       head_dim=64, page_size=16, seed=6)
    sinks = np.array([0.5, -2.0, 30.0, -30.0], np.float32)
    got = ragged_paged_attention(*batch.args, spec=AttentionSpec(sm_scale=0.2, sliding_window=20),
                                 sinks=sinks)
    want = naive_attention(batch, sm_scale=0.2, sliding_window=20, sinks=sinks)
    np.testing.assert_allclose(np.asarray(got), want, **tolerance(np.float32))


def test_reference_huge_flattened_cache_and_all_padding() -> None:
    """Page ids offset into a stacked all-layer cache, and a batch with no real sequence."""
    batch = make_batch(CASES["mixed"], num_q_heads=4, num_kv_heads=2, head_dim=64,
                       page_size=16, extra_pages=2000, seed=7)
    spec = AttentionSpec(sm_scale=0.3)
    got = ragged_paged_attention(*batch.args, spec=spec, tuning=ReferenceTuning(pages_per_step=3))
    np.testing.assert_allclose(np.asarray(got), naive_attention(batch, sm_scale=0.3),
                               **tolerance(np.float32))
    empty = ragged_paged_attention(*batch.args[:5], np.array([0], np.int32), spec=spec)
    assert not np.asarray(empty).any()


def test_dispatch_and_registry() -> None:
    batch = make_batch(CASES["mixed"], num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16)
    got = kernels_pallas.ragged_paged_attention(*batch.args, spec=AttentionSpec(sm_scale=0.3),
                                                backend="reference")
    np.testing.assert_allclose(np.asarray(got), naive_attention(batch, sm_scale=0.3),
                               **tolerance(np.float32))
    assert kernels_pallas.list_backends()[0] == "reference"
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        kernels_pallas.get_backend("nope")


def test_update_kv_cache_in_place_with_padding_duplicates() -> None:
    num_pages, page_size, kvh, d = 6, 4, 2, 8
    rng = np.random.default_rng(0)
    cache = rng.standard_normal((num_pages, page_size, 2 * kvh, d)).astype(np.float32)
    k = rng.standard_normal((5, kvh, d)).astype(np.float32)
    v = rng.standard_normal((5, kvh, d)).astype(np.float32)
    slots = np.array([9, 22, 3, 0, 0], np.int32)  # last two: padding into the null page 0
    want = cache.copy()
    for t in range(3):
        want[slots[t] // page_size, slots[t] % page_size, 0::2] = k[t]
        want[slots[t] // page_size, slots[t] % page_size, 1::2] = v[t]
    write = jax.jit(kernels_pallas.update_kv_cache, donate_argnums=0)
    got = np.asarray(write(jnp.asarray(cache), k, v, slots))
    np.testing.assert_array_equal(got[1:], want[1:])
    # Donation + reshape-view scatter: XLA must alias the output to the donated input.
    hlo = write.lower(jnp.asarray(cache), k, v, slots).compile().as_text()
    assert "input_output_alias" in hlo or "must-alias" in hlo or "may-alias" in hlo
