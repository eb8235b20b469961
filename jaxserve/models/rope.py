"""Rotary position embeddings and the rope scalings of long-context checkpoints.

Every type follows transformers' `modeling_rope_utils` (the tests compare with it):

    default    inv_freq_j = theta^(-2j/d)
    linear     inv_freq / factor                                  (positions slowed down)
    llama3     long wavelengths / factor, short kept, a smooth band between
    yarn       NTK-by-parts blend of interpolated and extrapolated frequencies, and cos/sin
               times an attention factor (0.1 ln(factor) + 1 unless given)
    dynamic    NTK: theta grows with the sequence's length L once L > max_position_embeddings
    longrope   inv_freq / short_factor, or / long_factor once L > original_max_position_embeddings,
               cos/sin times sqrt(1 + ln(factor) / ln(original max))

`dynamic` and `longrope` depend on the sequence's length L. transformers recomputes them per
forward from the longest position in it; here each token reads its own sequence's length at
the end of its step (`token_seq_lens`), which is the same thing for one sequence and keeps
sequences of one batch independent. As in transformers, keys already in the cache keep the
rotation they were written with. `partial_rotary_factor` < 1 rotates only the first part of
each head (Phi-4-mini).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models.arch_config import ArchConfig, RopeScaling


def rotary_dim(cfg: ArchConfig) -> int:
    return int(cfg.head_dim * cfg.partial_rotary_factor)


def _base_inv_freq(theta: float, d: int) -> np.ndarray:
    return 1.0 / (theta ** (np.arange(0, d, 2, dtype=np.float64) / d))


def _llama3(inv_freq: np.ndarray, s: RopeScaling) -> np.ndarray:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and the band
    # between is interpolated smoothly.
    orig = s.original_max_position_embeddings
    low_wavelen, high_wavelen = orig / s.low_freq_factor, orig / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (orig / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    scaled = np.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    mid = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
    is_mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return np.where(is_mid, mid, scaled)


def _yarn(theta: float, d: int, s: RopeScaling) -> np.ndarray:
    def correction_dim(rotations: float) -> float:
        return d * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # no singularity
    ramp = np.clip((np.arange(d // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp  # share of the original (not interpolated) frequency
    pos_freqs = theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    return (1 / (s.factor * pos_freqs)) * (1 - extrapolation) + (1 / pos_freqs) * extrapolation


def attention_factor(cfg: ArchConfig) -> float:
    """What cos and sin are multiplied by (yarn, longrope; 1 otherwise)."""
    s = cfg.rope_scaling
    if s is None or s.rope_type not in ("yarn", "longrope"):
        return 1.0
    if s.attention_factor is not None:
        return s.attention_factor
    if s.rope_type == "yarn":
        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
        if s.mscale and s.mscale_all_dim:
            return mscale(s.factor, s.mscale) / mscale(s.factor, s.mscale_all_dim)
        return mscale(s.factor)
    factor = s.factor
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(s.original_max_position_embeddings))


def rope_inv_freq(cfg: ArchConfig, long: bool = False) -> np.ndarray:
    """float32 inverse frequencies [rotary_dim // 2] of the static types (for `dynamic`, those
    of sequences within max_position_embeddings; for `longrope`, the short ones unless
    `long`)."""
    d, theta, s = rotary_dim(cfg), cfg.rope_theta, cfg.rope_scaling
    inv_freq = _base_inv_freq(theta, d)
    if s is None or s.rope_type == "dynamic":
        pass
    elif s.rope_type == "llama3":
        inv_freq = _llama3(inv_freq, s)
    elif s.rope_type == "linear":
        inv_freq = inv_freq / s.factor
    elif s.rope_type == "yarn":
        inv_freq = _yarn(theta, d, s)
    elif s.rope_type == "longrope":
        inv_freq = inv_freq / np.asarray(s.long_factor if long else s.short_factor, np.float64)
    return inv_freq.astype(np.float32)


def needs_seq_lens(cfg: ArchConfig) -> bool:
    """Whether the rotation depends on the sequence's length (dynamic, longrope)."""
    s = cfg.rope_scaling
    return s is not None and s.rope_type in ("dynamic", "longrope")


def token_seq_lens(kv_lens: jax.Array, cu_q_lens: jax.Array, num_tokens: int) -> jax.Array:
    """int32[T]: each token's sequence length at the end of the step (padding: some
    sequence's, never read)."""
    seq = jnp.searchsorted(cu_q_lens[1:], jnp.arange(num_tokens, dtype=cu_q_lens.dtype),
                           side="right")
    return kv_lens[jnp.minimum(seq, kv_lens.shape[0] - 1)]


def _needed(seq_lens: jax.Array | None, rope_type: str) -> jax.Array:
    if seq_lens is None:
        raise ValueError(f"a {rope_type} rope needs seq_lens (token_seq_lens; see needs_seq_lens)")
    return seq_lens


def rope_cos_sin(cfg: ArchConfig, positions: jax.Array, seq_lens: jax.Array | None = None
                 ) -> tuple[jax.Array, jax.Array]:
    """cos, sin [T, rotary_dim // 2] for the positions (`seq_lens`: token_seq_lens, for the
    length-dependent types)."""
    s = cfg.rope_scaling
    # Fenced: on the GPU, XLA fused cos/sin with other consumers of the step's packed inputs
    # into one 33-output loop that spilled registers at 32 tokens (the preflight refuses any
    # spill), and into every layer's rotation, recomputing them per head and layer.
    pos = jax.lax.optimization_barrier(positions).astype(jnp.float32)[:, None]
    if s is not None and s.rope_type == "dynamic":
        d, max_pos = rotary_dim(cfg), cfg.max_position_embeddings
        L = jnp.maximum(_needed(seq_lens, s.rope_type), max_pos).astype(jnp.float32)
        theta = cfg.rope_theta * ((s.factor * L / max_pos) - (s.factor - 1)) ** (d / (d - 2))
        exponent = jnp.arange(0, d, 2, dtype=jnp.float32) / d
        freqs = pos / theta[:, None] ** exponent[None, :]
    elif s is not None and s.rope_type == "longrope":
        long = _needed(seq_lens, s.rope_type)[:, None] > s.original_max_position_embeddings
        inv_freq = jnp.where(long, rope_inv_freq(cfg, long=True)[None, :],
                             rope_inv_freq(cfg)[None, :])
        freqs = pos * inv_freq
    else:
        freqs = pos * jnp.asarray(rope_inv_freq(cfg))[None, :]
    scale = attention_factor(cfg)
    return jax.lax.optimization_barrier((jnp.cos(freqs) * scale, jnp.sin(freqs) * scale))


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate halves (GPT-NeoX / Hugging Face layout) of the first 2 * cos.shape[-1] entries
    of each head: x [T, heads, head_dim]; the rest passes through (partial rotary)."""
    r = 2 * cos.shape[-1]
    rot, rest = x[..., :r].astype(jnp.float32), x[..., r:]
    x1, x2 = jnp.split(rot, 2, axis=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    out = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)
    return out if r == x.shape[-1] else jnp.concatenate([out, rest], axis=-1)
