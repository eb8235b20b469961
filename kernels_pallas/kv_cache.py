"""The paged KV cache's layout per platform, and writing this step's keys and values into it.

A cache is `[num_pages, page_size, *token_shape]` (the model stacks layers in front); what one
token's keys and values look like inside its slot is the layout's to say, because each
platform's kernels want their own:

    standard (CPU, CUDA)   token [2 * num_kv_heads, head_dim] in the value dtype (fp8: uint8 bits;
                           bf16 / f16 for the variants that read bits, the CPU's: uint16 bits)
                           rows:  k0 v0 k1 v1 ...   (key of kv head h at row 2h, value at 2h+1)

    packed (TPU)           token [R * L] int32 words: "slots" of L lanes, p = 32 // b slots of
                           b-bit values per word, slot s in row s // p at bits (s % p) * b.
                           head_dim a multiple of 128: slots k0 v0 k1 v1 ... of L = D lanes
                           (bf16: row h holds k_h in its low halves and v_h in its high ones);
                           otherwise one slot [k_h | v_h | 0 pad] per head, L = 2D rounded up
                           to 128 lanes (D = 64, bf16: row 0 holds heads 0 and 1):

                 lanes:    0          D          2D = L      L + D ...
                 row 0:  | k0 / k1    | v0 / v1  |  k2 / k3  | v2 / v3 | ...   (low / high bits)

The TPU compiler tiles the two minor dims of an array (to 8 x 128 words); a cache whose minor
dims are (page_size, R * W) int32 is already in that tiling for any head count, head dim and
value type, so neither XLA nor Mosaic relayouts it (a (2 * kvh, head_dim) bf16 minor pair is
re-tiled, and XLA copies the whole cache into and out of the kernel every step), and every
kernel load is a 32-bit, lane-aligned slice (Mosaic has no strided load of 16- or 8-bit data).

    slot_mapping[t] = page * page_size + offset      (flat slot of token t)

Padding tokens point at slots of the null page 0, possibly the same slot many times; the
write then leaves garbage there in an unspecified order, which is harmless because page 0 is
never read as context. Under `jax.jit(..., donate_argnums=...)` the scatter on the flat view
updates the donated buffer in place (the reshapes are bitcasts).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

# kv_cache_dtype (vLLM's names) -> the value type whose bits a uint8 cache holds. As in vLLM,
# an fp8 cache is a uint8 array: XLA's CPU scatter into an fp8 array converts the whole array
# to a wider type and back (seconds a step), into uint8 it writes in place.
FP8_KV_CACHE_DTYPES: dict[str, Any] = {
    "fp8": jnp.float8_e4m3fn, "fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2,
}
# The value types a cache may hold, by name.
KV_VALUE_DTYPES: dict[str, Any] = {
    "float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16,
    **FP8_KV_CACHE_DTYPES,
}
LANES = 128  # TPU vector lanes: a packed row is a multiple of this many words


def kv_cache_values(pages: jax.Array, kv_cache_dtype: str = "auto") -> jax.Array:
    """Cache entries as stored -> their values (fp8 bits in uint8 -> fp8, bf16 bits in uint16
    -> bf16). Gather pages first and convert the gathered block: XLA's CPU backend copies a
    whole-cache bitcast inside a loop."""
    if kv_cache_dtype == "auto" or not jnp.issubdtype(pages.dtype, jnp.unsignedinteger):
        return pages
    return jax.lax.bitcast_convert_type(pages, KV_VALUE_DTYPES[kv_cache_dtype])


def interleave_kv(k: jax.Array, v: jax.Array) -> jax.Array:
    """[T, kvh, D] keys and values -> [T, 2 * kvh, D] rows in cache order (k0 v0 k1 v1 ...)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    return jnp.stack([k, v], axis=2).reshape(num_tokens, 2 * num_kv_heads, head_dim)


def _canonical_dtype(name: str) -> str:
    """"fp8" -> "fp8_e4m3" (vLLM's default fp8 is e4m3); other names unchanged."""
    return "fp8_e4m3" if name == "fp8" else name


