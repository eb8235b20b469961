"""The GPU kernel (Pallas / Triton): `x @ dequantize(qweight[layer], scale[layer]).T` reading
int8, int4 or float8_e4m3fn values at their stored width.

XLA's GPU pipeline widens a scaled matrix to a bf16 temporary before cuBLAS's GEMM, with one
scale per channel as with groups (1 byte read, 2 written, 2 read again per weight), and for a
layer scan unrolled on the GPU it widens every layer's stack at once: 12.7 GiB of temp for a
Llama-3-8B prefill (docs/benchmarks.md, "Checkpoints stored quantized"). Here each program
takes a [bm tokens, BLOCK_N channels] block of the output, walks K in tiles, widens each tile
of values in registers and accumulates its product with x (times the tile's group scales) in
float32. Programs of the same channels run next to each other (tokens vary fastest), so a
prefill's token blocks share their weight tiles through L2. The layer of a stacked [L, N, K]
weight is read in the kernel, so a layer scan's stack is never sliced (XLA would copy it).

int4 values: Triton has no 4-bit loads, so the kernel reads XLA's packed int4 stack as bytes
(a bitcast: element 2j in the low nibble of byte j, 2j + 1 in the high one), splits each byte
with two arithmetic shifts, and multiplies the low nibbles with x's even inputs and the high
ones with its odd inputs (x split once, outside the kernel).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas.int8_matmul.reference import as_stacked

BLOCK_M = 64  # tokens per program beyond a decode's few (which take one block of 16-64)
BLOCK_N = 64
BLOCK_K = 128
NUM_WARPS = 4
NUM_STAGES = 3
MIN_ROWS = 16  # Triton's dot takes at least 16 rows


def why_not(x: jax.Array, qweight: jax.Array, scale: jax.Array) -> str | None:
    """Why the kernel cannot take these operands (None: it can)."""
    n, k = qweight.shape[-2:]
    groups = scale.shape[-1]
    dtypes = (jnp.dtype(jnp.int8), jnp.dtype(jnp.int4), jnp.dtype(jnp.float8_e4m3fn))
    if jnp.dtype(qweight.dtype) not in dtypes:
        return f"values must be int8, int4 or float8_e4m3fn, not {jnp.dtype(qweight.dtype)}"
    if n % BLOCK_N:
        return f"N={n} must be a multiple of {BLOCK_N}"
    per_row = MIN_ROWS * (2 if jnp.dtype(qweight.dtype) == jnp.dtype(jnp.int4) else 1)
    if k % groups or (k // groups) % per_row:
        return f"a group of K={k} // {groups} inputs is not a multiple of {per_row}"
    return None


def _block_k(k: int, group: int) -> int:
    """The K tile: the largest power of two up to BLOCK_K dividing the group (K per channel)."""
    b = BLOCK_K
    while group % b:
        b //= 2
    return b


def _kernel(layer_ref, *refs, group: int | None, block_k: int, bm: int, int4: bool) -> None:
    if int4:  # x's even and odd inputs, the values as bytes [L, N, K / 2]
        xe_ref, xo_ref, q_ref, s_ref, o_ref = refs
    else:
        x_ref, q_ref, s_ref, o_ref = refs
    tokens = pl.ds(pl.program_id(0) * bm, bm)
    rows = pl.ds(pl.program_id(1) * BLOCK_N, BLOCK_N)
    layer = layer_ref[0]
    k = q_ref.shape[-1] * (2 if int4 else 1)

    def body(i, acc):
        if int4:  # a tile of block_k inputs is block_k / 2 bytes: low nibble even, high odd
            cols = pl.ds(i * block_k // 2, block_k // 2)
            b = q_ref[layer, rows, cols]
            lo, hi = jnp.left_shift(b, 4) >> 4, b >> 4  # arithmetic: the signed nibbles
            part = (plgpu.dot(lo.astype(xe_ref.dtype), xe_ref[tokens, cols], trans_b=True)
                    + plgpu.dot(hi.astype(xo_ref.dtype), xo_ref[tokens, cols], trans_b=True))
        else:
            cols = pl.ds(i * block_k, block_k)
            w = q_ref[layer, rows, cols].astype(x_ref.dtype)  # [BLOCK_N, block_k], widened here
            part = plgpu.dot(w, x_ref[tokens, cols], trans_b=True)  # [BLOCK_N, bm] float32
        if group is not None:  # a tile lies within one group
            part = part * s_ref[layer, rows, pl.ds(i * block_k // group, 1)].astype(jnp.float32)
        return acc + part

    acc = lax.fori_loop(0, k // block_k, body, jnp.zeros((BLOCK_N, bm), jnp.float32))
    if group is None:  # one scale per channel: once, after the sum
        acc = acc * s_ref[layer, rows, pl.ds(0, 1)].astype(jnp.float32)
    o_ref[tokens, rows] = acc.T.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("interpret",))
def int8_matmul_gpu(x: jax.Array, qweight: jax.Array, scale: jax.Array, layer: jax.Array,
                    interpret: bool = False) -> jax.Array:
    """x [..., K] @ dequantize(qweight[layer], scale[layer]).T -> [..., N] in x's dtype;
    qweight [(L,) N, K], scale [(L,) N, G] (`why_not` is None for them)."""
    x2, qweight, scale, lead = as_stacked(x, qweight, scale)
    (m, k), (_, n, _), groups = x2.shape, qweight.shape, scale.shape[-1]
    bm = min(BLOCK_M, max(MIN_ROWS, 1 << (m - 1).bit_length()))
    m_pad = -(-m // bm) * bm
    x2 = jnp.pad(x2, ((0, m_pad - m), (0, 0)))
    int4 = jnp.dtype(qweight.dtype) == jnp.dtype(jnp.int4)
    value_bytes = jax.dtypes.itemsize_bits(qweight.dtype) / 8
    group = k // groups if groups > 1 else None
    values: tuple[jax.Array, ...]
    xs: tuple[jax.Array, ...]
    if int4:  # bytes of two values each (a bitcast of XLA's packed int4), x's even and odd inputs
        values = (lax.bitcast_convert_type(qweight.reshape(*qweight.shape[:-1], k // 2, 2), jnp.int8),)
        xs = (x2[:, 0::2], x2[:, 1::2])
    else:
        values, xs = (qweight,), (x2,)
    out = pl.pallas_call(
        functools.partial(_kernel, group=group, block_k=_block_k(k, group or k), bm=bm, int4=int4),
        grid=(m_pad // bm, n // BLOCK_N),
        out_shape=jax.ShapeDtypeStruct((m_pad, n), x.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES),
        interpret=interpret,
        cost_estimate=pl.CostEstimate(
            flops=2 * m_pad * n * k, transcendentals=0,
            bytes_accessed=int(n * k * value_bytes) + n * groups * scale.dtype.itemsize  # once: L2
            + (n // BLOCK_N) * m_pad * k * x.dtype.itemsize + m_pad * n * x.dtype.itemsize),
        name="int8_matmul_gpu",
    )(jnp.reshape(layer, (1,)).astype(jnp.int32), *xs, *values, scale)
    return out[:m].reshape(*lead, n)
