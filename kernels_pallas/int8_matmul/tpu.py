"""The TPU kernel (Pallas / Mosaic): `x @ dequantize(qweight[layer], scale[layer]).T` reading
the scaled weights (int8, int4 or float8_e4m3fn) at their stored width.

XLA fuses the widening into the dot only with one scale per output channel; with groups of
inputs it writes a bf16 copy of the whole matrix before the dot (several times the stored
bytes a step: docs/benchmarks.md, "Checkpoints stored quantized"). Here each grid step DMAs a
[bn, bk] tile of values and its [bn, bk / group] scales into VMEM and, per group, widens the
values in registers, multiplies them by x's group of inputs on the MXU and adds the product
times the group's scales to a float32 accumulator: the weights cross HBM once, as stored.

The layer of a stacked [L, N, K] weight is a scalar-prefetch argument, so a layer scan hands
the whole stack over without slicing it (XLA would copy the slice).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.int8_matmul.reference import as_stacked

# Each grid step holds whole rows of weights: [bn, K] values (so the scales' block is all of a
# row's groups, [bn, G], which Mosaic tiles as is) and [bm, K] of x; each within TILE_BYTES.
TILE_BYTES = 4 << 20
BLOCK_M = 256
LANES = 128
HALF_LANES = 64  # a group of 64 (the int8 format's) is half a vreg's lanes: Mosaic shifts it
VMEM_LIMIT = 48 << 20  # two buffers of each tile and the accumulator, within every TPU's VMEM


def why_not(x: jax.Array, qweight: jax.Array, scale: jax.Array) -> str | None:
    """Why the kernel cannot take these operands (None: it can)."""
    n, k = qweight.shape[-2:]
    groups = scale.shape[-1]
    if k % groups:
        return f"{groups} groups do not divide K={k}"
    group = k // groups
    if groups > 1 and group % HALF_LANES:
        return f"a group of {group} inputs is not a multiple of {HALF_LANES}"
    if n % LANES or k % LANES:  # else XLA's tiled layout of the stack is copied at each call
        return f"N={n} and K={k} must be multiples of {LANES}"
    if jnp.dtype(qweight.dtype) not in (jnp.dtype(jnp.int8), jnp.dtype(jnp.int4),
                                        jnp.dtype(jnp.float8_e4m3fn)):
        return f"values must be int8, int4 or float8_e4m3fn, not {jnp.dtype(qweight.dtype)}"
    return None


def _block(size: int, most: int, multiple: int) -> int:
    """The largest multiple of `multiple` up to `most` (at least `multiple`) dividing `size`."""
    b = max(multiple, min(most, size) // multiple * multiple)
    while size % b:
        b -= multiple
    return b


def _kernel(layer_ref, x_ref, q_ref, s_ref, o_ref, *, groups: int, scale_rows: bool) -> None:
    """One [bm, bn] block of the output. `scale_rows`: the scales' block is [G, bn] (a group's
    scales are a row, broadcast down the [bm, bn] products); else [bn, G], and the products are
    formed transposed, [bn, bm], so a group's scales broadcast along lanes."""
    del layer_ref  # read by the index maps
    x = x_ref[...]  # [bm, K]
    group = x.shape[-1] // groups
    nt = (((1,), (1,)), ((), ()))  # a @ b.T, the MXU's own form

    def scaled_part(j: int) -> jax.Array:  # group j's products, scaled
        cols = slice(j * group, (j + 1) * group)
        q = q_ref[:, cols].astype(x.dtype)
        if scale_rows:
            part = jax.lax.dot_general(x[:, cols], q, nt, preferred_element_type=jnp.float32)
            return part * s_ref[j:j + 1, :].astype(jnp.float32)
        part = jax.lax.dot_general(q, x[:, cols], nt, preferred_element_type=jnp.float32)
        return part * s_ref[:, j:j + 1].astype(jnp.float32)

    acc = scaled_part(0)
    for j in range(1, groups):
        acc = acc + scaled_part(j)
    o_ref[...] = (acc if scale_rows else acc.T).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("interpret",))
def int8_matmul_tpu(x: jax.Array, qweight: jax.Array, scale: jax.Array, layer: jax.Array,
                    interpret: bool = False) -> jax.Array:
    """x [..., K] @ dequantize(qweight[layer], scale[layer]).T -> [..., N] in x's dtype;
    qweight [(L,) N, K], scale [(L,) N, G] (`why_not` is None for them)."""
    x2, qweight, scale, lead = as_stacked(x, qweight, scale)
    (m, k), (_, n, _), groups = x2.shape, qweight.shape, scale.shape[-1]
    sub = 16 if x.dtype == jnp.bfloat16 else 8
    rows = max(sub, TILE_BYTES // (k * x.dtype.itemsize) // sub * sub)
    bm = min(BLOCK_M, rows, -(-m // sub) * sub)
    m_pad = -(-m // bm) * bm
    if m_pad != m:
        x2 = jnp.pad(x2, ((0, m_pad - m), (0, 0)))
    value_bytes = max(1, jax.dtypes.itemsize_bits(qweight.dtype) // 8)
    bn = _block(n, TILE_BYTES // (k * value_bytes), LANES)
    # XLA's TPU layout makes the dimension of a [.., N, G] scale stack that wastes no padding
    # minor: N (a multiple of 128 here) unless 128 divides G. Seen as [.., G, N] in the first
    # case, the kernel's operand is the same bytes (a bitcast), never a copy before each call.
    scale_rows = groups % LANES != 0
    if scale_rows:
        scale = jnp.swapaxes(scale, -1, -2)
        scale_spec = pl.BlockSpec((None, groups, bn), lambda i, j, l: (l[0], 0, j))
    else:
        scale_spec = pl.BlockSpec((None, bn, groups), lambda i, j, l: (l[0], j, 0))
    out = pl.pallas_call(
        functools.partial(_kernel, groups=groups, scale_rows=scale_rows),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(m_pad // bm, n // bn),
            in_specs=[
                pl.BlockSpec((bm, k), lambda i, j, l: (i, 0)),
                pl.BlockSpec((None, bn, k), lambda i, j, l: (l[0], j, 0)),
                scale_spec,
            ],
            out_specs=pl.BlockSpec((bm, bn), lambda i, j, l: (i, j)),
        ),
        out_shape=jax.ShapeDtypeStruct((m_pad, n), x.dtype),
        # What the grid moves: the weights and scales once per block of tokens, x once per
        # block of channels (XLA's cost analysis takes the call's bytes from here).
        cost_estimate=pl.CostEstimate(
            flops=2 * m_pad * n * k, transcendentals=0,
            bytes_accessed=(m_pad // bm) * (n * k * jax.dtypes.itemsize_bits(qweight.dtype) // 8
                                            + n * groups * scale.dtype.itemsize)
            + (n // bn) * m_pad * k * x.dtype.itemsize + m_pad * n * x.dtype.itemsize),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel"),
                                             vmem_limit_bytes=VMEM_LIMIT),
        interpret=interpret,
    )(jnp.reshape(layer, (1,)).astype(jnp.int32), x2, qweight, scale)
    return out[:m].reshape(*lead, n)
