"""Ragged paged attention for TPUs: a Pallas kernel with Mosaic lowering.

Grid: one program per aligned block of `block_q` query tokens ("q block"). A q block may hold
the tail of one sequence, whole decode sequences and the head of another; the program walks
the (sequence, kv block) pairs that touch it in one loop, fetching each kv block's pages from
HBM with manual DMAs into a double buffer while the previous block is computed::

    tokens      | s0 s0 s0 | s1 | s2 | s3 s3 s3 s3 s3 ...
    q blocks    |   q block 0    |  q block 1  ...          (block_q = 4 here)
    program 0:  (s0,kv0) (s0,kv1) (s1,kv0) ... (s3,kv0) (s3,kv1)   <- one loop, and the
                 fetch of pair n+1 overlaps the compute of pair n

Scalars (page table, kv_lens, cu_q_lens, num_seqs, each q block's first sequence) are scalar-
prefetched into SMEM. Layouts chosen so that no ref is ever reshaped (that breaks the TPU
interpreter in jax 0.10.2, which is why the upstream kernel cannot be interpreted):

    kv_hbm  [num_pages, page_size * 2 * kvh, D]   the cache viewed in XLA (a bitcast):
                                                   row = slot * 2 * kvh + 2h (+1 for v)
    kv_buf  [2, pages_per_block * page_size * 2 * kvh, D]  VMEM double buffer, page i at rows
                                                   i*page_size*2kvh...; key of head h is the
                                                   strided row set 2h, 2h + 2kvh, ...
    q, out  [kvh, num_q_blocks * block_q * group, D]   q re-laid out in XLA so that head h's
                                                   block is a 2-D [block_q * group, D] tile
                                                   (rows t0g0 t0g1 .. t1g0 ..): GQA shares
                                                   one K/V load across the whole group.

Each row belongs to exactly one sequence, so the float32 running max / sum / accumulator live
in VMEM scratch for the whole q block and each (seq, kv block) step updates only its rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.ragged_paged_attention.reference import DEFAULT_MASK_VALUE
from kernels_pallas.registry import register_backend


def _div(a, b: int):
    """Integer division of non-negative values. `//` lowers through `sign`, which Mosaic
    lowering rejects off-TPU (it asks the device for its generation), so use lax.div."""
    return lax.div(a, jnp.full_like(a, b))


def _cdiv(a, b: int):
    return _div(a + (b - 1), b)


def _kernel(
    # scalar prefetch (SMEM)
    kv_lens_ref,  # int32[max_num_seqs]
    page_indices_ref,  # int32[max_num_seqs * pages_per_seq]   (flattened: SMEM pads 2-D)
    cu_q_lens_ref,  # int32[max_num_seqs + 1]                 (sorted past num_seqs)
    num_seqs_ref,  # int32[1]
    first_seq_ref,  # int32[num_q_blocks]: first sequence with tokens in each q block
    # inputs
    q_ref,  # VMEM [kvh, rows, D], rows = block_q * group
    kv_hbm,  # HBM  [num_pages, page_size * 2 * kvh, D]
    # output
    o_ref,  # VMEM [kvh, rows, D]
    # scratch
    kv_buf,  # VMEM [2, pages_per_block * page_size * 2 * kvh, D]
    sems,  # DMA semaphores [2], one per buffer
    m_ref, l_ref, acc_ref,  # VMEM f32 [kvh, rows, D] (m, l replicated along D: no [rows, 1])
    *, sm_scale: float, block_q: int, group: int, page_size: int, pages_per_block: int,
    pages_per_seq: int, sliding_window: int | None, soft_cap: float | None,
    mask_value: float, k_scale: float | None, v_scale: float | None,
):
    num_kv_heads, rows, head_dim = q_ref.shape
    page_rows = page_size * 2 * num_kv_heads
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
                kv_hbm.at[page], kv_buf.at[buf, pl.ds(i * page_rows, page_rows)], sems.at[buf]))
        return copies

    m_ref[...] = jnp.full(m_ref.shape, mask_value, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def attend(seq, kv_blk, buf):
        q_start, q_end, kv_len = cu_q_lens_ref[seq], cu_q_lens_ref[seq + 1], kv_lens_ref[seq]
        t = blk_start + _div(lax.broadcasted_iota(jnp.int32, (rows, block_k), 0), group)
        kpos = kv_blk * block_k + lax.broadcasted_iota(jnp.int32, (rows, block_k), 1)
        pos = t - q_end + kv_len
        visible = (t >= q_start) & (t < q_end) & (kpos <= pos)
        if sliding_window is not None:
            visible &= kpos > pos - sliding_window
        t_row = blk_start + _div(lax.broadcasted_iota(jnp.int32, (rows, head_dim), 0), group)
        mine = (t_row >= q_start) & (t_row < q_end)  # [rows, D]: rows of this sequence
        in_ctx = kv_blk * block_k + lax.broadcasted_iota(jnp.int32, (block_k, head_dim), 0) < kv_len
        for h in range(num_kv_heads):  # static: every head of the group shares this fetch
            k = kv_buf[buf, pl.ds(2 * h, block_k, stride=2 * num_kv_heads), :]  # [block_k, D]
            v = kv_buf[buf, pl.ds(2 * h + 1, block_k, stride=2 * num_kv_heads), :]
            if k_scale is not None:
                k = (k.astype(jnp.float32) * k_scale).astype(q_ref.dtype)
            if v_scale is not None:
                v = (v.astype(jnp.float32) * v_scale).astype(q_ref.dtype)
            # Slots past kv_len may be NaN: zero them (a masked score times NaN is NaN).
            k = jnp.where(in_ctx, k, jnp.zeros_like(k))
            v = jnp.where(in_ctx, v, jnp.zeros_like(v))
            s = lax.dot_general(q_ref[h], k, (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32) * sm_scale
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            s = jnp.where(visible, s, mask_value)
            m_prev, l_prev, acc_prev = m_ref[h], l_ref[h], acc_ref[h]
            m_cur = s.max(axis=1, keepdims=True)  # [rows, 1]
            p = jnp.exp(s - m_cur)
            m_next = jnp.maximum(m_prev, m_cur)  # [rows, D]
            alpha, beta = jnp.exp(m_prev - m_next), jnp.exp(m_cur - m_next)
            pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
            m_ref[h] = jnp.where(mine, m_next, m_prev)
            l_ref[h] = jnp.where(mine, alpha * l_prev + beta * p.sum(axis=1, keepdims=True), l_prev)
            acc_ref[h] = jnp.where(mine, alpha * acc_prev + beta * pv, acc_prev)

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
    o_ref[...] = jnp.where(l > 0, acc_ref[...] / jnp.where(l > 0, l, 1.0), 0.0).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "sliding_window", "soft_cap", "mask_value", "k_scale", "v_scale", "block_q",
    "pages_per_block", "vmem_limit_bytes", "interpret"))
def ragged_paged_attention(
    q: jax.Array,  # [num_tokens, num_q_heads, head_dim]
    kv_pages: jax.Array,  # [num_pages, page_size, 2 * num_kv_heads, head_dim]
    kv_lens: jax.Array,  # int32[max_num_seqs]
    page_indices: jax.Array,  # int32[max_num_seqs, pages_per_seq]
    cu_q_lens: jax.Array,  # int32[max_num_seqs + 1]
    num_seqs: jax.Array,  # int32[1]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    mask_value: float | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
    block_q: int | None = None,
    pages_per_block: int | None = None,
    vmem_limit_bytes: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Same contract as the reference. Tuning: `block_q` tokens per program (default: a
    128-row tile, at least 16 tokens), `pages_per_block` pages per DMA step (default 128 keys).
    `interpret=True` runs the TPU interpreter (DMAs and semaphores simulated) on the CPU."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_pages, page_size, num_kv_slots, _ = kv_pages.shape
    num_kv_heads = num_kv_slots // 2
    group = num_q_heads // num_kv_heads
    max_num_seqs, pages_per_seq = page_indices.shape
    block_q = block_q or max(16, 128 // group // 16 * 16)
    pages_per_block = pages_per_block or max(1, 128 // page_size)
    num_q_blocks = pl.cdiv(num_tokens, block_q)
    padded = num_q_blocks * block_q
    rows = block_q * group

    # Scalars. cu_q_lens past num_seqs is unspecified: make it flat so it stays sorted.
    n = num_seqs[0]
    cu = jnp.where(jnp.arange(max_num_seqs + 1) <= n, cu_q_lens, cu_q_lens[n]).astype(jnp.int32)
    blk_starts = jnp.arange(num_q_blocks, dtype=jnp.int32) * block_q
    first_seq = jnp.searchsorted(cu[1:], blk_starts, side="right").astype(jnp.int32)
    scalars = (kv_lens.astype(jnp.int32), page_indices.reshape(-1).astype(jnp.int32), cu,
               num_seqs.astype(jnp.int32), first_seq)

    # [T, H, D] -> [kvh, padded * group, D] (copies q, never K/V); the cache view is a bitcast.
    qg = jnp.pad(q, ((0, padded - num_tokens), (0, 0), (0, 0)))
    qg = qg.reshape(padded, num_kv_heads, group, head_dim).transpose(1, 0, 2, 3)
    qg = qg.reshape(num_kv_heads, padded * group, head_dim)
    kv_hbm = kv_pages.reshape(num_pages, page_size * num_kv_slots, head_dim)

    kernel = functools.partial(
        _kernel, sm_scale=sm_scale, block_q=block_q, group=group, page_size=page_size,
        pages_per_block=pages_per_block, pages_per_seq=pages_per_seq,
        sliding_window=sliding_window, soft_cap=soft_cap,
        mask_value=DEFAULT_MASK_VALUE if mask_value is None else mask_value,
        k_scale=k_scale, v_scale=v_scale)
    q_spec = pl.BlockSpec((num_kv_heads, rows, head_dim), lambda i, *_: (0, i, 0))
    stats = pltpu.VMEM((num_kv_heads, rows, head_dim), jnp.float32)
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(scalars),
            grid=(num_q_blocks,),
            in_specs=[q_spec, pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=q_spec,
            scratch_shapes=[
                pltpu.VMEM((2, pages_per_block * page_size * num_kv_slots, head_dim),
                           kv_pages.dtype),
                pltpu.SemaphoreType.DMA((2,)),
                stats, stats, stats,
            ],
        ),
        out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype),
        # No state crosses programs, so q blocks may be split across TensorCores.
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",),
                                             vmem_limit_bytes=vmem_limit_bytes),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="ragged_paged_attention_tpu",
    )(*scalars, qg, kv_hbm)

    out = out.reshape(num_kv_heads, padded, group, head_dim).transpose(1, 0, 2, 3)
    out = out.reshape(padded, num_q_heads, head_dim)[:num_tokens]
    real = jnp.arange(num_tokens) < cu[n]
    return jnp.where(real[:, None, None], out, jnp.zeros_like(out))


def _kv_write_kernel(slots_ref, new_ref, kv_in_hbm, kv_hbm, sem, *, block_t: int):
    """Program i DMAs its block's token rows ([2 * kvh, D] each) straight into their HBM slots."""
    del kv_in_hbm  # the same buffer as kv_hbm (aliased)
    base = pl.program_id(0) * block_t
    copies = [pltpu.make_async_copy(new_ref.at[t], kv_hbm.at[slots_ref[base + t]], sem)
              for t in range(block_t)]
    for c in copies:
        c.start()
    for c in copies:
        c.wait()


