"""Build, load and call the C++ CPU int8 matmul (`int8_matmul_cpu.cc`, an XLA FFI handler).

Built on first use by `kernels_pallas.cpu_build` (the system's C++ compiler, cached by a hash
of the sources, flags and jaxlib version). Where there is no
compiler, the CPU lacks AVX2/FMA, or the build fails, `available()` is False (with the
reason in `unavailable_reason()`) and callers use the XLA reference.
"""

from __future__ import annotations

import math
from pathlib import Path

import jax
import jax.numpy as jnp

from kernels_pallas import cpu_build

SOURCE = Path(__file__).with_name("int8_matmul_cpu.cc")
TARGET = "kernels_pallas_int8_matmul_cpu"
FLAGS = ("-mavx2", "-mfma")
# The kernel's vector loop takes 32 inputs at a time within a group.
K_MULTIPLE = 32

_LIBRARY = cpu_build.FfiLibrary("int8_matmul_cpu", SOURCE, FLAGS, {TARGET: "Int8MatmulCpu"},
                               supported="int8_matmul_cpu_supported",
                               what="int8 kernel", fallback="using XLA's int8 matmul")


def available() -> bool:
    """Whether the kernel is built and registered: the first call builds (once per machine),
    loads and registers it, or records why it cannot."""
    return _LIBRARY.available()


def unavailable_reason() -> str | None:
    return _LIBRARY.unavailable_reason()


def why_not(x: jax.Array, qweight: jax.Array, scale: jax.Array) -> str | None:
    """Why the kernel cannot take these operands (None: it can)."""
    num_tokens, k, groups = math.prod(x.shape[:-1]), x.shape[-1], scale.shape[-1]
    if jnp.dtype(x.dtype) != jnp.float32:
        return f"activations must be float32, not {jnp.dtype(x.dtype)}"
    if jnp.dtype(qweight.dtype) != jnp.int8:
        return f"weights must be int8, not {jnp.dtype(qweight.dtype)}"
    if qweight.shape[-1] != k or scale.shape[:-1] != qweight.shape[:-1]:
        return f"shapes disagree: x {x.shape}, qweight {qweight.shape}, scale {scale.shape}"
    if groups <= 0 or k % groups or (k // groups) % K_MULTIPLE:
        return f"each of the {groups} groups of K={k} inputs must be a multiple of {K_MULTIPLE}"
    if num_tokens < 1:
        return "no tokens"
    if not available():
        return unavailable_reason() or "not built"
    return None


def supports(x: jax.Array, qweight: jax.Array, scale: jax.Array) -> bool:
    return why_not(x, qweight, scale) is None


def int8_matmul_cpu(x: jax.Array, qweight: jax.Array, scale: jax.Array, layer: jax.Array) -> jax.Array:
    """The custom call: x [..., K] f32, qweight [(L,) N, K] int8, scale [(L,) N, G] f32."""
    lead, n = x.shape[:-1], qweight.shape[-2]
    x2 = x.reshape(-1, x.shape[-1])
    y = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x2.shape[0], n), jnp.float32),
                         vmap_method="sequential")(
        x2, qweight, scale.astype(jnp.float32), layer.astype(jnp.int32))
    return y.reshape(*lead, n)
