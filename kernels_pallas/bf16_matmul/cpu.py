"""Build, load and call the C++ CPU bf16 matmuls (`bf16_matmul_cpu.cc`, XLA FFI handlers).

Built on first use by `kernels_pallas.cpu_build`: with oneDNN (`-ldnnl`, Debian's
libdnnl-dev) when its headers and library are found, else without, and then only the
few-token kernel exists. `available()` / `onednn_available()` say what loaded, and why not
(`unavailable_reason()`, `onednn_unavailable_reason()`); callers use the XLA reference for
what is missing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
from pathlib import Path

import jax
import jax.numpy as jnp

from kernels_pallas import cpu_build

SOURCE = Path(__file__).with_name("bf16_matmul_cpu.cc")
TARGET = "kernels_pallas_bf16_matmul_cpu"
ONEDNN_TARGET = "kernels_pallas_bf16_matmul_onednn"
FLAGS = ("-mavx2", "-mfma")
ONEDNN_FLAGS = ("-DKERNELS_PALLAS_ONEDNN",)
# The kernel's vector loop takes 32 inputs at a time.
K_MULTIPLE = 32


class _Library(cpu_build.FfiLibrary):
    """The kernel library, with oneDNN's matmul in it when the build finds oneDNN."""

    def __init__(self) -> None:
        super().__init__("bf16_matmul_cpu", SOURCE, FLAGS, {TARGET: "Bf16MatmulCpu"},
                         supported="bf16_matmul_cpu_supported", what="bf16 kernel",
                         fallback="using XLA's matmul")
        self.onednn = False
        self.onednn_reason: str | None = None

    def build(self) -> tuple[Path, bool]:
        headers = [cpu_build.INCLUDE_DIR / "cpu_kernels.h"]
        # Only failed builds are not cached: without oneDNN, skip the attempt at every start-up.
        if ctypes.util.find_library("dnnl") is None:
            self.onednn_reason = "no oneDNN library (apt-get install libdnnl-dev)"
        else:
            try:
                return cpu_build.build("bf16_matmul_onednn", SOURCE, FLAGS + ONEDNN_FLAGS, ["-ldnnl"],
                                       headers), True
            except RuntimeError as e:
                self.onednn_reason = f"no oneDNN to build against (apt-get install libdnnl-dev): {str(e)[-300:]}"
        return cpu_build.build(self.name, SOURCE, FLAGS, headers=headers), False

    def registered(self, lib: ctypes.CDLL, optional: bool) -> None:
        if optional and not lib.bf16_matmul_onednn_native():
            self.onednn_reason = "this CPU has neither AVX512-BF16 nor AMX (oneDNN would emulate bf16)"
        elif optional:
            jax.ffi.register_ffi_target(ONEDNN_TARGET, jax.ffi.pycapsule(lib.Bf16MatmulOnednn),
                                        platform="cpu")
            self.onednn = True


_LIBRARY = _Library()


def available() -> bool:
    """Whether the few-token kernel is built and registered (the first call builds, once per
    machine, loads and registers it, or records why it cannot)."""
    return _LIBRARY.available()


def onednn_available() -> bool:
    """Whether oneDNN's bf16 matmul is built, registered, and native on this CPU."""
    return _LIBRARY.available() and _LIBRARY.onednn


def unavailable_reason() -> str | None:
    return _LIBRARY.unavailable_reason()


def onednn_unavailable_reason() -> str | None:
    return unavailable_reason() or _LIBRARY.onednn_reason


def why_not(x: jax.Array, weight: jax.Array) -> str | None:
    """Why neither kernel can take these operands (None: the few-token one can)."""
    if jnp.dtype(x.dtype) != jnp.float32:
        return f"activations must be float32, not {jnp.dtype(x.dtype)}"
    if jnp.dtype(weight.dtype) != jnp.bfloat16:
        return f"weights must be bfloat16, not {jnp.dtype(weight.dtype)}"
    if weight.ndim not in (2, 3) or weight.shape[-1] != x.shape[-1]:
        return f"shapes disagree: x {x.shape}, weight {weight.shape}"
    if x.shape[-1] % K_MULTIPLE:
        return f"K={x.shape[-1]} must be a multiple of {K_MULTIPLE}"
    if math.prod(x.shape[:-1]) < 1:
        return "no tokens"
    if not available():
        return unavailable_reason() or "not built"
    return None


def _call(target: str, x: jax.Array, weight: jax.Array, layer: jax.Array) -> jax.Array:
    lead, n = x.shape[:-1], weight.shape[-2]
    x2 = x.reshape(-1, x.shape[-1])
    y = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x2.shape[0], n), jnp.float32),
                         vmap_method="sequential")(x2, weight, layer.astype(jnp.int32))
    return y.reshape(*lead, n)


def bf16_matmul_cpu(x: jax.Array, weight: jax.Array, layer: jax.Array) -> jax.Array:
    """The few-token kernel: x [..., K] f32, weight [(L,) N, K] bf16 -> [..., N] f32."""
    return _call(TARGET, x, weight, layer)


def bf16_matmul_onednn(x: jax.Array, weight: jax.Array, layer: jax.Array) -> jax.Array:
    """oneDNN: x rounded to bf16, float32 accumulation -> [..., N] f32."""
    return _call(ONEDNN_TARGET, x.astype(jnp.bfloat16), weight, layer)
