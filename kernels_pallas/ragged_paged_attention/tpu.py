"""Ragged paged attention for TPUs: a Pallas kernel with Mosaic lowering, over the packed cache.

The cache is the packed layout of `kernels_pallas/kv_cache.py`: each token's keys and values
as rows of L int32 lanes ("slots"), p slots of b-bit values per word. Every load the
kernel does is 32-bit and lane-aligned, so it compiles for float32, bfloat16 and fp8 caches on
every TPU generation (Mosaic has no strided load of sub-32-bit data), and the values are
unpacked with 32-bit integer arithmetic (no 16- or 8-bit vector ops, which v5e lacks).

Grid: one program per aligned block of `block_q` query tokens ("q block"). A q block may hold
the tail of one sequence, whole decode sequences and the head of another; the program walks
the (sequence, kv block) pairs that touch it in one loop, fetching each kv block's pages from
HBM with manual DMAs into a double buffer while the previous block is computed::

    tokens      | s0 s0 s0 | s1 | s2 | s3 s3 s3 s3 s3 ...
    q blocks    |   q block 0    |  q block 1  ...          (block_q = 4 here)
    program 0:  (s0,kv0) (s0,kv1) (s1,kv0) ... (s3,kv0) (s3,kv1)   <- one loop, and the
                 fetch of pair n+1 overlaps the compute of pair n

Scalars (page table, kv_lens, cu_q_lens, num_seqs, each q block's first sequence) are scalar-
prefetched into SMEM. No ref is ever reshaped or bitcast (the TPU interpreter of jax 0.10.2
supports neither, and interpret mode is how the CPU checks this kernel):

    kv_hbm  [num_pages, page_size, R * L] int32   the cache as stored
    kv_buf  [2, pages_per_block * page_size, R * L]  VMEM double buffer of whole pages
    q, out  [kvh, num_q_blocks * block_q * group, Lq]  q re-laid out in XLA so that head h's
                                                   block is a 2-D [block_q * group, Lq] tile
                                                   (rows t0g0 t0g1 .. t1g0 ..): GQA shares
                                                   one K/V load across the whole group.

Head dims that are a multiple of 128: keys and values have slots of their own (Lq = D).
Otherwise (e.g. 64) a slot is [k | v | pad]: q is zero-padded to its L lanes, so q . slot =
q . k, and p @ slot holds p @ v in lanes D..2D, which XLA slices out after the kernel (the MXU
does twice the work of an exact fit; the cache holds no padding for D = 64).

Each row belongs to exactly one sequence, so the float32 running max / sum / accumulator live
in VMEM scratch for the whole q block and each (seq, kv block) step updates only its rows.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.kv_cache import KVCacheLayout
from kernels_pallas.ragged_paged_attention.reference import no_sinks, sink_denominator
from kernels_pallas.registry import AttentionSpec, VariantPlan, jit_kernel, register_backend

# (exponent bits, mantissa bits, bias) of the sub-32-bit value types, decoded in int32.
_FLOAT_FORMATS = {"float16": (5, 10, 15), "fp8_e4m3": (4, 3, 7), "fp8_e5m2": (5, 2, 15)}


def _div(a, b: int):
    """Integer division of non-negative values. `//` lowers through `sign`, which Mosaic
    lowering rejects off-TPU (it asks the device for its generation), so use lax.div."""
    return lax.div(a, jnp.full_like(a, b))


def _cdiv(a, b: int):
    return _div(a + (b - 1), b)


def _as_f32(bits):
    return lax.bitcast_convert_type(bits, jnp.float32)


def decode_values(words: jax.Array, index: int, layout: KVCacheLayout) -> jax.Array:
    """Value `index` of each int32 word (bits index*b..) as float32, with 32-bit ops only."""
    b = layout.bits
    if b == 32:
        return _as_f32(words)
    if layout.dtype == "bfloat16":  # a bf16 is the top half of the float32 it rounds from
        return _as_f32(words << 16) if index == 0 else _as_f32(words & jnp.int32(-65536))
    ebits, mbits, bias = _FLOAT_FORMATS[layout.dtype]
    x = (words >> (index * b)) & ((1 << b) - 1)
    e = (x >> mbits) & ((1 << ebits) - 1)
    m = x & ((1 << mbits) - 1)
    normal = e > 0
    # value = (2^mbits * [normal] + m) * 2^(max(e, 1) - bias - mbits); the power of two is
    # built as float32 bits (its exponent stays in range for every format here).
    mag = (m + jnp.where(normal, 1 << mbits, 0)).astype(jnp.float32)
    scale = _as_f32((jnp.maximum(e, 1) + (127 - bias - mbits)) << 23)
    val = mag * scale
    return jnp.where((x >> (b - 1)) != 0, -val, val)  # NaN/inf codes: garbage, masked anyway


def _kernel(
    # scalar prefetch (SMEM)
    kv_lens_ref,  # int32[max_num_seqs]
    page_indices_ref,  # int32[max_num_seqs * pages_per_seq]   (flattened: SMEM pads 2-D)
    cu_q_lens_ref,  # int32[max_num_seqs + 1]                 (sorted past num_seqs)
    num_seqs_ref,  # int32[1]
    first_seq_ref,  # int32[num_q_blocks]: first sequence with tokens in each q block
    # inputs
    q_ref,  # VMEM [kvh, rows, Lq], rows = block_q * group
    kv_hbm,  # HBM  [num_pages, page_size, R * L] int32
    sinks_ref,  # VMEM f32 [kvh, rows, Lq]: each row's head's sink (along lanes), or None
    # output
    o_ref,  # VMEM [kvh, rows, Lq]
    # scratch
    kv_buf,  # VMEM [2, pages_per_block * page_size, R * L] int32
    sems,  # DMA semaphores [2], one per buffer
    m_ref, l_ref, acc_ref,  # VMEM f32 [kvh, rows, Lq] (m, l replicated along lanes)
    *, layout: KVCacheLayout, sm_scale: float, block_q: int, group: int, page_size: int,
    pages_per_block: int, pages_per_seq: int, sliding_window: int | None,
    soft_cap: float | None, mask_value: float, v_scale: float | None,
):
    num_kv_heads, rows, q_lanes = q_ref.shape
    L = layout.slot_lanes
    block_k = pages_per_block * page_size
    blk_start = pl.program_id(0) * block_q
    blk_end = blk_start + block_q
    num_seqs = num_seqs_ref[0]

    def seq_bounds(seq):
        """(first kv block, number of kv blocks) that `seq` needs for this q block."""
        q_start, q_end, kv_len = cu_q_lens_ref[seq], cu_q_lens_ref[seq + 1], kv_lens_ref[seq]
        # Causal skip: keys up to the last of this seq's tokens that fall in the block.
        num_keys = kv_len - (q_end - jnp.minimum(q_end, blk_end))
        end = jnp.maximum(_cdiv(num_keys, block_k), 1)  # >= 1 keeps the pair walk simple
        if sliding_window is None:
            return 0, end
        first_pos = jnp.maximum(q_start, blk_start) - q_end + kv_len
        start = _div(jnp.maximum(first_pos - sliding_window + 1, 0), block_k)
        return jnp.minimum(start, end - 1), end

    def in_block(seq):
        return (seq < num_seqs) & (cu_q_lens_ref[jnp.minimum(seq, num_seqs)] < blk_end)

    def next_pair(seq, kv_blk):
        _, end = seq_bounds(seq)
        last = kv_blk + 1 >= end
        nseq = jnp.where(last, seq + 1, seq)
        nstart, _ = seq_bounds(jnp.minimum(nseq, num_seqs - 1))
        return nseq, jnp.where(last, nstart, kv_blk + 1)

    def page_copies(seq, kv_blk, buf):
        """The DMAs of one kv block; pages past the sequence's end read the null page 0."""
        used = _cdiv(kv_lens_ref[seq], page_size)
        copies = []
        for i in range(pages_per_block):
            p = kv_blk * pages_per_block + i
            page = page_indices_ref[seq * pages_per_seq + jnp.minimum(p, pages_per_seq - 1)]
            page = jnp.where(p < used, page, 0)
            copies.append(pltpu.make_async_copy(
                kv_hbm.at[page], kv_buf.at[buf, pl.ds(i * page_size, page_size)], sems.at[buf]))
        return copies

    m_ref[...] = jnp.full(m_ref.shape, mask_value, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def attend_head(h, k, v, visible, mine):
        """Fold one kv head's block (k, v: [block_k, L] in q's dtype, zero outside the context)."""
        s = lax.dot_general(q_ref[h], k, (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32) * sm_scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        s = jnp.where(visible, s, mask_value)
        m_prev, l_prev, acc_prev = m_ref[h], l_ref[h], acc_ref[h]
        m_cur = s.max(axis=1, keepdims=True)  # [rows, 1]
        p = jnp.exp(s - m_cur)
        m_next = jnp.maximum(m_prev, m_cur)  # [rows, Lq]
        alpha, beta = jnp.exp(m_prev - m_next), jnp.exp(m_cur - m_next)
        pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        m_ref[h] = jnp.where(mine, m_next, m_prev)
        l_ref[h] = jnp.where(mine, alpha * l_prev + beta * p.sum(axis=1, keepdims=True), l_prev)
        acc_ref[h] = jnp.where(mine, alpha * acc_prev + beta * pv, acc_prev)

    def attend(seq: jax.Array, kv_blk: jax.Array, buf: jax.Array) -> None:
        q_start, q_end, kv_len = cu_q_lens_ref[seq], cu_q_lens_ref[seq + 1], kv_lens_ref[seq]
        t = blk_start + _div(lax.broadcasted_iota(jnp.int32, (rows, block_k), 0), group)
        kpos = kv_blk * block_k + lax.broadcasted_iota(jnp.int32, (rows, block_k), 1)
        pos = t - q_end + kv_len
        visible = (t >= q_start) & (t < q_end) & (kpos <= pos)
        if sliding_window is not None:
            visible &= kpos > pos - sliding_window
        t_row = blk_start + _div(lax.broadcasted_iota(jnp.int32, (rows, q_lanes), 0), group)
        mine = (t_row >= q_start) & (t_row < q_end)  # [rows, Lq]: rows of this sequence
        in_ctx = kv_blk * block_k + lax.broadcasted_iota(jnp.int32, (block_k, L), 0) < kv_len
        loaded: dict[int, jax.Array] = {}  # the row last loaded: one 32-bit load serves p slots

        def slot_values(slot: int) -> jax.Array:
            row, index = divmod(slot, layout.packing)
            if row not in loaded:
                loaded.clear()
                loaded[row] = kv_buf[buf, :, pl.ds(row * L, L)]  # [block_k, L], lane-aligned
            # Slots past kv_len may hold NaN: zero them (a masked score times NaN is NaN).
            vals = jnp.where(in_ctx, decode_values(loaded[row], index, layout), 0.0)
            return vals.astype(q_ref.dtype)

        for h in range(num_kv_heads):  # static: every q head of the group shares this load
            k = slot_values(layout.slot_of(h, False))
            v = slot_values(layout.slot_of(h, True)) if layout.split else k
            attend_head(h, k, v, visible, mine)

    def body(carry):
        seq, kv_blk, buf = carry
        nseq, nblk = next_pair(seq, kv_blk)

        @pl.when(in_block(nseq))
        def _prefetch_next():  # into the other buffer, consumed last step
            for c in page_copies(nseq, nblk, 1 - buf):
                c.start()

        for c in page_copies(seq, kv_blk, buf):
            c.wait()
        attend(seq, kv_blk, buf)
        return nseq, nblk, 1 - buf

    seq0 = first_seq_ref[pl.program_id(0)]
    blk0, _ = seq_bounds(jnp.minimum(seq0, jnp.maximum(num_seqs - 1, 0)))

    @pl.when(in_block(seq0))
    def _run():
        for c in page_copies(seq0, blk0, 0):
            c.start()
        lax.while_loop(lambda c: in_block(c[0]), body, (seq0, blk0, jnp.int32(0)))

    l = l_ref[...]
    if sinks_ref is not None:
        l = l + sink_denominator(sinks_ref[...], m_ref[...])
    out = jnp.where(l > 0, acc_ref[...] / jnp.where(l > 0, l, 1.0), 0.0)
    if v_scale is not None:
        out = out * v_scale
    o_ref[...] = out.astype(o_ref.dtype)


@dataclasses.dataclass(frozen=True)
class TpuTuning:
    """The tpu variant's knobs (None: `default_tuning`'s): `block_q` tokens per program,
    `pages_per_block` pages per DMA step, and Mosaic's `vmem_limit_bytes`."""

    block_q: int | None = None
    pages_per_block: int | None = None
    vmem_limit_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("block_q", "pages_per_block", "vmem_limit_bytes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"TpuTuning.{name} must be >= 1, got {value}")


def default_tuning(num_q_heads: int, num_kv_heads: int, page_size: int) -> tuple[int, int]:
    """(block_q, pages_per_block): a 128-row q tile (at least 16 tokens), 128 keys a step."""
    group = num_q_heads // num_kv_heads
    return max(16, 128 // group // 16 * 16), max(1, 128 // page_size)


def step_cost(layout: KVCacheLayout, num_q_heads: int, page_size: int,
              q_lens: list[int], kv_lens: list[int], block_q: int | None = None,
              pages_per_block: int | None = None) -> tuple[int, int]:
    """(HBM bytes of cache the kernel's DMAs read, flops of its dots) for one layer of a step
    whose sequences have `q_lens` new tokens over `kv_lens` of context (no sliding window):
    each q block fetches, for each sequence in it, whole kv blocks up to its causal end
    (past-the-end pages read the null page, still bytes) and multiplies all its rows against
    them. A compiled program cannot know the step's lengths, so the preflight's --roofline
    adds this to XLA's cost of the program (the cost estimate below counts q and out only)."""
    default_bq, default_ppb = default_tuning(num_q_heads, layout.num_kv_heads, page_size)
    block_q, block_k = block_q or default_bq, (pages_per_block or default_ppb) * page_size
    blocks, start = 0, 0
    for q_len, kv_len in zip(q_lens, kv_lens):
        end = start + q_len
        for blk in range(start // block_q, (end - 1) // block_q + 1) if q_len else ():
            num_keys = kv_len - (end - min(end, (blk + 1) * block_q))
            blocks += max(-(-num_keys // block_k), 1)
        start = end
    rows = block_q * (num_q_heads // layout.num_kv_heads)
    flops = blocks * layout.num_kv_heads * 4 * rows * block_k * layout.slot_lanes
    return blocks * block_k * layout.bytes_per_token(), flops


@jit_kernel(static_argnames=("spec", "interpret", "tuning"))
def ragged_paged_attention(
    q: jax.Array,  # [num_tokens, num_q_heads, head_dim]
    kv_pages: jax.Array,  # [num_pages, page_size, R * L] int32 (layout.packed)
    kv_lens: jax.Array,  # int32[max_num_seqs]
    page_indices: jax.Array,  # int32[max_num_seqs, pages_per_seq]
    cu_q_lens: jax.Array,  # int32[max_num_seqs + 1]
    num_seqs: jax.Array,  # int32[1]
    *,
    spec: AttentionSpec,
    sinks: jax.Array | None = None,
    plan: VariantPlan = None,
    interpret: bool = False,
    tuning: TpuTuning | None = None,
) -> jax.Array:
    """Same contract as the reference, over a packed cache: `spec.layout` is its layout
    (`plan` is ignored). `tuning`: `TpuTuning`. `interpret=True` runs the TPU interpreter
    (DMAs and semaphores simulated) on the CPU."""
    del plan
    layout = spec.layout
    if layout is None or not layout.packed:
        raise ValueError(f"the tpu variant reads a packed cache: spec.layout must be its packed "
                         f"KVCacheLayout, got {layout}")
    tuning = tuning or TpuTuning()
    sm_scale, sliding_window, soft_cap = spec.sm_scale, spec.sliding_window, spec.soft_cap
    k_scale, v_scale = spec.k_scale, spec.v_scale
    layout.check(kv_pages)
    num_tokens, num_q_heads, head_dim = q.shape
    page_size = kv_pages.shape[1]
    num_kv_heads = layout.num_kv_heads
    if head_dim != layout.head_dim or num_q_heads % num_kv_heads:
        raise ValueError(f"q {q.shape} does not fit {layout}")
    group = num_q_heads // num_kv_heads
    max_num_seqs, pages_per_seq = page_indices.shape
    default_bq, default_ppb = default_tuning(num_q_heads, num_kv_heads, page_size)
    block_q, pages_per_block = tuning.block_q or default_bq, tuning.pages_per_block or default_ppb
    num_q_blocks = pl.cdiv(num_tokens, block_q)
    padded = num_q_blocks * block_q
    rows = block_q * group
    q_lanes = layout.slot_lanes

    # Scalars. cu_q_lens past num_seqs is unspecified: make it flat so it stays sorted.
    n = num_seqs[0]
    cu = jnp.where(jnp.arange(max_num_seqs + 1) <= n, cu_q_lens, cu_q_lens[n]).astype(jnp.int32)
    blk_starts = jnp.arange(num_q_blocks, dtype=jnp.int32) * block_q
    first_seq = jnp.searchsorted(cu[1:], blk_starts, side="right").astype(jnp.int32)
    scalars = (kv_lens.astype(jnp.int32), page_indices.reshape(-1).astype(jnp.int32), cu,
               num_seqs.astype(jnp.int32), first_seq)

    # [T, H, D] -> [kvh, padded * group, Lq] (copies q, never K/V).
    qg = jnp.pad(q, ((0, padded - num_tokens), (0, 0), (0, q_lanes - head_dim)))
    qg = qg.reshape(padded, num_kv_heads, group, q_lanes).transpose(1, 0, 2, 3)
    qg = qg.reshape(num_kv_heads, padded * group, q_lanes)

    kernel = functools.partial(
        _kernel if sinks is not None else no_sinks(_kernel, 7), layout=layout, sm_scale=sm_scale * (k_scale or 1.0), block_q=block_q,
        group=group, page_size=page_size, pages_per_block=pages_per_block,
        pages_per_seq=pages_per_seq, sliding_window=sliding_window, soft_cap=soft_cap,
        mask_value=spec.mask_value, v_scale=v_scale)
    q_spec = pl.BlockSpec((num_kv_heads, rows, q_lanes), lambda i, *_: (0, i, 0))
    stats = pltpu.VMEM((num_kv_heads, rows, q_lanes), jnp.float32)
    in_specs, operands = [q_spec, pl.BlockSpec(memory_space=pl.ANY)], [qg, kv_pages]
    if sinks is not None:
        # Laid out as m is: every row of a q block holds its head's sink along the lanes;
        # one block for all programs, fetched once.
        head = jnp.tile(sinks.astype(jnp.float32).reshape(num_kv_heads, 1, group), (1, block_q, 1))
        in_specs.append(pl.BlockSpec((num_kv_heads, rows, q_lanes), lambda i, *_: (0, 0, 0)))
        operands.append(jnp.broadcast_to(head.reshape(num_kv_heads, rows, 1),
                                         (num_kv_heads, rows, q_lanes)))
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(scalars),
            grid=(num_q_blocks,),
            in_specs=in_specs,
            out_specs=q_spec,
            scratch_shapes=[
                pltpu.VMEM((2, pages_per_block * page_size, kv_pages.shape[2]), jnp.int32),
                pltpu.SemaphoreType.DMA((2,)),
                stats, stats, stats,
            ],
        ),
        out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype),
        # No state crosses programs, so q blocks may be split across TensorCores.
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",),
                                             vmem_limit_bytes=tuning.vmem_limit_bytes),
        interpret=pltpu.InterpretParams() if interpret else False,
        # q in, out back; the cache's bytes depend on the step's lengths: step_cost.
        cost_estimate=pl.CostEstimate(flops=0, transcendentals=0,
                                      bytes_accessed=2 * qg.size * qg.dtype.itemsize),
        name="ragged_paged_attention_tpu",
    )(*scalars, *operands)

    out = out.reshape(num_kv_heads, padded, group, q_lanes).transpose(1, 0, 2, 3)
    if q_lanes != head_dim:  # p @ [k | v]: the values' half
        out = out[..., head_dim:2 * head_dim]
    out = out.reshape(padded, num_q_heads, head_dim)[:num_tokens]
    real = jnp.arange(num_tokens) < cu[n]
    return jnp.where(real[:, None, None], out, jnp.zeros_like(out))


register_backend(
    "tpu",
    ragged_paged_attention,
    platforms=("tpu",),
    packed_layout=True,
    step_cost=step_cost,
    description="Pallas/Mosaic over the packed int32 cache: q-block grid, scalar-prefetched "
                "page table, double-buffered page DMAs, GQA group as one tile",
    test_tuning=(TpuTuning(), TpuTuning(block_q=8, pages_per_block=1)),
)
