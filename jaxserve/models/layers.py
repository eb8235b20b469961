"""Building blocks of the Llama-family decoder: RMSNorm, SwiGLU (rotary embeddings: rope.py)."""

from __future__ import annotations


import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxserve.models.quantization import dense as quant_dense


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, as Hugging Face does, then cast back."""

    eps: float
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.dtype)
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return scale * x32.astype(x.dtype)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    intermediate_size: int
    hidden_size: int
    dtype: jnp.dtype
    quantization: str | None = None
    num_layers: int | None = None  # inside the layer scan (quantization.Int8Dense)
    cpu_kernel: bool = True

    @nn.compact
    def __call__(self, x: jax.Array, layer: jax.Array | None = None) -> jax.Array:
        def dense(n: int, name: str) -> nn.Module:
            return quant_dense(n, False, self.dtype, self.quantization, name, self.num_layers,
                               self.cpu_kernel)
        gate = dense(self.intermediate_size, "gate_proj")(x, layer)
        up = dense(self.intermediate_size, "up_proj")(x, layer)
        return dense(self.hidden_size, "down_proj")(nn.silu(gate) * up, layer)
