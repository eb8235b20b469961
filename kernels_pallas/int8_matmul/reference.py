"""The XLA int8 matmul: dequantize, then `dot_general` (what the CPU kernel must equal)."""

from __future__ import annotations

from typing import Any

import jax


def dequantize(qweight: Any, scale: Any) -> Any:
    """qweight [..., N, K] int8, scale [..., N, G] -> [..., N, K] in scale's dtype (JAX or NumPy)."""
    groups = scale.shape[-1]
    *lead, k = qweight.shape
    w = qweight.astype(scale.dtype).reshape(*lead, groups, k // groups) * scale[..., None]
    return w.reshape(*lead, k)


def as_stacked(x: Any, qweight: Any, scale: Any) -> tuple[Any, Any, Any, tuple[int, ...]]:
    """The kernels' operands: x as [M, K] rows, qweight [L, N, K] and scale [L, N, G] (a single
    matrix as a stack of one), and x's leading shape to give the result back."""
    if qweight.ndim == 2:
        qweight, scale = qweight[None], scale[None]
    return x.reshape(-1, x.shape[-1]), qweight, scale, x.shape[:-1]


def int8_matmul_reference(
    x: jax.Array, qweight: jax.Array, scale: jax.Array, layer: jax.Array
) -> jax.Array:
    """x [..., K] @ dequantize(qweight[layer], scale[layer]).T -> [..., N] in x's dtype."""
    if qweight.ndim == 3:
        qweight = jax.lax.dynamic_index_in_dim(qweight, layer, keepdims=False)
        scale = jax.lax.dynamic_index_in_dim(scale, layer, keepdims=False)
    w = dequantize(qweight, scale.astype(x.dtype))
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())))