@functools.partial(jax.jit, static_argnames=("block_t", "interpret"))
def update_kv_cache(
    kv_pages: jax.Array,  # [num_pages, page_size, 2 * num_kv_heads, head_dim]
    k: jax.Array,  # [num_tokens, num_kv_heads, head_dim]
    v: jax.Array,  # [num_tokens, num_kv_heads, head_dim]
    slot_mapping: jax.Array,  # int32[num_tokens]
    *,
    block_t: int = 16,
    interpret: bool = False,
) -> jax.Array:
    """KV write: slots scalar-prefetched, new rows DMA'd into the aliased cache in HBM (in place
    when donated). Padding tokens share null-page slots; those racing DMAs are harmless."""
    from kernels_pallas.kv_cache import interleave_kv

    num_pages, page_size, num_kv_slots, head_dim = kv_pages.shape
    num_tokens = k.shape[0]
    padded = pl.cdiv(num_tokens, block_t) * block_t
    new = jnp.pad(interleave_kv(k, v).astype(kv_pages.dtype),
                  ((0, padded - num_tokens), (0, 0), (0, 0)))
    # Extra tokens from rounding up write into slot 0 of the null page.
    slots = jnp.pad(slot_mapping.astype(jnp.int32), (0, padded - num_tokens))
    flat = kv_pages.reshape(num_pages * page_size, num_kv_slots, head_dim)
    out = pl.pallas_call(
        functools.partial(_kv_write_kernel, block_t=block_t),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(padded // block_t,),
            in_specs=[pl.BlockSpec((block_t, num_kv_slots, head_dim), lambda i, *_: (i, 0, 0)),
                      pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec(memory_space=pl.ANY),
            scratch_shapes=[pltpu.SemaphoreType.DMA(())],
        ),
        out_shape=jax.ShapeDtypeStruct(flat.shape, flat.dtype),
        input_output_aliases={2: 0},  # operand index counts the scalar-prefetch argument
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="update_kv_cache_tpu",
    )(slots, new, flat)
    return out.reshape(kv_pages.shape)


register_backend(
    "tpu",
    ragged_paged_attention,
    update_kv_cache=update_kv_cache,
    platforms=("tpu",),
    description="Pallas/Mosaic: q-block grid, scalar-prefetched page table, double-buffered "
                "page DMAs, GQA group as one tile",
    test_tuning=({}, {"block_q": 8, "pages_per_block": 1}),
)