@dataclasses.dataclass(frozen=True)
class KVCacheLayout:
    """How one token's keys and values fill its cache slot (see the module docstring).

    Frozen and hashable: a static argument of `jax.jit`. `dtype` names the values' type
    ("float32", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2"); `packed` is the TPU layout.
    """

    num_kv_heads: int
    head_dim: int
    dtype: str
    packed: bool = False
    # 16-bit values kept as uint16 bits, for the variants that read bits (`reads_kv_bits`):
    # XLA's CPU scatter into a bf16 array converts the whole cache to float32 and back.
    as_bits: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in KV_VALUE_DTYPES:
            raise ValueError(f"unknown KV cache dtype {self.dtype!r}; choose one of "
                             f"{', '.join(KV_VALUE_DTYPES)}")
        object.__setattr__(self, "dtype", _canonical_dtype(self.dtype))
        if self.num_kv_heads < 1 or self.head_dim < 1:
            raise ValueError(f"num_kv_heads ({self.num_kv_heads}) and head_dim "
                             f"({self.head_dim}) must be positive")

    # ---- sizes -------------------------------------------------------------------------------

    @property
    def value_dtype(self) -> Any:
        return jnp.dtype(KV_VALUE_DTYPES[self.dtype])

    @property
    def is_fp8(self) -> bool:
        return self.dtype.startswith("fp8")

    @property
    def storage_dtype(self) -> Any:
        if self.packed:
            return jnp.dtype(jnp.int32)
        if self.is_fp8:
            return jnp.dtype(jnp.uint8)
        return jnp.dtype(jnp.uint16) if self.as_bits and self.bits == 16 else self.value_dtype

    @property
    def stores_bits(self) -> bool:
        """A standard cache holding its values' bits in unsigned integers (fp8; 16-bit `as_bits`)."""
        return not self.packed and jnp.issubdtype(self.storage_dtype, jnp.unsignedinteger)

    @property
    def bits(self) -> int:
        return self.value_dtype.itemsize * 8

    @property
    def packing(self) -> int:
        """Values per 32-bit word (packed layout)."""
        return 32 // self.bits

    @property
    def split(self) -> bool:
        """Packed keys and values in slots of their own (head_dim a multiple of 128 lanes);
        otherwise a head's [k | v] shares one slot."""
        return self.head_dim % LANES == 0

    @property
    def slot_lanes(self) -> int:
        """L: words of one slot (a packed row)."""
        return self.head_dim if self.split else -(-2 * self.head_dim // LANES) * LANES

    @property
    def num_slots(self) -> int:
        return 2 * self.num_kv_heads if self.split else self.num_kv_heads

    @property
    def num_rows(self) -> int:
        """R: packed rows per token (slots / packing, rounded up)."""
        return -(-self.num_slots // self.packing)

    def slot_of(self, head: int, value: bool) -> int:
        """The packed slot of a head's keys (or values: `value`)."""
        return 2 * head + value if self.split else head

    @property
    def token_shape(self) -> tuple[int, ...]:
        if self.packed:
            return (self.num_rows * self.slot_lanes,)
        return (2 * self.num_kv_heads, self.head_dim)

    def cache_shape(self, num_pages: int, page_size: int) -> tuple[int, ...]:
        return (num_pages, page_size, *self.token_shape)

    def bytes_per_token(self) -> int:
        """What one token of one layer takes, padding included."""
        n = 1
        for d in self.token_shape:
            n *= d
        return n * self.storage_dtype.itemsize

    def check(self, kv_pages: Any) -> None:
        """ValueError unless `kv_pages` is a cache of this layout."""
        if tuple(kv_pages.shape[2:]) != self.token_shape or kv_pages.dtype != self.storage_dtype:
            raise ValueError(
                f"kv_pages {tuple(kv_pages.shape)} {kv_pages.dtype} is not a cache of {self}: "
                f"expected [num_pages, page_size, {', '.join(map(str, self.token_shape))}] "
                f"{self.storage_dtype}")

    # ---- values <-> storage ------------------------------------------------------------------

    def pack(self, k: jax.Array, v: jax.Array) -> jax.Array:
        """[T, kvh, D] keys and values -> [T, *token_shape] cache entries."""
        if not self.packed:
            rows = interleave_kv(k, v).astype(self.value_dtype)
            return jax.lax.bitcast_convert_type(rows, self.storage_dtype) if self.stores_bits else rows
        T, kvh, D = k.shape
        R, p, L = self.num_rows, self.packing, self.slot_lanes
        # [T, slots, L]: k0 v0 k1 v1 ... (split), or [k_h | v_h] per head.
        slots = interleave_kv(k, v) if self.split else jnp.concatenate([k, v], axis=-1)
        slots = slots.astype(self.value_dtype)
        slots = jnp.pad(slots, ((0, 0), (0, R * p - slots.shape[1]), (0, L - slots.shape[2])))
        if p == 1:
            words = jax.lax.bitcast_convert_type(slots, jnp.int32)  # [T, R, L]
        else:
            # [T, R, p, L] -> [T, R, L, p]: the p slots of a word side by side, slot 0 lowest.
            grouped = slots.reshape(T, R, p, L).transpose(0, 1, 3, 2)
            words = jax.lax.bitcast_convert_type(grouped, jnp.int32)
        return words.reshape(T, R * L)

    def unpack(self, entries: jax.Array) -> jax.Array:
        """[..., *token_shape] cache entries -> [..., 2 * kvh, D] values (k0 v0 k1 v1 ...)."""
        if not self.packed:
            return kv_cache_values(entries, self.dtype) if self.stores_bits else entries
        lead = entries.shape[:-1]
        R, p, L, D, kvh = self.num_rows, self.packing, self.slot_lanes, self.head_dim, self.num_kv_heads
        words = entries.reshape(*lead, R, L)
        if p == 1:
            slots = jax.lax.bitcast_convert_type(words, self.value_dtype)  # [..., R, L]
        else:
            vals = jax.lax.bitcast_convert_type(words, self.value_dtype)  # [..., R, L, p]
            slots = jnp.moveaxis(vals, -1, -2).reshape(*lead, R * p, L)
        if self.split:
            return slots[..., : 2 * kvh, :]
        return slots[..., :kvh, : 2 * D].reshape(*lead, 2 * kvh, D)


def standard_layout(kv_pages: Any, kv_cache_dtype: str = "auto") -> KVCacheLayout:
    """The layout of a standard `[num_pages, page_size, 2 * kvh, head_dim]` cache, read off
    its shape and dtype (`kv_cache_dtype` names fp8 values held in a uint8 cache, or bf16 /
    f16 ones in a uint16 cache)."""
    if kv_pages.ndim != 4 or kv_pages.shape[2] % 2:
        raise ValueError(
            f"kv_pages {tuple(kv_pages.shape)} is not a standard cache [num_pages, page_size, "
            "2 * num_kv_heads, head_dim]; pass the cache's layout= for a packed one (what "
            "kernels_pallas.new_kv_cache returns beside the cache, or kv_cache_layout(...))")
    as_bits = jnp.dtype(kv_pages.dtype) == jnp.uint16 and kv_cache_dtype in ("bfloat16", "float16")
    if kv_cache_dtype in FP8_KV_CACHE_DTYPES or as_bits:
        dtype = kv_cache_dtype
    else:
        dtype = jnp.dtype(kv_pages.dtype).name
    return KVCacheLayout(kv_pages.shape[2] // 2, kv_pages.shape[3], dtype, as_bits=as_bits)


def convert_cache(kv_pages: jax.Array, src: KVCacheLayout, dst: KVCacheLayout) -> jax.Array:
    """A whole cache of layout `src` rewritten in layout `dst` (tests and research: a kernel
    handed the other platform's cache; never on a serving path)."""
    num_pages, page_size = kv_pages.shape[:2]
    values = src.unpack(kv_pages).reshape(num_pages * page_size, src.num_kv_heads, 2, src.head_dim)
    rows = dst.pack(values[:, :, 0], values[:, :, 1])
    return rows.reshape(num_pages, page_size, *dst.token_shape)


def update_kv_cache(
    kv_pages: jax.Array,  # [num_pages, page_size, *token_shape]
    rows: jax.Array,  # [num_tokens, *token_shape]: KVCacheLayout.pack(k, v)
    slot_mapping: jax.Array,  # int32[num_tokens]
) -> jax.Array:
    """Return `kv_pages` with token t's entries written at flat slot `slot_mapping[t]`
    (XLA scatter; any layout)."""
    num_pages, page_size = kv_pages.shape[:2]
    if rows.shape[1:] != kv_pages.shape[2:]:
        raise ValueError(f"rows {rows.shape} do not fit kv_pages {kv_pages.shape}: expected "
                         f"[num_tokens, {', '.join(map(str, kv_pages.shape[2:]))}]")
    rows = rows.astype(kv_pages.dtype)
    if rows.shape[0] == 1:
        # NOTE: XLA rewrites a one-row scatter as a dynamic-update-slice, which its CPU
        # backend then fails to keep in place when attention reads the cache afterwards:
        # the whole cache is copied (seconds per step at 1 GB). A second row, written to
        # the null page's slot 0, keeps it a scatter.
        rows = jnp.concatenate([rows, rows])
        slot_mapping = jnp.concatenate([slot_mapping, jnp.zeros_like(slot_mapping)])
    flat = kv_pages.reshape(num_pages * page_size, *kv_pages.shape[2:])
    # mode="drop": an out-of-range slot is a caller bug, but must never corrupt memory.
    flat = flat.at[slot_mapping].set(rows, mode="drop")
    return flat.reshape(kv_pages.shape)
