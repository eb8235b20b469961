"""Build, load and call the C++ CPU bf16 matmuls (`bf16_matmul_cpu.cc`, XLA FFI handlers).

Built on first use by `kernels_pallas.cpu_build`: with oneDNN 3 from the package index
(`onednn-cpu-gomp` and its headers `onednn-devel-cpu-gomp`, jaxserve's dependencies on x86-64
Linux; `onednn_paths`) when they are installed, else without, and then only the few-token
kernel exists. `available()` / `onednn_available()` say what loaded, and why not
(`unavailable_reason()`, `onednn_unavailable_reason()`); callers use the XLA reference for
what is missing. With oneDNN: `pack` reorders weights into its blocked layout at load, and
`bf16_matmul_onednn_packed` multiplies by them (the AVX512-BF16 few-token kernel, or oneDNN).
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import math
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import cpu_build

SOURCE = Path(__file__).with_name("bf16_matmul_cpu.cc")
TARGET = "kernels_pallas_bf16_matmul_cpu"
ONEDNN_TARGET = "kernels_pallas_bf16_matmul_onednn"
ONEDNN_PACKED_TARGET = "kernels_pallas_bf16_matmul_onednn_packed"
FLAGS = ("-mavx2", "-mfma")
ONEDNN_FLAGS = ("-DKERNELS_PALLAS_ONEDNN",)
# oneDNN's CPU-only build with GNU OpenMP: its library and its headers, as pyproject.toml pins
# them. (The index's `onednn` package is the SYCL build: 600 MB of GPU runtimes with it.)
ONEDNN_LIBRARY = ("onednn-cpu-gomp", "libdnnl.so.3")
ONEDNN_HEADERS = ("onednn-devel-cpu-gomp", "oneapi/dnnl/dnnl.hpp")
ONEDNN_INSTALL = "pip install onednn-cpu-gomp onednn-devel-cpu-gomp"
# The kernel's vector loop takes 32 inputs at a time.
K_MULTIPLE = 32


def quiet_openmp_threads() -> None:
    """Let oneDNN's OpenMP threads sleep as soon as a matmul ends, unless the user chose
    (GOMP_SPINCOUNT / OMP_WAIT_POLICY). GNU OpenMP's threads otherwise spin for a while
    after each parallel region, and on a CPU with few cores that spinning takes the cores
    from XLA's threads, which run the rest of the step between two matmuls (measured:
    docs/benchmarks.md, "Packed bf16 weights"). libgomp reads this when it loads, which is
    with oneDNN, just after this."""
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", "0")


def _installed_file(dist: str, suffix: str) -> Path:
    try:
        found = importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError(f"no oneDNN: {dist} is not installed ({ONEDNN_INSTALL})") from None
    for f in found.files or []:
        if str(f).endswith(suffix):
            return Path(str(found.locate_file(f))).resolve()  # str(): typed a SimplePath, not PathLike
    raise RuntimeError(f"no oneDNN: {dist} has no {suffix} ({ONEDNN_INSTALL})")


def onednn_paths() -> tuple[Path, Path]:
    """oneDNN's include and library directories, from the installed packages (raises
    RuntimeError saying what to install)."""
    header = _installed_file(*ONEDNN_HEADERS)
    library = _installed_file(*ONEDNN_LIBRARY)
    return header.parents[2], library.parent


class _Library(cpu_build.FfiLibrary):
    """The kernel library, with oneDNN's matmul in it when the build finds oneDNN."""

    def __init__(self) -> None:
        super().__init__("bf16_matmul_cpu", SOURCE, FLAGS, {TARGET: "Bf16MatmulCpu"},
                         supported="bf16_matmul_cpu_supported", what="bf16 kernel",
                         fallback="using XLA's matmul")
        self.onednn = False
        self.onednn_reason: str | None = None
        self.lib: ctypes.CDLL | None = None  # linked with oneDNN (native or not): its C functions
        self.onednn_description: str | None = None  # "oneDNN 3.2.0 on avx2"

    def build(self) -> tuple[Path, bool]:
        headers = [cpu_build.INCLUDE_DIR / "cpu_kernels.h"]
        # Only failed builds are not cached: without oneDNN, skip the attempt at every start-up.
        try:
            include, lib = onednn_paths()
            # Its version header in the cache key: an upgraded oneDNN rebuilds; rpath: the
            # library is found where pip put it, with no LD_LIBRARY_PATH.
            # Its headers as system headers: their own warnings are not ours.
            path = cpu_build.build("bf16_matmul_onednn", SOURCE, (*FLAGS, *ONEDNN_FLAGS, "-isystem", str(include)),
                                   [f"-L{lib}", f"-l:{ONEDNN_LIBRARY[1]}", f"-Wl,-rpath,{lib}"],
                                   [*headers, include / "oneapi" / "dnnl" / "dnnl_version.h"])
            quiet_openmp_threads()
            return path, True
        except RuntimeError as e:
            self.onednn_reason = str(e)[-400:]
        return cpu_build.build(self.name, SOURCE, FLAGS, headers=headers), False

    def registered(self, lib: ctypes.CDLL, optional: bool) -> None:
        if not optional:
            return
        # Registered wherever oneDNN is linked; callers use them only where bf16 is native.
        for target, handler in ((ONEDNN_TARGET, lib.Bf16MatmulOnednn),
                                (ONEDNN_PACKED_TARGET, lib.Bf16MatmulOnednnPacked)):
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(handler), platform="cpu")
        lib.bf16_matmul_onednn_describe.argtypes = [ctypes.c_char_p, ctypes.c_int64]
        lib.bf16_matmul_onednn_packed_elements.restype = ctypes.c_int64
        lib.bf16_matmul_onednn_packed_elements.argtypes = [ctypes.c_int64, ctypes.c_int64]
        lib.bf16_matmul_onednn_pack.argtypes = [ctypes.c_void_p, ctypes.c_void_p,
                                                ctypes.c_int64, ctypes.c_int64]
        lib.bf16_matmul_packed_few_token_kernel.argtypes = [ctypes.c_int64, ctypes.c_int64]
        lib.bf16_matmul_avx512_bf16.argtypes = []
        lib.bf16_matmul_onednn_impl.argtypes = [ctypes.c_int64] * 3 + [ctypes.c_char_p, ctypes.c_int64]
        buf = ctypes.create_string_buffer(128)
        lib.bf16_matmul_onednn_describe(buf, len(buf))
        self.onednn_description = buf.value.decode()
        self.lib = lib
        self.onednn = bool(lib.bf16_matmul_onednn_native())
        if not self.onednn:
            self.onednn_reason = (f"{self.onednn_description}: this CPU has neither AVX512-BF16 nor AMX "
                                  "(oneDNN would emulate bf16)")


