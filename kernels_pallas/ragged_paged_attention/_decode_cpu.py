"""Build, load and call the C++ decode attention (`decode_cpu.cc`, an XLA FFI handler).
Its dots are bfloat16 (vdpbf16ps) when the cache holds bfloat16, the CPU has AVX512-BF16 and
the shapes allow it (`bf16_dots`); otherwise float32 (AVX2/FMA).

Built on first use by `kernels_pallas.cpu_build`; `available()` says whether it loaded and
`unavailable_reason()` why not. `why_not(...)` names what a call's operands lack; cpu.py then
keeps its XLA decode loop (the kernel's oracle in the tests).
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import cpu_build

SOURCE = Path(__file__).with_name("decode_cpu.cc")
TARGET = "kernels_pallas_paged_decode_attention_cpu"
FLAGS = ("-mavx2", "-mfma")
MAX_GROUP = 16  # q heads per kv head (the kernel's static bound)
MAX_KV_HEADS = 64  # kv heads on one device (the same)
CHUNK_KEYS = 256  # keys per work item; a page size must divide it
MAX_BF16_HEAD_DIM = 256  # the bf16 dots' bound (kMaxBf16D)

_LIBRARY = cpu_build.FfiLibrary("decode_attention_cpu", SOURCE, FLAGS,
                               {TARGET: "PagedDecodeAttentionCpu"},
                               supported="paged_decode_attention_supported",
                               what="decode attention kernel",
                               fallback="using the XLA loop")


def available() -> bool:
    """Whether the kernel is built and registered (the first call builds it, once per machine)."""
    return _LIBRARY.available()


def unavailable_reason() -> str | None:
    return _LIBRARY.unavailable_reason()


def bf16_dots(cache_dtype, head_dim: int, page_size: int) -> bool:
    """Whether a call over a cache of `cache_dtype` (bfloat16, or its bits in uint16) runs
    bfloat16 dots (else float32): tiles of 16 keys, two 16-lane vectors of bf16 per 32 channels."""
    lib = _LIBRARY.load()
    return (lib is not None and jnp.dtype(cache_dtype) in (jnp.bfloat16, jnp.uint16)
            and head_dim % 32 == 0 and head_dim <= MAX_BF16_HEAD_DIM and page_size % 16 == 0
            and lib.paged_decode_attention_supported() == 2)


def why_not(num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
            cache_dtype, kv_cache_dtype: str, scaled: bool) -> str | None:
    """Why the kernel cannot take this call (None: it can)."""
    if reason := cache_why_not(cache_dtype, kv_cache_dtype, scaled):
        return reason
    if num_q_heads % num_kv_heads or num_q_heads // num_kv_heads > MAX_GROUP:
        return f"GQA group {num_q_heads}/{num_kv_heads} above {MAX_GROUP}"
    if num_kv_heads > MAX_KV_HEADS:
        return f"{num_kv_heads} kv heads above {MAX_KV_HEADS}"
    if head_dim % 8:
        return f"head_dim {head_dim} not a multiple of 8"
    if CHUNK_KEYS % page_size or page_size % 8:
        return f"page size {page_size}: must divide {CHUNK_KEYS} and be a multiple of 8"
    if not available():
        return unavailable_reason() or "not built"
    return None


def cache_why_not(cache_dtype, kv_cache_dtype: str, scaled: bool) -> str | None:
    """Why the C++ kernels cannot read this cache: they read float32, bfloat16, and bfloat16
    bits in uint16 (`kv_cache_dtype` "bfloat16"; kernels_pallas/kv_cache.py)."""
    if kv_cache_dtype.startswith("fp8") or scaled:
        return "fp8 / scaled caches take the XLA loop"
    dtype = jnp.dtype(cache_dtype)
    if dtype == jnp.uint16 and kv_cache_dtype == "bfloat16":
        return None
    if dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        return f"cache must be float32 or bfloat16 (or its bits), not {dtype} ({kv_cache_dtype})"
    return None


def sinks_operand(sinks: jax.Array | None) -> jax.Array:
    """The kernels' sinks operand: float32 [num_q_heads], or empty for none."""
    return jnp.zeros((0,), jnp.float32) if sinks is None else sinks.astype(jnp.float32).reshape(-1)


def paged_decode_attention(q: jax.Array, kv_pages: jax.Array, page_indices: jax.Array,
                           row_seq: jax.Array, row_pos: jax.Array, num_rows: jax.Array, *,
                           sm_scale: float, soft_cap: float | None,
                           sliding_window: int | None,
                           sinks: jax.Array | None = None, dots: str = "auto") -> jax.Array:
    """q f32 [R, qh, D] (one query row each, at position `row_pos` of sequence `row_seq`),
    `kv_pages` [pages, page_size, 2 * kvh, D] f32/bf16 (or bf16 bits in uint16) -> f32
    [R, qh, D]; rows past
    `num_rows` (i32[1]) are zeros. `sinks`: f32 [qh] attention sinks (reference.py).
    `dots`: "auto" (`bf16_dots`), "float32", or "bfloat16" (ValueError where it cannot run)."""
    if dots not in ("auto", "float32", "bfloat16"):
        raise ValueError(f"dots must be 'auto', 'float32' or 'bfloat16', not {dots!r}")
    use_bf16 = bf16_dots(kv_pages.dtype, q.shape[-1], kv_pages.shape[1]) and dots != "float32"
    if dots == "bfloat16" and not use_bf16:
        raise ValueError("dots='bfloat16' needs a bfloat16 cache, head_dim a multiple of 32, "
                         "pages of a multiple of 16 tokens and a CPU with AVX512-BF16")
    return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32),
                            vmap_method="sequential")(
        q.astype(jnp.float32), kv_pages, page_indices.astype(jnp.int32),
        row_seq.astype(jnp.int32), row_pos.astype(jnp.int32),
        jnp.reshape(num_rows, (1,)).astype(jnp.int32), sinks_operand(sinks),
        sm_scale=np.float32(sm_scale), soft_cap=np.float32(soft_cap or 0.0),
        sliding_window=np.int64(sliding_window or 0), bf16_dots=use_bf16)
