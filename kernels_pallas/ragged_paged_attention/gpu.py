"""Ragged paged attention for NVIDIA GPUs: a Pallas kernel with Triton lowering.

JAX ships a GPU paged-attention kernel for decode only (one query per sequence); this one takes
a mixed batch, prefill chunks and decodes in one launch, with the reference's signature.

Work split. Each sequence's query tokens are cut into blocks of `block_q` tokens; a small XLA
prologue lists them (at most `num_tokens // block_q + min(max_num_seqs, num_tokens)` blocks, a
static bound) and the grid is `(num_kv_heads, work items)`::

    tokens   | s0 s0 s0 s0 s0 | s1 | s2 | s3 s3 s3 |        block_q = 2
    work     | w0   | w1  |w2 | w3 | w4 | w5   |w6 | w7 (empty) ...

GQA without repeating K/V. Program (h, w) loads kv head h's keys and values once per step and
multiplies them against every q head of the group at once: q is laid out in XLA as
`[num_kv_heads, tokens * group_pad, head_dim]`, so a block is one `[block_q * group_pad, D]`
tile (rows t0g0 t0g1 ... t1g0 ...); group_pad is the group size rounded up to a power of two
because Triton tiles must be powers of two (padded rows are masked and never stored).

Each step covers `pages_per_block` pages: their slots are looked up in the page table and
gathered straight from the interleaved cache (`kv_pages` viewed as `[num_pages * page_size,
2 * num_kv_heads, D]`, key row 2h, value row 2h+1), so nothing is copied out of the cache. The
loop stops at the block's last causal position (prefill blocks skip the future) and keeps a
float32 running max / sum / accumulator (online softmax).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas.kv_cache import KVCacheLayout
from kernels_pallas.ragged_paged_attention.reference import no_sinks, sink_denominator
from kernels_pallas.registry import AttentionSpec, VariantPlan, jit_kernel, register_backend


def next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


# Threads per block on every CUDA GPU: num_warps * 32 may not exceed it (a larger block
# compiles but can never launch).
MAX_THREADS_PER_BLOCK = 1024


@dataclasses.dataclass(frozen=True)
class GpuTuning:
    """The gpu variant's knobs (None: the defaults, see `ragged_paged_attention`): `block_q`
    query tokens per program, `pages_per_block` pages per step, `num_warps` / `num_stages` for
    Triton. `check=False` skips `check_tuning`, to ask the compiler itself
    (scripts/gpu_tunings.py)."""

    block_q: int | None = None
    pages_per_block: int | None = None
    num_warps: int | None = None
    num_stages: int = 2
    check: bool = True

    def __post_init__(self) -> None:
        for name in ("block_q", "pages_per_block", "num_warps", "num_stages"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"GpuTuning.{name} must be >= 1, got {value}")


def check_tuning(*, block_q: int, pages_per_block: int,
                 num_warps: int, num_stages: int) -> None:
    """ValueError unless the tuning makes a kernel that can compile and launch.

    Tiles need no minimum size: Triton lowers dots of any power-of-two shape (1 q row x 8
    keys and 4 x 4 compile for H100 / H200). Whether a tuning fits the shared memory and its
    registers without spills is the compiler's to say, per GPU and shape:
    scripts/gpu_tunings.py prints it for each tuning."""
    if block_q & (block_q - 1) or pages_per_block & (pages_per_block - 1):
        raise ValueError(f"block_q ({block_q}) and pages_per_block ({pages_per_block}) must "
                         "be powers of two (Triton tile sizes)")
    if num_warps < 1 or num_warps & (num_warps - 1) or 32 * num_warps > MAX_THREADS_PER_BLOCK:
        raise ValueError(f"num_warps must be a power of two with 32 * num_warps <= "
                         f"{MAX_THREADS_PER_BLOCK} threads per block, got {num_warps}")
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")


def work_items(
    cu_q_lens: jax.Array, kv_lens: jax.Array, num_seqs: jax.Array, *, num_tokens: int,
    block_q: int,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """List the (sequence, q block) pairs: per item its q start, q end, kv_len and seq id.

    Items past the real ones have q_start == q_end == 0: no rows, no pages, nothing stored.
    """
    max_num_seqs = kv_lens.shape[0]
    n = num_seqs[0]
    idx = jnp.arange(max_num_seqs + 1)
    cu = jnp.where(idx <= n, cu_q_lens, cu_q_lens[n])  # junk past num_seqs -> sorted
    q_lens = cu[1:] - cu[:-1]
    blocks = (q_lens + block_q - 1) // block_q
    ends = jnp.cumsum(blocks)
    num_items = num_tokens // block_q + min(max_num_seqs, num_tokens)
    w = jnp.arange(num_items, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(ends, w, side="right"), max_num_seqs - 1).astype(jnp.int32)
    real = w < ends[-1]
    q_start = cu[seq] + (w - (ends[seq] - blocks[seq])) * block_q
    q_start = jnp.where(real, q_start, 0).astype(jnp.int32)
    q_end = jnp.where(real, cu[seq + 1], 0).astype(jnp.int32)
    return seq, q_start, q_end, kv_lens[seq].astype(jnp.int32)


def _kernel(
    # scalars, one per work item
    seq_ref, q_start_ref, q_end_ref, kv_len_ref,  # int32[num_items]
    page_indices_ref,  # int32[max_num_seqs, pages_per_seq]
    q_ref,  # [num_kv_heads, rows, D], rows = (num_tokens + block_q) * group_pad
    kv_ref,  # [num_pages * page_size, 2 * num_kv_heads, D]
    sinks_ref,  # f32 [num_kv_heads, block_q * group_pad] (each row's head's sink), or None
    o_ref,  # [num_kv_heads, rows, D]
    *, sm_scale: float, group: int, group_pad: int, block_q: int, page_size: int,
    pages_per_block: int, sliding_window: int | None, soft_cap: float | None,
    mask_value: float, precision, k_scale: float | None, v_scale: float | None,
):
    h, w = pl.program_id(0), pl.program_id(1)
    seq, q_start, q_end, kv_len = seq_ref[w], q_start_ref[w], q_end_ref[w], kv_len_ref[w]
    pages_per_seq = page_indices_ref.shape[1]
    rows = block_q * group_pad
    block_k = pages_per_block * page_size
    head_dim = q_ref.shape[-1]

    r = jnp.arange(rows, dtype=jnp.int32)
    t = q_start + r // group_pad
    row_valid = (t < q_end) & (r % group_pad < group)
    pos = t + (kv_len - q_end)  # query position: last token of the seq sits at kv_len - 1
    # Keys needed by this block: up to the last real token's position (causal skip).
    last_t = jnp.minimum(q_start + block_q, q_end) - 1
    num_keys = jnp.where(q_start < q_end, last_t + (kv_len - q_end) + 1, 0)
    start: jax.Array | int = 0  # the first key block (sliding: the window's)
    if sliding_window is not None:
        first_key = jnp.maximum(q_start + (kv_len - q_end) - sliding_window + 1, 0)
        start = first_key // block_k

    q = q_ref[h, pl.ds(q_start * group_pad, rows), :]  # [rows, D], all q heads of group h

    def body(i, carry):
        acc, m, l = carry
        kpos = i * block_k + jnp.arange(block_k, dtype=jnp.int32)
        in_ctx = kpos < kv_len
        # Page id of every key slot; clamped + nulled so junk table entries stay in bounds.
        page = page_indices_ref[seq, jnp.minimum(kpos // page_size, pages_per_seq - 1)]
        slot = jnp.where(in_ctx, page, 0) * page_size + kpos % page_size
        k = kv_ref[slot, 2 * h, :].astype(q.dtype)  # [block_k, D]; fp8 pages widen here
        v = kv_ref[slot, 2 * h + 1, :].astype(q.dtype)
        if k_scale is not None:
            k = k * k_scale
        if v_scale is not None:
            v = v * v_scale
        # Slots past kv_len may hold NaN, and 0 * NaN is NaN in the second dot.
        v = jnp.where(in_ctx[:, None], v, jnp.zeros_like(v))
        s = plgpu.dot(q, k, trans_b=True, precision=precision) * sm_scale  # [rows, block_k] f32
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        visible = (kpos[None, :] <= pos[:, None]) & in_ctx[None, :]
        if sliding_window is not None:
            visible &= kpos[None, :] > pos[:, None] - sliding_window
        s = jnp.where(visible, s, mask_value)
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])
        l = alpha * l + p.sum(axis=1)
        pv = plgpu.dot(p.astype(v.dtype), v, precision=precision)
        return alpha[:, None] * acc + pv, m_new, l

    init = (jnp.zeros((rows, head_dim), jnp.float32),
            jnp.full((rows,), mask_value, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    acc, m, l = lax.fori_loop(start, pl.cdiv(num_keys, block_k), body, init)
    if sinks_ref is not None:
        l = l + sink_denominator(sinks_ref[h, :], m)
    out = acc / jnp.where(l > 0, l, 1.0)[:, None]
    # Rows of other sequences share this window of the output: store only our own.
    plgpu.store(o_ref.at[h, pl.ds(q_start * group_pad, rows), :], out.astype(o_ref.dtype),
                mask=row_valid[:, None])


def default_tuning(group_pad: int, head_dim: int, page_size: int) -> tuple[int, int]:
    """(block_q, pages_per_block): a 32-row q tile and 64 keys a step; for head_dim > 128 a
    16-row tile and 32 keys. At 256 a 32-row tile spilled registers (ptxas held it to 128 a
    thread) once the cache passed 2^31 elements and slot offsets became 64-bit, with a
    sliding window: a Gemma-3-4B cache at 32k on an H100 (scripts/gpu_tunings.py's procedure)."""
    if head_dim > 128:
        return max(1, 16 // group_pad), max(1, 32 // page_size)
    return max(1, 32 // group_pad), max(1, 64 // page_size)


def step_cost(layout: KVCacheLayout, num_q_heads: int, page_size: int,
              q_lens: list[int], kv_lens: list[int], block_q: int | None = None,
              pages_per_block: int | None = None) -> tuple[int, int]:
    """(bytes of cache the kernel loads, flops of its dots) for one layer of a step whose
    sequences have `q_lens` new tokens over `kv_lens` of context (no sliding window): each
    (kv head, work item) program loads whole blocks of key and value slots up to its causal
    end (past-the-end slots load the null page) and multiplies its whole padded tile against
    them. The preflight's --roofline adds it to XLA's cost of the program, which cannot know
    the step's lengths (the cost estimate below counts q and out)."""
    num_kv_heads, head_dim = layout.num_kv_heads, layout.head_dim
    group_pad = next_pow2(num_q_heads // num_kv_heads)
    default_bq, default_ppb = default_tuning(group_pad, head_dim, page_size)
    block_q, block_k = block_q or default_bq, (pages_per_block or default_ppb) * page_size
    blocks = 0
    for q_len, kv_len in zip(q_lens, kv_lens):
        for q_start in range(0, q_len, block_q):
            num_keys = min(q_start + block_q, q_len) + kv_len - q_len
            blocks += -(-num_keys // block_k)
    flops = blocks * num_kv_heads * 4 * block_q * group_pad * block_k * head_dim
    return blocks * block_k * layout.bytes_per_token(), flops


@jit_kernel(static_argnames=("spec", "interpret", "tuning"))
def ragged_paged_attention(
    q: jax.Array,  # [num_tokens, num_q_heads, head_dim]
    kv_pages: jax.Array,  # [num_pages, page_size, 2 * num_kv_heads, head_dim]
    kv_lens: jax.Array,  # int32[max_num_seqs]
    page_indices: jax.Array,  # int32[max_num_seqs, pages_per_seq]
    cu_q_lens: jax.Array,  # int32[max_num_seqs + 1]
    num_seqs: jax.Array,  # int32[1]
    *,
    spec: AttentionSpec,
    sinks: jax.Array | None = None,
    plan: VariantPlan = None,
    interpret: bool = False,
    tuning: GpuTuning | None = None,
) -> jax.Array:
    """Same contract as the reference (`plan` is ignored: the work list is this kernel's
    own prologue). `tuning` (`GpuTuning`): `block_q` query tokens per program and
    `pages_per_block` pages per step (default: `default_tuning`), `num_warps` (default 4; 8
    for head_dim > 128 or a sliding window: Gemma's 256 spilled registers at 4 warps and 64
    keys on H200, and GPT-OSS's windowed heads of 64 in groups of 8 on H100) /
    `num_stages` for Triton (`check_tuning` says which compile). head_dim and page_size must
    be powers of two."""
    del plan
    tuning = tuning or GpuTuning()
    sm_scale, sliding_window, soft_cap = spec.sm_scale, spec.sliding_window, spec.soft_cap
    num_tokens, num_q_heads, head_dim = q.shape
    num_pages, page_size, num_kv_slots, _ = kv_pages.shape
    num_kv_heads = num_kv_slots // 2
    group = num_q_heads // num_kv_heads
    for name, size in (("head_dim", head_dim), ("page_size", page_size)):
        if size & (size - 1):
            raise ValueError(f"the gpu backend needs a power-of-two {name}, got {size}; "
                             "use backend='reference'")
    group_pad = next_pow2(group)
    default_bq, default_ppb = default_tuning(group_pad, head_dim, page_size)
    block_q, pages_per_block = tuning.block_q or default_bq, tuning.pages_per_block or default_ppb
    num_warps = tuning.num_warps or (8 if head_dim > 128 or sliding_window else 4)
    num_stages = tuning.num_stages
    if tuning.check and not interpret:  # interpret mode runs any tile (the tests' small tunings)
        check_tuning(block_q=block_q, pages_per_block=pages_per_block,
                     num_warps=num_warps, num_stages=num_stages)

    seq, q_start, q_end, kv_len = work_items(cu_q_lens, kv_lens, num_seqs,
                                             num_tokens=num_tokens, block_q=block_q)
    # [T, H, D] -> [kvh, (T + block_q) * group_pad, D]; the block_q extra tokens keep the last
    # block's load in bounds. This copies q (small next to the cache), never K/V.
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    qg = jnp.pad(qg, ((0, block_q), (0, 0), (0, group_pad - group), (0, 0)))
    qg = qg.transpose(1, 0, 2, 3).reshape(num_kv_heads, -1, head_dim)
    kv_flat = kv_pages.reshape(num_pages * page_size, num_kv_slots, head_dim)  # a bitcast
    operands = [seq, q_start, q_end, kv_len, page_indices, qg, kv_flat]
    if sinks is not None:  # per row of a q tile (t0g0 t0g1 .. t1g0 ..), padded heads 0
        tile = jnp.pad(sinks.astype(jnp.float32).reshape(num_kv_heads, group),
                       ((0, 0), (0, group_pad - group)))
        operands.append(jnp.tile(tile, (1, block_q)))

    kernel = functools.partial(
        _kernel if sinks is not None else no_sinks(_kernel, 7), sm_scale=sm_scale, group=group, group_pad=group_pad, block_q=block_q,
        page_size=page_size, pages_per_block=pages_per_block, sliding_window=sliding_window,
        soft_cap=soft_cap, mask_value=spec.mask_value,
        precision=lax.Precision.HIGHEST if q.dtype == jnp.float32 else None,
        k_scale=spec.k_scale, v_scale=spec.v_scale)
    out = pl.pallas_call(
        kernel,
        grid=(num_kv_heads, seq.shape[0]),
        out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        # q in, out back; the cache's bytes depend on the step's lengths: step_cost.
        cost_estimate=pl.CostEstimate(flops=0, transcendentals=0,
                                      bytes_accessed=2 * qg.size * qg.dtype.itemsize),
        name="ragged_paged_attention_gpu",
    )(*operands)

    out = out.reshape(num_kv_heads, num_tokens + block_q, group_pad, head_dim)
    out = out[:, :num_tokens, :group].transpose(1, 0, 2, 3).reshape(q.shape)
    # Padding rows were never stored (their memory is undefined): zero them.
    real = jnp.arange(num_tokens) < cu_q_lens[num_seqs[0]]
    return jnp.where(real[:, None, None], out, jnp.zeros_like(out))


def _kv_write_kernel(slot_ref, rows_ref, kv_in_ref, kv_ref, *, num_slots: int):
    """Program t writes token t's rows (k0 v0 k1 v1 ...) into its slot of the flat cache."""
    del kv_in_ref  # the same buffer as kv_ref (aliased)
    t = pl.program_id(0)
    slot = slot_ref[t]
    for i in range(num_slots):  # static and small; each store is one contiguous row
        kv_ref[slot, i, :] = rows_ref[t, i, :]


@functools.partial(jax.jit, static_argnames=("interpret",))
def update_kv_cache(
    kv_pages: jax.Array,  # [num_pages, page_size, 2 * num_kv_heads, head_dim]
    rows: jax.Array,  # [num_tokens, 2 * num_kv_heads, head_dim] in the cache's dtype
    slot_mapping: jax.Array,  # int32[num_tokens]
    *,
    interpret: bool = False,
) -> jax.Array:
    """KV write as a Pallas kernel aliasing the cache (input_output_aliases): in place when the
    caller donates `kv_pages`. Padding tokens racing on null-page slots are harmless."""
    num_pages, page_size, num_kv_slots, head_dim = kv_pages.shape
    num_tokens = rows.shape[0]
    flat = kv_pages.reshape(num_pages * page_size, num_kv_slots, head_dim)
    out = pl.pallas_call(
        functools.partial(_kv_write_kernel, num_slots=num_kv_slots),
        grid=(num_tokens,),
        out_shape=jax.ShapeDtypeStruct(flat.shape, flat.dtype),
        input_output_aliases={2: 0},
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
        name="update_kv_cache_gpu",
    )(slot_mapping.astype(jnp.int32), rows.astype(flat.dtype), flat)
    return out.reshape(kv_pages.shape)


register_backend(
    "gpu",
    ragged_paged_attention,
    update_kv_cache=update_kv_cache,
    platforms=("cuda",),
    description="Pallas/Triton: (kv head, q block) grid, GQA group as one tile, online softmax",
    step_cost=step_cost,
    test_tuning=(GpuTuning(), GpuTuning(block_q=2, pages_per_block=1)),
)
