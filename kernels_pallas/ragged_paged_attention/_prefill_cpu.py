"""Build, load and call the C++ prefill attention (`prefill_cpu.cc`, an XLA FFI handler).

Built on first use by `kernels_pallas.cpu_build`. It needs AVX-512 (checked at run time);
its dots are bfloat16 (vdpbf16ps) when the cache holds bfloat16 and the CPU has AVX512-BF16,
float32 otherwise. `why_not(...)` names what a call's operands or this CPU lack; cpu.py then
keeps its XLA prefill loop (the kernel's oracle in the tests).
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import cpu_build
from kernels_pallas.ragged_paged_attention._decode_cpu import cache_why_not, sinks_operand

SOURCE = Path(__file__).with_name("prefill_cpu.cc")
TARGET = "kernels_pallas_paged_prefill_attention_cpu"
# Built for AVX2 like the others; the AVX-512 functions carry target attributes, so the
# library loads on any x86-64 CPU and `prefill_attention_supported` tells what runs.
FLAGS = ("-mavx2", "-mfma")
MAX_HEAD_DIM = 256

_LIBRARY = cpu_build.FfiLibrary("prefill_attention_cpu", SOURCE, FLAGS,
                               {TARGET: "PagedPrefillAttentionCpu"},
                               supported="prefill_attention_supported",
                               what="prefill attention kernel", fallback="using the XLA loop",
                               requires="AVX-512 (F, BW, VL, DQ)")


def available() -> bool:
    """Whether the kernel is built and registered (the first call builds it, once per machine)."""
    return _LIBRARY.available()


def unavailable_reason() -> str | None:
    return _LIBRARY.unavailable_reason()


def bf16_dots(cache_dtype) -> bool:
    """Whether a call over a cache of `cache_dtype` (bfloat16, or its bits in uint16) runs
    bfloat16 dots (else float32)."""
    lib = _LIBRARY.load()
    return (lib is not None and jnp.dtype(cache_dtype) in (jnp.bfloat16, jnp.uint16)
            and lib.prefill_attention_supported() == 2)


def why_not(head_dim: int, cache_dtype, kv_cache_dtype: str, scaled: bool) -> str | None:
    """Why the kernel cannot take this call (None: it can)."""
    if reason := cache_why_not(cache_dtype, kv_cache_dtype, scaled):
        return reason
    if head_dim % 16 or head_dim > MAX_HEAD_DIM:
        return f"head_dim {head_dim}: must be a multiple of 16, at most {MAX_HEAD_DIM}"
    if not available():
        return unavailable_reason() or "not built"
    return None


def paged_prefill_attention(q: jax.Array, kv_pages: jax.Array, page_indices: jax.Array,
                            cu: jax.Array, q_lens: jax.Array, kv_lens: jax.Array, *,
                            sm_scale: float, soft_cap: float | None, sliding_window: int | None,
                            decode_q_len: int, block_q: int, dots: str = "auto",
                            sinks: jax.Array | None = None) -> jax.Array:
    """q f32 [T, qh, D]; `kv_pages` [pages, page_size, 2 * kvh, D] f32/bf16 (or bf16 bits in
    uint16); per sequence
    `cu` (i32[S + 1]), `q_lens` and `kv_lens` (i32[S], 0 past the real ones) -> f32 [T, qh, D]
    with the rows of sequences of more than `decode_q_len` query tokens; other rows are 0.
    `dots`: "auto" (`bf16_dots`), "float32", or "bfloat16" (ValueError where it cannot run).
    `sinks`: f32 [qh] attention sinks (reference.py)."""
    if dots not in ("auto", "float32", "bfloat16"):
        raise ValueError(f"dots must be 'auto', 'float32' or 'bfloat16', not {dots!r}")
    use_bf16 = bf16_dots(kv_pages.dtype)
    if dots == "bfloat16" and not use_bf16:
        raise ValueError("dots='bfloat16' needs a bfloat16 cache and a CPU with AVX512-BF16")
    if dots == "float32":
        use_bf16 = False
    return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32),
                            vmap_method="sequential")(
        q.astype(jnp.float32), kv_pages, page_indices.astype(jnp.int32), cu.astype(jnp.int32),
        q_lens.astype(jnp.int32), kv_lens.astype(jnp.int32), sinks_operand(sinks),
        sm_scale=np.float32(sm_scale), soft_cap=np.float32(soft_cap or 0.0),
        sliding_window=np.int64(sliding_window or 0), decode_q_len=np.int64(decode_q_len),
        block_q=np.int64(block_q), bf16_dots=use_bf16)