_LIBRARY = _Library()


def available() -> bool:
    """Whether the few-token kernel is built and registered (the first call builds, once per
    machine, loads and registers it, or records why it cannot)."""
    return _LIBRARY.available()


def onednn_available() -> bool:
    """Whether oneDNN's bf16 matmul is built, registered, and native on this CPU."""
    return _LIBRARY.available() and _LIBRARY.onednn


def onednn_linked() -> bool:
    """Whether the library was built with oneDNN, whether or not its bf16 is native here."""
    return _LIBRARY.available() and _LIBRARY.lib is not None


def onednn_description() -> str | None:
    """"oneDNN 3.2.0 on avx512_core_amx": the version linked and the instruction set its
    kernels use here (None: not linked)."""
    return _LIBRARY.onednn_description if onednn_linked() else None


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


def _onednn_lib() -> ctypes.CDLL:
    """The library's C functions where oneDNN's bf16 is native (elsewhere a forced oneDNN
    path is a ValueError: without bf16 units oneDNN 3 has no bf16 matmul, or emulates it)."""
    if not onednn_available() or _LIBRARY.lib is None:
        raise ValueError(f"oneDNN's bf16 matmul is not available: {onednn_unavailable_reason()}")
    return _LIBRARY.lib


def packed_elements(n: int, k: int) -> int:
    """Elements of one [n, k] weight matrix in oneDNN's packed layout (padding included)."""
    size = _onednn_lib().bf16_matmul_onednn_packed_elements(k, n)
    if size < 0:
        raise ValueError(f"oneDNN has no packed layout for a [{n}, {k}] bf16 matrix")
    return int(size)


def pack(weight: np.ndarray) -> np.ndarray:
    """bf16 weights [..., N, K] -> [..., S] in oneDNN's packed layout, one matrix at a time
    (host NumPy, at load)."""
    lib = _onednn_lib()
    w = np.ascontiguousarray(weight)
    if w.dtype != jnp.bfloat16 or w.ndim < 2:
        raise ValueError(f"pack takes bf16 weights [..., N, K], not {w.dtype} {w.shape}")
    n, k = w.shape[-2:]
    mats = w.reshape(-1, n, k)
    out = np.empty((mats.shape[0], packed_elements(n, k)), jnp.bfloat16)
    for i in range(mats.shape[0]):
        if lib.bf16_matmul_onednn_pack(mats[i].ctypes.data, out[i].ctypes.data, k, n) != 0:
            raise RuntimeError(f"oneDNN could not pack a [{n}, {k}] bf16 matrix")
    return out.reshape(*w.shape[:-2], out.shape[-1])


def packed_impl(m: int, n: int, k: int) -> str:
    """The oneDNN implementation that runs `m` rows on packed [n, k] weights (e.g.
    "brg:avx512_core_bf16"; a "ref" one would be slow)."""
    buf = ctypes.create_string_buffer(128)
    if _onednn_lib().bf16_matmul_onednn_impl(m, k, n, buf, len(buf)) != 0:
        raise RuntimeError(f"oneDNN has no matmul for {m} rows of packed [{n}, {k}] weights")
    return buf.value.decode()


def few_token_kernel(n: int, k: int) -> bool:
    """Whether the few-token kernel (AVX512-BF16) reads the packed layout of [n, k] weights
    here; where not, every token count runs oneDNN."""
    return bool(_onednn_lib().bf16_matmul_packed_few_token_kernel(k, n))


def avx512_bf16() -> bool:
    """Whether this CPU has AVX512-BF16 (what the few-token kernel on packed weights needs)."""
    return bool(_onednn_lib().bf16_matmul_avx512_bf16())


def bf16_matmul_onednn_packed(x: jax.Array, packed: jax.Array, layer: jax.Array, n: int,
                              few_tokens: int) -> jax.Array:
    """Packed weights [(L,) S] (`pack`) times x [..., K] (rounded to bf16 in the call) ->
    [..., n] f32, float32 sums: up to `few_tokens` rows the few-token kernel where it reads
    the layout, else oneDNN."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    y = jax.ffi.ffi_call(ONEDNN_PACKED_TARGET, jax.ShapeDtypeStruct((x2.shape[0], n), jnp.float32),
                         vmap_method="sequential")(x2, packed, layer.astype(jnp.int32),
                                                   few_tokens=np.int64(few_tokens))
    return y.reshape(*lead, n)
