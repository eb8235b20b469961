"""Building blocks of the Llama-family decoder: RMSNorm, rotary embeddings, SwiGLU."""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models.arch_config import ArchConfig
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


def rope_inv_freq(cfg: ArchConfig) -> np.ndarray:
    """Inverse frequencies [head_dim // 2], with Llama-3 scaling when configured."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    s = cfg.rope_scaling
    if s is None:
        return inv_freq.astype(np.float32)
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and
    # the band between is interpolated smoothly.
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    scaled = np.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    mid = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
    is_mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return np.where(is_mid, mid, scaled).astype(np.float32)


def rope_cos_sin(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """cos, sin of [num_tokens, head_dim // 2] for the given positions."""
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    return jnp.cos(freqs), jnp.sin(freqs)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate halves (GPT-NeoX / Hugging Face layout): x [T, heads, head_dim]."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


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
