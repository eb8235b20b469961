"""Scaled-weight matrix products: `x @ dequantize(qweight[layer], scale[layer]).T`.

    qweight  int8 [(L,) N, K]   symmetric int8 rows (output channels), K inputs each; on the
                                TPU kernel and the reference also int4 or float8_e4m3fn
    scale    f32  [(L,) N, G]   one scale per output channel and group of K // G inputs
    layer    int32 []           which of L stacked layers (a layer scan passes the whole stack)

Three implementations, the same numbers up to rounding (float32 accumulation):

- `reference`: XLA. Dequantizes to x's dtype and calls `dot_general`; on GPU and TPU XLA
  fuses the conversion into the matmul with one scale per channel, but writes the widened
  matrix first with groups. Used for many tokens (prefill) on the CPU, and on the GPU.
- `tpu`: a Pallas kernel (`tpu.py`) reading values and scales at their stored width, the
  scales applied per group to float32 partial products.
- `gpu`: a Pallas/Triton kernel (`gpu.py`), int8 and fp8 values widened in registers
  (XLA's GPU path writes a bf16 copy first, per channel too).
- `cpu`: an XLA FFI custom call in C++/AVX2 (`int8_matmul_cpu.cc`), built with the system's
  g++ on first use (`cpu.py`). For decode-sized token counts on the CPU, where XLA writes the
  dequantized weights to a float temporary and copies a stacked layer's slice: it reads each
  int8 weight once and converts it in registers.

`int8_matmul(..., backend="auto")` picks per platform through `platform_dependent` (so the
program lowered for a TPU from a CPU process, as the preflight does, gets the TPU's): `cpu`
when `cpu_kernel_applies` (XLA's default backend is the CPU, the kernel built, and at most
CPU_KERNEL_MAX_TOKENS float32 tokens), `tpu` / `gpu` when their `why_not` is None, else the
reference.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from kernels_pallas.int8_matmul import cpu, gpu, tpu
from kernels_pallas.int8_matmul.reference import dequantize, int8_matmul_reference

# Up to this many tokens a step the CPU kernel beats XLA's matmul on the dequantized weights
# in the whole decode step; beyond, XLA has amortised the conversion (docs/benchmarks.md,
# "Figures the code's comments used to hold").
CPU_KERNEL_MAX_TOKENS = 32

__all__ = ["CPU_KERNEL_MAX_TOKENS", "cpu_kernel_applies", "dequantize", "int8_matmul",
           "int8_matmul_reference"]


def cpu_kernel_applies(x: jax.Array, qweight: jax.Array, scale: jax.Array) -> bool:
    """Whether `backend="auto"` runs the CPU kernel for these operands."""
    return (jax.default_backend() == "cpu" and math.prod(x.shape[:-1]) <= CPU_KERNEL_MAX_TOKENS
            and cpu.supports(x, qweight, scale))


def int8_matmul(
    x: jax.Array,
    qweight: jax.Array,
    scale: jax.Array,
    layer: jax.Array | int | None = None,
    *,
    backend: str = "auto",
) -> jax.Array:
    """x [..., K] (float) times layer `layer` of int8 weights -> [..., N] in x's dtype.

    backend: "auto" (the platform's kernel where it applies, else the reference),
    "reference", or "cpu" (the kernel; raises ValueError where it cannot run).
    """
    if backend not in ("auto", "reference", "cpu"):
        raise ValueError(f"backend must be auto, reference or cpu, not {backend!r}")
    if qweight.ndim not in (2, 3) or scale.ndim != qweight.ndim:
        raise ValueError(f"qweight [(L,) N, K] and scale [(L,) N, G], got {qweight.shape} and {scale.shape}")
    if (qweight.ndim == 3) != (layer is not None):
        raise ValueError("layer is required for stacked [L, N, K] weights, and only for them")
    layer = jnp.zeros((), jnp.int32) if layer is None else jnp.asarray(layer, jnp.int32)

    def reference() -> jax.Array:
        return int8_matmul_reference(x, qweight, scale, layer)

    if backend == "reference":
        return reference()
    if backend == "cpu":
        why = cpu.why_not(x, qweight, scale)
        if why:
            raise ValueError(f"the CPU int8 kernel cannot run here: {why}")
        return cpu.int8_matmul_cpu(x, qweight, scale, layer)
    def on_cpu() -> jax.Array:
        if not cpu_kernel_applies(x, qweight, scale):
            return reference()
        return cpu.int8_matmul_cpu(x, qweight, scale, layer)

    def on_tpu() -> jax.Array:
        if tpu.why_not(x, qweight, scale) is not None:
            return reference()
        return tpu.int8_matmul_tpu(x, qweight, scale, layer)

    def on_gpu() -> jax.Array:
        if gpu.why_not(x, qweight, scale) is not None:
            return reference()
        return gpu.int8_matmul_gpu(x, qweight, scale, layer)

    return jax.lax.platform_dependent(cpu=on_cpu, tpu=on_tpu, cuda=on_gpu, default=reference)
