"""Writing this step's keys and values into the paged KV cache (XLA scatter).

Cache layout, one array per layer (or all layers stacked and flattened on axis 0)::

    kv_pages [num_pages, page_size, 2 * num_kv_heads, head_dim]
                          slot:  k0 v0 k1 v1 ...   (key of kv head h at 2h, value at 2h+1)

    slot_mapping[t] = page * page_size + offset      (flat slot of token t)

Padding tokens point at slots of the null page 0, possibly the same slot many times; the
scatter then writes garbage there in an unspecified order, which is harmless because page 0
is never read as context.

Under `jax.jit(..., donate_argnums=...)` the scatter on the reshaped view updates the donated
buffer in place: the reshapes are bitcasts and XLA's scatter runs in place on its operand.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

# kv_cache_dtype (vLLM's names) -> the value type whose bits a uint8 cache holds. As in vLLM,
# an fp8 cache is a uint8 array: XLA's CPU scatter into an fp8 array converts the whole array
# to a wider type and back (seconds a step), into uint8 it writes in place.
FP8_KV_CACHE_DTYPES: dict[str, Any] = {
    "fp8": jnp.float8_e4m3fn, "fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2,
}


def kv_cache_values(pages: jax.Array, kv_cache_dtype: str = "auto") -> jax.Array:
    """Cache entries as stored -> their values (fp8 bits in uint8 -> fp8). Gather pages first
    and convert the gathered block: XLA's CPU backend copies a whole-cache bitcast inside a loop."""
    fp8 = FP8_KV_CACHE_DTYPES.get(kv_cache_dtype)
    return pages if fp8 is None else jax.lax.bitcast_convert_type(pages, fp8)


def kv_cache_bits(x: jax.Array, kv_cache_dtype: str = "auto") -> jax.Array:
    """Values to store -> cache entries (-> fp8 -> its bits in uint8 for an fp8 cache)."""
    fp8 = FP8_KV_CACHE_DTYPES.get(kv_cache_dtype)
    return x if fp8 is None else jax.lax.bitcast_convert_type(x.astype(fp8), jnp.uint8)


def interleave_kv(k: jax.Array, v: jax.Array) -> jax.Array:
    """[T, kvh, D] keys and values -> [T, 2 * kvh, D] rows in cache order (k0 v0 k1 v1 ...)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    return jnp.stack([k, v], axis=2).reshape(num_tokens, 2 * num_kv_heads, head_dim)


def update_kv_cache(
    kv_pages: jax.Array,  # [num_pages, page_size, 2 * num_kv_heads, head_dim]
    k: jax.Array,  # [num_tokens, num_kv_heads, head_dim]
    v: jax.Array,  # [num_tokens, num_kv_heads, head_dim]
    slot_mapping: jax.Array,  # int32[num_tokens]
) -> jax.Array:
    """Return `kv_pages` with token t's key and value written at flat slot `slot_mapping[t]`."""
    num_pages, page_size, num_kv_slots, head_dim = kv_pages.shape
    if k.shape != v.shape or 2 * k.shape[1] != num_kv_slots or k.shape[2] != head_dim:
        raise ValueError(
            f"k {k.shape} / v {v.shape} do not fit kv_pages {kv_pages.shape}: expected "
            f"[num_tokens, {num_kv_slots // 2}, {head_dim}] each"
        )
    new = interleave_kv(k, v).astype(kv_pages.dtype)
    if new.shape[0] == 1:
        # NOTE: XLA rewrites a one-row scatter as a dynamic-update-slice, which its CPU
        # backend then fails to keep in place when attention reads the cache afterwards:
        # the whole cache is copied (seconds per step at 1 GB). A second row, written to
        # the null page's slot 0, keeps it a scatter.
        new = jnp.concatenate([new, new])
        slot_mapping = jnp.concatenate([slot_mapping, jnp.zeros_like(slot_mapping)])
    flat = kv_pages.reshape(num_pages * page_size, num_kv_slots, head_dim)
    # mode="drop": an out-of-range slot is a caller bug, but must never corrupt memory.
    flat = flat.at[slot_mapping].set(new, mode="drop")
    return flat.reshape(kv_pages.shape)
