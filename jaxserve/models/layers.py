"""Building blocks of the Llama-family decoder: RMSNorm, SwiGLU (rotary embeddings: rope.py)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxserve.config import WeightFormat
from jaxserve.models.quantization import GROUP_SIZE
from jaxserve.models.quantization import dense as quant_dense


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, as Hugging Face does, then cast back. `offset` 1.0 is
    Gemma's: the weight is stored as w and scales by 1 + w, in float32 before the cast."""

    eps: float
    dtype: jnp.dtype = jnp.float32
    offset: float = 0.0

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        init = nn.initializers.zeros if self.offset else nn.initializers.ones
        scale = self.param("scale", init, (x.shape[-1],), self.dtype)
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.offset:
            return (x32 * (self.offset + scale.astype(jnp.float32))).astype(x.dtype)
        return scale * x32.astype(x.dtype)


class SwiGLU(nn.Module):
    """down(act(gate(x)) * up(x)): SiLU, or GeGLU's tanh-approximated GELU (Gemma)."""

    intermediate_size: int
    hidden_size: int
    dtype: jnp.dtype
    weight_format: WeightFormat = WeightFormat.FLOAT
    num_layers: int | None = None  # inside the layer scan (quantization.Int8Dense)
    cpu_kernel: bool = True
    activation: str = "silu"  # or "gelu_pytorch_tanh"
    group_size: int | None = GROUP_SIZE  # a scaled format's inputs per scale
    act_order: bool = False  # the projections read their inputs permuted (Int8Dense)

    @nn.compact
    def __call__(self, x: jax.Array, layer: jax.Array | None = None) -> jax.Array:
        def dense(n: int, name: str) -> nn.Module:
            return quant_dense(n, False, self.dtype, self.weight_format, name, self.num_layers,
                               self.cpu_kernel, self.group_size, act_order=self.act_order)
        gate = dense(self.intermediate_size, "gate_proj")(x, layer)
        up = dense(self.intermediate_size, "up_proj")(x, layer)
        act = nn.silu(gate) if self.activation == "silu" else jax.nn.gelu(gate, approximate=True)
        return dense(self.hidden_size, "down_proj")(act * up, layer)
