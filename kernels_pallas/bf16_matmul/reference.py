"""The XLA bf16-weight matmul: widen the weights to x's dtype, then `dot_general` (what the
CPU kernels must equal)."""

from __future__ import annotations

import jax


def bf16_matmul_reference(x: jax.Array, weight: jax.Array, layer: jax.Array) -> jax.Array:
    """x [..., K] @ weight[layer].T (weight [(L,) N, K] bf16) -> [..., N] in x's dtype."""
    if weight.ndim == 3:
        weight = jax.lax.dynamic_index_in_dim(weight, layer, keepdims=False)
    return jax.lax.dot_general(x, weight.astype(x.dtype), (((x.ndim - 1,), (1,)), ((), ())))
