"""Pallas kernels for jaxserve: ragged paged attention and the paged KV-cache write.

Imports JAX only, never `jaxserve`. Pick a variant by name:

    out = ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                                 sm_scale=head_dim ** -0.5, backend="gpu")
    kv_pages = update_kv_cache(kv_pages, k, v, slot_mapping, backend="gpu")

Variants live one file each in `kernels_pallas/ragged_paged_attention/` (see registry.py).
NOTE: `kernels_pallas.ragged_paged_attention` is this function, not the subpackage; import
variant modules with `from kernels_pallas.ragged_paged_attention import reference`.
"""

from __future__ import annotations

from typing import Any

import jax

from kernels_pallas.kv_cache import FP8_KV_CACHE_DTYPES, kv_cache_bits, kv_cache_values
from kernels_pallas.registry import Backend, get_backend, list_backends, register_backend
from kernels_pallas import ragged_paged_attention as _variants  # registers every variant

__all__ = [
    "FP8_KV_CACHE_DTYPES",
    "Backend",
    "attention_plan",
    "get_backend",
    "list_backends",
    "ragged_paged_attention",
    "register_backend",
    "update_kv_cache",
]


def ragged_paged_attention(
    q: jax.Array,  # [num_tokens, num_q_heads, head_dim]
    kv_pages: jax.Array,  # [num_pages, page_size, 2 * num_kv_heads, head_dim]
    kv_lens: jax.Array,  # int32[max_num_seqs]
    page_indices: jax.Array,  # int32[max_num_seqs, pages_per_seq]
    cu_q_lens: jax.Array,  # int32[max_num_seqs + 1]
    num_seqs: jax.Array,  # int32[1]
    *,
    sm_scale: float,
    backend: str = "reference",
    interpret: bool = False,
    plan: Any = None,
    kv_cache_dtype: str = "auto",
    **tuning,
) -> jax.Array:
    """Attention of a mixed prefill/decode batch over the paged cache, by variant name.

    See `kernels_pallas/ragged_paged_attention/reference.py` for the layout; `tuning` goes to
    the variant (block sizes, `sliding_window`, `soft_cap`, `k_scale`, ...); `plan` is this
    step's `attention_plan(...)` for variants that have one. `kv_cache_dtype` "fp8" /
    "fp8_e4m3" / "fp8_e5m2": `kv_pages` is uint8 holding those values' bits (vLLM's layout).
    """
    if plan is not None:
        tuning["plan"] = plan
    impl = get_backend(backend)
    if impl.reads_kv_bits:
        tuning["kv_cache_dtype"] = kv_cache_dtype
    else:
        kv_pages = kv_cache_values(kv_pages, kv_cache_dtype)
    return impl.attention(
        q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
        sm_scale=sm_scale, interpret=interpret, **tuning,
    )


def attention_plan(
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    num_tokens: int,
    page_size: int,
    backend: str = "reference",
    **tuning,
) -> Any:
    """The variant's per-step work plan (None if it has none): build it once per step and
    pass it to every layer's `ragged_paged_attention(..., plan=...)`."""
    make = get_backend(backend).plan
    if make is None:
        return None
    return make(kv_lens, page_indices, cu_q_lens, num_seqs, num_tokens=num_tokens,
                page_size=page_size, **tuning)


def update_kv_cache(
    kv_pages: jax.Array,  # [num_pages, page_size, 2 * num_kv_heads, head_dim]
    k: jax.Array,  # [num_tokens, num_kv_heads, head_dim]
    v: jax.Array,  # [num_tokens, num_kv_heads, head_dim]
    slot_mapping: jax.Array,  # int32[num_tokens], flat slot = page * page_size + offset
    *,
    backend: str = "reference",
    interpret: bool = False,
    k_scale: float | None = None,
    v_scale: float | None = None,
    kv_cache_dtype: str = "auto",
) -> jax.Array:
    """Write this step's keys/values at their slots; in place when `kv_pages` is donated.

    A low-precision cache stores k / k_scale and v / v_scale (for `kv_cache_dtype` "fp8...",
    their fp8 bits in a uint8 cache); attention multiplies them back by the same scales."""
    if k_scale is not None:
        k = k / k_scale
    if v_scale is not None:
        v = v / v_scale
    k, v = kv_cache_bits(k, kv_cache_dtype), kv_cache_bits(v, kv_cache_dtype)
    return get_backend(backend).update_kv_cache(kv_pages, k, v, slot_mapping, interpret=interpret)
