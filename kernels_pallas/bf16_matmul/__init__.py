"""bf16-weight matrix products: `x @ weight[layer].T` with float32 activations and accumulation.

    weight  bf16 [(L,) N, K]   output channels as rows (PyTorch's layout)
    layer   int32 []           which of L stacked layers (a layer scan passes the whole stack)

Three implementations:

- `reference`: XLA. Widens the weights to x's dtype and calls `dot_general`; on GPU and TPU
  XLA fuses the conversion into the matmul. Exact float32 products of the bf16 weights.
- `cpu` (few tokens): a C++/AVX2 FFI call that reads each bf16 weight once, in place in the
  stack, and widens it in registers. The same numbers as the reference (float32 sums).
- `onednn` (many tokens): oneDNN's bf16 matmul on the CPU's bf16 units (AVX512-BF16 / AMX),
  activations rounded to bf16 at the call, float32 accumulation. Needs oneDNN at build time
  (`cpu.py`) and a CPU with native bf16.

Packed weights: `pack_weights` reorders bf16 weights [..., N, K] once into the blocked layout
oneDNN's matmul reads (flat [..., S]), and `bf16_matmul_packed` multiplies by them for any
number of tokens, with no per-call repacking of the weights (activations rounded to bf16 as
`onednn`): an AVX512-BF16 kernel of ours for few tokens, oneDNN beyond. CPU only, where
`packing_available()`: the layout is oneDNN's and opaque, so no other backend reads it.

`bf16_matmul(..., backend="auto")` picks, on the CPU (through `platform_dependent`, so an
export for cuda/tpu lowers the reference): `cpu` up to CPU_KERNEL_MAX_TOKENS tokens, `onednn`
beyond where it is available, else the reference.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.bf16_matmul import cpu
from kernels_pallas.bf16_matmul.reference import bf16_matmul_reference

# Up to this many tokens the weights' bytes decide and the few-token kernel wins; beyond,
# oneDNN's bf16 arithmetic does (docs/benchmarks.md, "bf16 weights").
CPU_KERNEL_MAX_TOKENS = 16
# On packed weights, up to this many tokens the AVX512-BF16 kernel reading the packed blocks
# beats oneDNN, which forks its threads per call (docs/benchmarks.md, "Packed bf16 weights").
PACKED_FEW_TOKENS = 64

BACKENDS = ("auto", "reference", "cpu", "onednn")

__all__ = ["BACKENDS", "CPU_KERNEL_MAX_TOKENS", "PACKED_FEW_TOKENS", "bf16_matmul", "bf16_matmul_packed",
           "bf16_matmul_reference", "cpu_path", "pack_weights", "packed_elements", "packing_available"]


def packing_available() -> bool:
    """Whether weights can be packed for oneDNN here (its bf16 matmul built and native)."""
    return cpu.onednn_available()


def packed_elements(n: int, k: int) -> int:
    """Elements per [n, k] matrix in the packed layout (padding included); ValueError where
    packing is not available."""
    return cpu.packed_elements(n, k)


def pack_weights(weight: np.ndarray) -> np.ndarray:
    """bf16 weights [..., N, K] (NumPy) -> [..., S] in oneDNN's packed layout."""
    return cpu.pack(weight)


def cpu_path(x: jax.Array, weight: jax.Array) -> str:
    """What `backend="auto"` runs on the CPU for these operands: "cpu", "onednn" or "reference"."""
    if jax.default_backend() != "cpu" or cpu.why_not(x, weight) is not None:
        return "reference"
    if math.prod(x.shape[:-1]) <= CPU_KERNEL_MAX_TOKENS:
        return "cpu"
    return "onednn" if cpu.onednn_available() else "reference"


def bf16_matmul(
    x: jax.Array,
    weight: jax.Array,
    layer: jax.Array | int | None = None,
    *,
    backend: str = "auto",
) -> jax.Array:
    """x [..., K] (float) times layer `layer` of bf16 weights [(L,) N, K] -> [..., N] in x's dtype.

    backend: "auto" (see the module docstring), "reference", "cpu" or "onednn" (raise
    ValueError where they cannot run).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, not {backend!r}")
    if weight.ndim not in (2, 3):
        raise ValueError(f"weight must be [(L,) N, K], got {weight.shape}")
    if (weight.ndim == 3) != (layer is not None):
        raise ValueError("layer is required for stacked [L, N, K] weights, and only for them")
    layer = jnp.zeros((), jnp.int32) if layer is None else jnp.asarray(layer, jnp.int32)

    def reference() -> jax.Array:
        return bf16_matmul_reference(x, weight, layer)

    if backend == "reference":
        return reference()
    if backend in ("cpu", "onednn"):
        why = cpu.why_not(x, weight)
        if why is None and backend == "onednn" and not cpu.onednn_available():
            why = cpu.onednn_unavailable_reason() or "oneDNN not built"
        if why:
            raise ValueError(f"the {backend} bf16 matmul cannot run here: {why}")
        path = backend
    else:
        path = cpu_path(x, weight)
    if path == "reference":
        return reference()
    kernel = cpu.bf16_matmul_cpu if path == "cpu" else cpu.bf16_matmul_onednn
    return jax.lax.platform_dependent(cpu=lambda: kernel(x, weight, layer), default=reference)


def bf16_matmul_packed(x: jax.Array, packed: jax.Array, n: int, layer: jax.Array | int | None = None,
                       few_tokens: int | None = None) -> jax.Array:
    """x [..., K] (float) times layer `layer` of packed weights [(L,) S] (`pack_weights` of
    [(L,) n, K]) -> [..., n] in x's dtype; x rounded to bf16, float32 sums. Up to
    `few_tokens` (default PACKED_FEW_TOKENS) tokens an AVX512-BF16 kernel reads the packed
    blocks where it knows the layout; beyond (and elsewhere), oneDNN."""
    if packed.ndim not in (1, 2):
        raise ValueError(f"packed weights must be [(L,) S], got {packed.shape}")
    if (packed.ndim == 2) != (layer is not None):
        raise ValueError("layer is required for stacked [L, S] weights, and only for them")
    if not packing_available():
        raise ValueError(f"packed bf16 weights need oneDNN here: {cpu.onednn_unavailable_reason()}")
    if packed.shape[-1] != packed_elements(n, x.shape[-1]):
        raise ValueError(f"packed weights of {packed.shape[-1]} elements are not [{n}, {x.shape[-1]}]")
    layer = jnp.zeros((), jnp.int32) if layer is None else jnp.asarray(layer, jnp.int32)
    few = PACKED_FEW_TOKENS if few_tokens is None else few_tokens
    return cpu.bf16_matmul_onednn_packed(x, packed, layer, n, few).astype(x.dtype)
