"""Pallas kernels for jaxserve: ragged paged attention and the paged KV-cache write.

Imports JAX only, never `jaxserve`. Pick a variant by name:

    spec = AttentionSpec(sm_scale=head_dim ** -0.5, sliding_window=4096)  # what it computes
    out = ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                                 spec=spec, backend="gpu")
    kv_pages = update_kv_cache(kv_pages, k, v, slot_mapping, backend="gpu")

The cache layout is the kernels' to say per platform: `new_kv_cache(...)` makes a cache and
its layout together (pass both: the layout in the `AttentionSpec` and as `layout=` to the
write), `kv_cache_shape(...)` / `kv_cache_layout(...)` say them apart
(kernels_pallas/kv_cache.py draws both layouts).

Variants live one file each in `kernels_pallas/ragged_paged_attention/` (see registry.py).
NOTE: `kernels_pallas.ragged_paged_attention` is this function, not the subpackage; import
variant modules with `from kernels_pallas.ragged_paged_attention import reference`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from kernels_pallas import ragged_paged_attention as _variants  # noqa: F401 - registers every variant
from kernels_pallas.kv_cache import (
    FP8_KV_CACHE_DTYPES,
    KV_VALUE_DTYPES,
    KVCacheLayout,
    convert_cache,
    kv_cache_values,
    standard_layout,
)
from kernels_pallas.kv_cache import (
    update_kv_cache as _xla_kv_write,
)
from kernels_pallas.registry import (
    AttentionFn,
    AttentionSpec,
    Backend,
    KVWriteFn,
    PlanFn,
    VariantPlan,
    get_backend,
    list_backends,
    register_backend,
)

__all__ = [
    "FP8_KV_CACHE_DTYPES",
    "KV_VALUE_DTYPES",
    "AttentionFn",
    "AttentionSpec",
    "Backend",
    "KVCacheLayout",
    "KVWriteFn",
    "PlanFn",
    "VariantPlan",
    "attention_plan",
    "get_backend",
    "kv_cache_layout",
    "kv_cache_shape",
    "list_backends",
    "new_kv_cache",
    "ragged_paged_attention",
    "register_backend",
    "update_kv_cache",
]

# The attention variant each platform runs by default (attention_backend="auto").
PLATFORM_BACKENDS = {"cpu": "cpu", "cuda": "gpu", "tpu": "tpu"}


def kv_cache_layout(
    num_kv_heads: int, head_dim: int, kv_cache_dtype: str, *, platform: str | None = None,
    backend: str | None = None,
) -> KVCacheLayout:
    """The cache layout `backend`'s kernels take (or `platform`'s default kernel's).
    `kv_cache_dtype`: the values' type, "float32", "bfloat16", "float16" or "fp8"
    ("fp8_e4m3", "fp8_e5m2")."""
    if backend is None:
        if platform not in PLATFORM_BACKENDS:
            raise ValueError(f"unknown platform {platform!r}; one of {', '.join(PLATFORM_BACKENDS)}")
        backend = PLATFORM_BACKENDS[platform]
    impl = get_backend(backend)
    return KVCacheLayout(num_kv_heads, head_dim, kv_cache_dtype, packed=impl.packed_layout,
                         as_bits=impl.reads_kv_bits and not impl.packed_layout)


def kv_cache_shape(
    num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, kv_cache_dtype: str,
    platform: str,
) -> tuple[tuple[int, ...], Any]:
    """(shape, storage dtype) of a paged cache (one layer) that `platform`'s kernels take:
    every variant accepts it."""
    layout = kv_cache_layout(num_kv_heads, head_dim, kv_cache_dtype, platform=platform)
    return layout.cache_shape(num_pages, page_size), layout.storage_dtype


def new_kv_cache(
    num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, kv_cache_dtype: str, *,
    platform: str | None = None, backend: str | None = None,
) -> tuple[jax.Array, KVCacheLayout]:
    """A zeroed paged cache (one layer) in the layout `backend`'s kernels take (or `platform`'s
    default kernel's), and that layout: pass it in `ragged_paged_attention`'s
    `AttentionSpec(layout=...)` and as `layout=` to `update_kv_cache` (a packed cache's
    layout cannot be read off its shape)."""
    layout = kv_cache_layout(num_kv_heads, head_dim, kv_cache_dtype, platform=platform,
                             backend=backend)
    return jax.numpy.zeros(layout.cache_shape(num_pages, page_size), layout.storage_dtype), layout


def ragged_paged_attention(
    q: jax.Array,  # [num_tokens, num_q_heads, head_dim]
    kv_pages: jax.Array,  # [num_pages, page_size, *layout.token_shape]
    kv_lens: jax.Array,  # int32[max_num_seqs]
    page_indices: jax.Array,  # int32[max_num_seqs, pages_per_seq]
    cu_q_lens: jax.Array,  # int32[max_num_seqs + 1]
    num_seqs: jax.Array,  # int32[1]
    *,
    spec: AttentionSpec,
    sinks: jax.Array | None = None,  # float32 [num_q_heads]: GPT-OSS's attention sinks
    backend: str = "reference",
    interpret: bool = False,
    plan: VariantPlan = None,
    tuning: Any = None,
) -> jax.Array:
    """Attention of a mixed prefill/decode batch over the paged cache, by variant name.

    See `kernels_pallas/ragged_paged_attention/reference.py` for the batch layout and
    `kernels_pallas/kv_cache.py` for the cache's. `spec` is what it computes
    (kernels_pallas/registry.py); `tuning` is the variant's own record (e.g. `GpuTuning`;
    None: its defaults); `plan` is this step's `attention_plan(...)` for variants that have
    one. Without `spec.layout` the cache is a standard one, read off its shape;
    `spec.kv_cache_dtype` "fp8" / "fp8_e4m3" / "fp8_e5m2" then says it is uint8 holding those
    values' bits (vLLM's layout), "bfloat16" / "float16" with a uint16 cache likewise (the
    layout of the variants that read bits, the CPU's). A cache in the other layout than the
    variant's own is converted whole first (tests, research).
    """
    impl = get_backend(backend)
    layout = spec.layout or standard_layout(kv_pages, spec.kv_cache_dtype)
    # The variant's spec describes the cache it is handed (registry.py's docstring).
    if impl.packed_layout:
        if not layout.packed:
            packed = dataclasses.replace(layout, packed=True)
            kv_pages, layout = convert_cache(kv_pages, layout, packed), packed
        spec = dataclasses.replace(spec, layout=layout, kv_cache_dtype="auto")
    else:
        kv_cache_dtype = layout.dtype if layout.stores_bits else "auto"
        if layout.packed:  # -> standard order, as values (fp8 arrays for fp8)
            kv_pages, kv_cache_dtype = layout.unpack(kv_pages), "auto"
        if not impl.reads_kv_bits:
            kv_pages, kv_cache_dtype = kv_cache_values(kv_pages, kv_cache_dtype), "auto"
        spec = dataclasses.replace(spec, layout=None, kv_cache_dtype=kv_cache_dtype)
    return impl.attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, spec=spec,
                          sinks=sinks, plan=plan, interpret=interpret, tuning=tuning)


def attention_plan(
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    num_tokens: int,
    page_size: int,
    spec: AttentionSpec,
    backend: str = "reference",
    tuning: Any = None,
) -> VariantPlan:
    """The variant's per-step work plan (None if it has none): build it once per step and
    pass it to every layer's `ragged_paged_attention(..., plan=...)` with the same `spec`
    (what the plan reads of it: e.g. the sliding window) and `tuning`."""
    make = get_backend(backend).plan
    if make is None:
        return None
    return make(kv_lens, page_indices, cu_q_lens, num_seqs, num_tokens=num_tokens,
                page_size=page_size, spec=spec, tuning=tuning)


def update_kv_cache(
    kv_pages: jax.Array,  # [num_pages, page_size, *layout.token_shape]
    k: jax.Array,  # [num_tokens, num_kv_heads, head_dim]
    v: jax.Array,  # [num_tokens, num_kv_heads, head_dim]
    slot_mapping: jax.Array,  # int32[num_tokens], flat slot = page * page_size + offset
    *,
    backend: str = "reference",
    interpret: bool = False,
    k_scale: float | None = None,
    v_scale: float | None = None,
    kv_cache_dtype: str = "auto",
    layout: KVCacheLayout | None = None,
) -> jax.Array:
    """Write this step's keys/values at their slots; in place when `kv_pages` is donated.

    A low-precision cache stores k / k_scale and v / v_scale (for `kv_cache_dtype` "fp8...",
    their fp8 bits); attention multiplies them back by the same scales. The variant's own
    write runs on a cache of its layout, XLA's scatter on the other."""
    if k_scale is not None:
        k = k / k_scale
    if v_scale is not None:
        v = v / v_scale
    layout = layout or standard_layout(kv_pages, kv_cache_dtype)
    layout.check(kv_pages)
    rows = layout.pack(k, v)
    impl = get_backend(backend)
    if impl.packed_layout != layout.packed:
        return _xla_kv_write(kv_pages, rows, slot_mapping)
    return impl.update_kv_cache(kv_pages, rows, slot_mapping, interpret=interpret)
