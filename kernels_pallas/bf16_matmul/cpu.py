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
import functools
import logging
import math
import threading
from pathlib import Path

import jax
import jax.numpy as jnp

from kernels_pallas import cpu_build

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("bf16_matmul_cpu.cc")
TARGET = "kernels_pallas_bf16_matmul_cpu"
ONEDNN_TARGET = "kernels_pallas_bf16_matmul_onednn"
FLAGS = ("-mavx2", "-mfma")
ONEDNN_FLAGS = ("-DKERNELS_PALLAS_ONEDNN",)
# The kernel's vector loop takes 32 inputs at a time.
K_MULTIPLE = 32

_reason: list[str] = []
_onednn_reason: list[str] = []
_LOCK = threading.Lock()


def _build() -> tuple[Path, bool]:
    """The library, and whether it has oneDNN in it."""
    headers = [cpu_build.INCLUDE_DIR / "cpu_kernels.h"]
    # Only failed builds are not cached: without oneDNN, skip the attempt at every start-up.
    if ctypes.util.find_library("dnnl") is None:
        _onednn_reason.append("no oneDNN library (apt-get install libdnnl-dev)")
        return cpu_build.build("bf16_matmul_cpu", SOURCE, FLAGS, headers=headers), False
    try:
        return cpu_build.build("bf16_matmul_onednn", SOURCE, FLAGS + ONEDNN_FLAGS, ["-ldnnl"], headers), True
    except RuntimeError as e:
        _onednn_reason.append(f"no oneDNN to build against (apt-get install libdnnl-dev): {str(e)[-300:]}")
    return cpu_build.build("bf16_matmul_cpu", SOURCE, FLAGS, headers=headers), False


@functools.cache
def _load_once() -> tuple[bool, bool]:
    try:
        path, with_onednn = _build()
        lib = ctypes.CDLL(str(path))
        if not lib.bf16_matmul_cpu_supported():
            raise RuntimeError("this CPU lacks AVX2/FMA")
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.Bf16MatmulCpu), platform="cpu")
    except Exception as e:  # any failure means: use the XLA reference
        _reason.append(str(e))
        logger.warning("CPU bf16 kernel unavailable, using XLA's matmul: %s", e)
        return False, False
    if with_onednn and not lib.bf16_matmul_onednn_native():
        _onednn_reason.append("this CPU has neither AVX512-BF16 nor AMX (oneDNN would emulate bf16)")
        with_onednn = False
    if with_onednn:
        jax.ffi.register_ffi_target(ONEDNN_TARGET, jax.ffi.pycapsule(lib.Bf16MatmulOnednn), platform="cpu")
    return True, with_onednn


def available() -> bool:
    """Whether the few-token kernel is built and registered (the first call builds, once per
    machine, loads and registers it, or records why it cannot)."""
    with _LOCK:  # one build and one registration when several threads trace at once
        return _load_once()[0]


def onednn_available() -> bool:
    """Whether oneDNN's bf16 matmul is built, registered, and native on this CPU."""
    with _LOCK:
        return _load_once()[1]


def unavailable_reason() -> str | None:
    return _reason[0] if _reason else None


def onednn_unavailable_reason() -> str | None:
    return unavailable_reason() or (_onednn_reason[-1] if _onednn_reason else None)


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
