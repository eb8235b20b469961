"""Ragged paged attention for the CPU: memory traffic O(the batch's context), not O(tokens x context).

Plain `jax.numpy` + `lax` loops (XLA's CPU backend compiles them; no Pallas), with the
reference's signature. The reference gathers every query token's own pages and loops to the
longest sequence in the batch; here the work is split in two kinds of items so that each key
is read about once per query *block* and every loop is bounded by the real work:

    tokens   | s0 s0 s0 s0 s0 s0 | s1 | s2 | s3 s3 s3 |    (s1, s2 decode: q_len <= decode_q_len)

    prefill blocks (q_len > decode_q_len), block_q = 4:
        b0 = s0 rows 0..3, b1 = s0 rows 4..5, b2 = s3 rows 0..2
        each block walks its own sequence's keys in blocks of `pages_per_block` pages, from
        the window start to its last row's position (causal: no block past the diagonal),
        with an online softmax; a K/V block is gathered once for all block_q x group rows.

    decode items (one query row per token):
        the keys of every decode token are cut into blocks of `decode_pages_per_block`
        pages, and all (token, key block) pairs are laid end to end:
            s1: k0..k63 | s1: k64..k90 | s2: k0..k40 | (pad)
        each loop iteration takes `decode_items` of them, so a short sequence costs its own
        few items and never pays for a long neighbour; partial softmax results are merged
        per token with scatter-max / scatter-add (a split-K "flash decoding" merge).

Both loops above are the XLA path. Where the C++ kernels load and take the cache
(`_decode_cpu.why_not`, `_prefill_cpu.why_not`), the decode rows go to `decode_cpu.cc` (each
row's pages read in place, in 256-key chunks over every core) and the prefill rows to
`prefill_cpu.cc` (AVX-512: 32 query rows in vector lanes against 32-key tiles, softmax fused,
bf16 dots over a bf16 cache on AVX512-BF16); the XLA loops are their oracles.

Both loops are `lax.fori_loop`s with data-dependent trip counts (while loops): on the CPU they
cost no host round trip, and an absent kind of work costs zero iterations. What depends only
on the lengths (the work lists) is an `AttentionPlan`, built once per step by `make_plan()` and
shared by every layer, as vLLM's attention-metadata builders do.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax

from kernels_pallas.kv_cache import kv_cache_values
from kernels_pallas.ragged_paged_attention import _decode_cpu, _prefill_cpu
from kernels_pallas.ragged_paged_attention.reference import gqa_layout, sink_denominator
from kernels_pallas.registry import AttentionSpec, register_backend

_KERNEL_CHOICES = ("auto", "xla")


@dataclass(frozen=True)
class CpuTuning:
    """The CPU variant's knobs (None: the defaults of `work_split`, measured on 2 cores at
    SmolLM2-135M shapes). `decode_kernel`: "auto" runs the decode rows through the C++ kernel
    (`decode_cpu.cc`) where it loads and takes the cache, "xla" keeps them in the XLA loop (its
    oracle); `prefill_kernel` likewise for the prefill rows (`prefill_cpu.cc`, AVX-512)."""

    block_q: int = 128  # query rows per prefill block
    pages_per_block: int | None = None  # pages per prefill key step
    decode_q_len: int = 1  # sequences with at most this many query tokens take the decode path
    decode_pages_per_block: int | None = None  # pages per decode item
    decode_items: int | None = None  # decode items per loop iteration
    decode_kernel: str = "auto"
    prefill_kernel: str = "auto"

    def __post_init__(self) -> None:
        for name in ("decode_kernel", "prefill_kernel"):
            if getattr(self, name) not in _KERNEL_CHOICES:
                raise ValueError(f"CpuTuning.{name} must be 'auto' or 'xla', not "
                                 f"{getattr(self, name)!r}")
        for name in ("block_q", "pages_per_block", "decode_q_len", "decode_pages_per_block",
                     "decode_items"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"CpuTuning.{name} must be >= 1, got {value}")


@dataclass(frozen=True)
class WorkSplit:
    """Static work split (resolved from the tuning knobs and the shapes)."""

    block_q: int  # query rows per prefill block
    block_kv: int  # keys per prefill step (whole pages)
    decode_q_len: int  # sequences with at most this many query tokens take the decode path
    decode_block_kv: int  # keys per decode item (whole pages)
    decode_items: int  # decode items per loop iteration
    decode_rows: int  # static bound on decode tokens
    sliding_window: int | None


def work_split(num_tokens: int, max_num_seqs: int, pages_per_seq: int, page_size: int,
               tuning: CpuTuning, sliding_window: int | None) -> WorkSplit:
    """Defaults measured on 2 cores (SmolLM2-135M shapes): 128 x 256-key prefill blocks,
    64-key decode items, 4 to 32 of them per iteration with the token count."""
    pages = min(tuning.pages_per_block or max(1, 256 // page_size), pages_per_seq)
    decode_pages = min(tuning.decode_pages_per_block or max(1, 64 // page_size), pages_per_seq)
    return WorkSplit(
        block_q=min(tuning.block_q, num_tokens),
        block_kv=pages * page_size,
        decode_q_len=tuning.decode_q_len,
        decode_block_kv=decode_pages * page_size,
        decode_items=tuning.decode_items or min(32, max(4, num_tokens // 2)),
        decode_rows=min(num_tokens, max_num_seqs * tuning.decode_q_len),
        sliding_window=sliding_window,
    )


def _ceil_div(a: jax.Array, b: int) -> jax.Array:
    return (a + b - 1) // b


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class AttentionPlan:
    """The step's work lists; depends on lengths only, so every layer shares it."""

    q_lens: jax.Array  # i32[S]; 0 past num_seqs
    kv_lens: jax.Array  # i32[S]; 0 past num_seqs
    cu: jax.Array  # i32[S + 1]; flattened to the total past num_seqs
    valid: jax.Array  # bool[T]: a real query row
    decode_token: jax.Array  # bool[T]: the row takes the decode path
    decode_rank: jax.Array  # i32[T]: its row in the compact decode list
    row_token: jax.Array  # i32[R]: token of each compact decode row
    row_seq: jax.Array  # i32[R]
    row_pos: jax.Array  # i32[R]
    row_first_blk: jax.Array  # i32[R]: first key block in its window
    row_ends: jax.Array  # i32[R]: inclusive cumsum of decode items per row
    block_ends: jax.Array  # i32[S]: inclusive cumsum of prefill blocks per sequence


def make_plan(kv_lens: jax.Array, page_indices: jax.Array, cu_q_lens: jax.Array,
              num_seqs: jax.Array, *, num_tokens: int, page_size: int, spec: AttentionSpec,
              tuning: CpuTuning | None = None) -> AttentionPlan:
    """Build the step's work lists (entries of the inputs past num_seqs may be junk); of
    `spec` only the sliding window matters."""
    max_num_seqs, pages_per_seq = page_indices.shape
    tn = work_split(num_tokens, max_num_seqs, pages_per_seq, page_size, tuning or CpuTuning(),
                    spec.sliding_window)
    n = num_seqs[0]
    real = jnp.arange(max_num_seqs) < n
    cu = jnp.where(jnp.arange(max_num_seqs + 1) <= n, cu_q_lens, cu_q_lens[n])
    q_lens = jnp.where(real, cu[1:] - cu[:-1], 0)
    kv_lens = jnp.where(real, kv_lens, 0)
    is_decode = q_lens <= tn.decode_q_len

    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq_ids = jnp.minimum(_rank(cu[1:], t), max_num_seqs - 1)
    seq_ids = seq_ids.astype(jnp.int32)
    valid = t < cu[-1]
    positions = kv_lens[seq_ids] - q_lens[seq_ids] + (t - cu[seq_ids])
    decode_token = valid & is_decode[seq_ids]

    # Decode tokens compacted into R rows, so the per-iteration merge touches only them.
    R = tn.decode_rows
    rank = jnp.cumsum(decode_token, dtype=jnp.int32) - 1
    row_token = jnp.zeros((R,), jnp.int32).at[jnp.where(decode_token, rank, R)].set(
        t, mode="drop")
    row_real = jnp.arange(R) < jnp.sum(decode_token)
    row_pos = positions[row_token]
    row_first_blk = _first_visible(row_pos, tn.sliding_window) // tn.decode_block_kv
    items = jnp.where(row_real, row_pos // tn.decode_block_kv - row_first_blk + 1, 0)
    blocks = jnp.where(is_decode, 0, _ceil_div(q_lens, tn.block_q))
    return AttentionPlan(
        q_lens=q_lens, kv_lens=kv_lens, cu=cu, valid=valid, decode_token=decode_token,
        decode_rank=jnp.clip(rank, 0, R - 1), row_token=row_token, row_seq=seq_ids[row_token],
        row_pos=row_pos, row_first_blk=row_first_blk,
        row_ends=jnp.cumsum(items, dtype=jnp.int32),
        block_ends=jnp.cumsum(blocks, dtype=jnp.int32),
    )


def _first_visible(pos: jax.Array, sliding_window: int | None) -> jax.Array:
    return jnp.zeros_like(pos) if sliding_window is None else jnp.maximum(pos - sliding_window + 1, 0)


def _rank(sorted_values: jax.Array, x: jax.Array) -> jax.Array:
    """How many of `sorted_values` are <= each x (searchsorted, side="right").

    NOTE: one compare-and-count fusion; jnp.searchsorted's default lowers to a loop of
    log2(n) steps, a nested while loop in every decode iteration."""
    return jnp.searchsorted(sorted_values, x, side="right", method="compare_all")


def _owner(ends: jax.Array, item: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Owner of each flat item (`ends`: inclusive cumsum of per-owner counts) and the item's
    index within its owner. Items past the end map to the last owner (callers mask them)."""
    owner = jnp.minimum(_rank(ends, item), ends.shape[0] - 1)
    counts = jnp.diff(ends, prepend=0)
    return owner, item - (ends[owner] - counts[owner])


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
    plan: AttentionPlan | None = None,
    interpret: bool = False,
    tuning: CpuTuning | None = None,
) -> jax.Array:
    """Ragged paged attention (layout: reference.py) with O(context) memory traffic.

    `spec` and `sinks`: the reference's; `tuning`: `CpuTuning`. `plan` is this step's
    `make_plan(...)` (an `AttentionPlan`, made here when not given; it must come from the same
    spec and tuning). `interpret` is ignored (no Pallas). Returns `[num_tokens, num_q_heads,
    head_dim]` in `q.dtype`, zeros on padding rows.
    """
    del interpret
    tuning = tuning or CpuTuning()
    sm_scale, soft_cap, mask_value = spec.sm_scale, spec.soft_cap, spec.mask_value
    k_scale, v_scale, kv_cache_dtype = spec.k_scale, spec.v_scale, spec.kv_cache_dtype
    q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs = map(
        jnp.asarray, (q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs))
    num_tokens, num_q_heads, head_dim = q.shape
    page_size = kv_pages.shape[1]
    num_kv_heads, group = gqa_layout(q, kv_pages)
    max_num_seqs, pages_per_seq = page_indices.shape
    tn = work_split(num_tokens, max_num_seqs, pages_per_seq, page_size, tuning,
                    spec.sliding_window)
    if plan is None:
        plan = make_plan(kv_lens, page_indices, cu_q_lens, num_seqs,
                         num_tokens=num_tokens, page_size=page_size, spec=spec, tuning=tuning)
    seq_pages = _ceil_div(plan.kv_lens, page_size)
    # Pages as flat rows: a 1-D gather of whole rows is XLA's fastest gather on the CPU.
    kv_rows = kv_pages.reshape(kv_pages.shape[0], -1)

    def read_keys(s: jax.Array, first_key: jax.Array, count: int) -> tuple[jax.Array, jax.Array]:
        """Keys and values [..., count, kvh, D] of sequences `s` (any batch shape) from key
        `first_key` (page-aligned). Pages past a sequence's end read the null page 0, so a
        block that runs past the end never follows a junk table entry."""
        cols = first_key[..., None] // page_size + jnp.arange(count // page_size)
        pages = page_indices[s[..., None], jnp.minimum(cols, pages_per_seq - 1)]
        pages = jnp.where(cols < seq_pages[s][..., None], pages, 0)
        block = kv_cache_values(kv_rows[pages.reshape(-1)], kv_cache_dtype)
        block = block.reshape(*s.shape, count, num_kv_heads, 2, head_dim)
        k = block[..., 0, :].astype(jnp.float32)
        v = block[..., 1, :].astype(jnp.float32)
        if k_scale is not None:
            k = k * k_scale
        if v_scale is not None:
            v = v * v_scale
        return k, v

    def scores(s: jax.Array) -> jax.Array:
        s = s * sm_scale
        return s if soft_cap is None else soft_cap * jnp.tanh(s / soft_cap)

    qf = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim)
    head_sinks = None if sinks is None else sinks.astype(jnp.float32).reshape(num_kv_heads, group)
    scaled = k_scale is not None or v_scale is not None
    use_kernel = tuning.decode_kernel == "auto" and _decode_cpu.why_not(
        num_q_heads, num_kv_heads, head_dim, page_size, kv_pages.dtype, kv_cache_dtype,
        scaled) is None
    if use_kernel:
        rows = _decode_cpu.paged_decode_attention(
            qf[plan.row_token].reshape(-1, num_q_heads, head_dim), kv_pages, page_indices,
            plan.row_seq, plan.row_pos, jnp.sum(plan.decode_token), sm_scale=sm_scale, soft_cap=soft_cap,
            sliding_window=tn.sliding_window, sinks=sinks)
        out = rows.reshape(-1, num_kv_heads, group, head_dim)[plan.decode_rank]
    else:
        out = _decode(qf, plan, tn, read_keys, scores, mask_value, head_sinks)
    if num_tokens > tn.decode_q_len:  # else every real row is a decode row
        if tuning.prefill_kernel == "auto" and _prefill_cpu.why_not(
                head_dim, kv_pages.dtype, kv_cache_dtype, scaled) is None:
            prefill = _prefill_cpu.paged_prefill_attention(
                qf.reshape(num_tokens, num_q_heads, head_dim), kv_pages, page_indices, plan.cu,
                plan.q_lens, plan.kv_lens, sm_scale=sm_scale, soft_cap=soft_cap,
                sliding_window=tn.sliding_window, decode_q_len=tn.decode_q_len,
                block_q=tn.block_q, sinks=sinks).reshape(qf.shape)
        else:
            prefill = _prefill(qf, plan, tn, read_keys, scores, mask_value, head_sinks)
        out = jnp.where(plan.decode_token[:, None, None, None], out, prefill)
    out = jnp.where(plan.valid[:, None, None, None], out, 0.0)
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)


def _decode(qf, plan: AttentionPlan, tn: WorkSplit, read_keys, scores, mask_value: float,
            sinks: jax.Array | None) -> jax.Array:
    """Per-token attention of the decode rows, as a flat list of (row, key block) items."""
    _, num_kv_heads, group, head_dim = qf.shape
    R, W, P = tn.decode_rows, tn.decode_items, tn.decode_block_kv
    total = plan.row_ends[-1]
    q_rows = qf[plan.row_token]  # [R, kvh, g, D]
    key_offsets = jnp.arange(P, dtype=jnp.int32)

    def body(i, carry):
        m, l, acc = carry  # [R, kvh, g], [R, kvh, g], [R, kvh, g, D]
        item = i * W + jnp.arange(W, dtype=jnp.int32)
        live = item < total
        row, j = _owner(plan.row_ends, item)
        blk = plan.row_first_blk[row] + j
        k, v = read_keys(plan.row_seq[row], blk * P, P)  # [W, P, kvh, D]
        key_pos = blk[:, None] * P + key_offsets  # [W, P]
        pos = plan.row_pos[row][:, None]
        visible = live[:, None] & (key_pos <= pos) & (key_pos >= _first_visible(pos, tn.sliding_window))
        v = jnp.where(visible[:, :, None, None], v, 0.0)  # 0 * NaN would poison the sum
        s = scores(jnp.einsum("wkgd,wpkd->wkgp", q_rows[row], k))
        s = jnp.where(visible[:, None, None, :], s, mask_value)
        m_item = s.max(axis=-1)  # [W, kvh, g]
        p = jnp.exp(s - m_item[..., None])
        l_item = p.sum(axis=-1)
        acc_item = jnp.einsum("wkgp,wpkd->wkgd", p, v)
        # Merge the items into their rows (several items may share a row).
        dest = jnp.where(live, row, R)  # dead items land out of range: dropped
        m_new = m.at[dest].max(m_item, mode="drop")
        alpha = jnp.exp(m - m_new)
        f = jnp.exp(m_item - m_new[row])
        l = (l * alpha).at[dest].add(l_item * f, mode="drop")
        acc = (acc * alpha[..., None]).at[dest].add(acc_item * f[..., None], mode="drop")
        return m_new, l, acc

    init = (
        jnp.full((R, num_kv_heads, group), mask_value, jnp.float32),
        jnp.zeros((R, num_kv_heads, group), jnp.float32),
        jnp.zeros((R, num_kv_heads, group, head_dim), jnp.float32),
    )
    m, l, acc = lax.fori_loop(0, _ceil_div(total, W), body, init)
    if sinks is not None:  # [kvh, g]
        l = l + sink_denominator(sinks, m)
    rows_out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    return rows_out[plan.decode_rank]


def _prefill(qf, plan: AttentionPlan, tn: WorkSplit, read_keys, scores, mask_value: float,
             sinks: jax.Array | None) -> jax.Array:
    """Query blocks of one sequence each, each walking its own keys once."""
    num_tokens, num_kv_heads, group, head_dim = qf.shape
    BQ, BK = tn.block_q, tn.block_kv
    # A sequence's last block reads rows past the end of q; pad so slices never clamp.
    q_pad = jnp.pad(qf, ((0, BQ), (0, 0), (0, 0), (0, 0)))
    rows = jnp.arange(BQ, dtype=jnp.int32)
    key_offsets = jnp.arange(BK, dtype=jnp.int32)

    def block_body(b, out):
        s, j = _owner(plan.block_ends, b)
        row0 = plan.cu[s] + j * BQ
        num_rows = jnp.minimum(BQ, plan.q_lens[s] - j * BQ)
        pos0 = plan.kv_lens[s] - plan.q_lens[s] + j * BQ
        last = pos0 + num_rows - 1
        pos = pos0 + jnp.minimum(rows, num_rows - 1)  # padding rows repeat the last row
        lo = _first_visible(pos, tn.sliding_window)
        # [kvh, g * BQ, D]: the whole GQA group of every row against one K block.
        qb = lax.dynamic_slice_in_dim(q_pad, row0, BQ).transpose(1, 2, 0, 3)
        qb = qb.reshape(num_kv_heads, group * BQ, head_dim)

        def kv_body(kb, carry):
            m, l, acc = carry  # [kvh, g*BQ], [kvh, g*BQ], [kvh, g*BQ, D]
            k, v = read_keys(s, kb * BK, BK)  # [BK, kvh, D]
            key_pos = kb * BK + key_offsets
            v = jnp.where((key_pos <= last)[:, None, None], v, 0.0)
            visible = (key_pos[None, :] <= pos[:, None]) & (key_pos[None, :] >= lo[:, None])
            sc = scores(jnp.einsum("kmd,pkd->kmp", qb, k)).reshape(num_kv_heads, group, BQ, BK)
            sc = jnp.where(visible, sc, mask_value).reshape(num_kv_heads, group * BQ, BK)
            m_new = jnp.maximum(m, sc.max(axis=-1))
            alpha = jnp.exp(m - m_new)
            p = jnp.exp(sc - m_new[..., None])
            l = alpha * l + p.sum(axis=-1)
            acc = alpha[..., None] * acc + jnp.einsum("kmp,pkd->kmd", p, v)
            return m_new, l, acc

        init = (
            jnp.full((num_kv_heads, group * BQ), mask_value, jnp.float32),
            jnp.zeros((num_kv_heads, group * BQ), jnp.float32),
            jnp.zeros((num_kv_heads, group * BQ, head_dim), jnp.float32),
        )
        m, l, acc = lax.fori_loop(jnp.min(lo) // BK, last // BK + 1, kv_body, init)
        if sinks is not None:  # [kvh, g] -> rows g-major, as qb's
            l = l + sink_denominator(jnp.repeat(sinks, BQ, axis=1), m)
        res = acc / jnp.where(l > 0, l, 1.0)[..., None]
        res = res.reshape(num_kv_heads, group, BQ, head_dim).transpose(2, 0, 1, 3)
        cur = lax.dynamic_slice_in_dim(out, row0, BQ)
        res = jnp.where((rows < num_rows)[:, None, None, None], res, cur)
        return lax.dynamic_update_slice_in_dim(out, res, row0, axis=0)

    out = jnp.zeros((num_tokens + BQ, num_kv_heads, group, head_dim), jnp.float32)
    out = lax.fori_loop(0, plan.block_ends[-1], block_body, out)
    return out[:num_tokens]


register_backend(
    "cpu",
    ragged_paged_attention,
    plan=make_plan,
    platforms=("cpu",),
    description="prefill: a C++/AVX-512 kernel over the cache in place (XLA loops of query "
                "blocks that read their keys once where it cannot); decode: a C++ kernel "
                "reading each token's own pages in place (the XLA loop of (token, key block) "
                "items where it cannot); the CPU serving path",
    # The first runs the rows through the C++ kernels, the second through the XLA loops.
    test_tuning=(CpuTuning(), CpuTuning(block_q=4, pages_per_block=1, decode_pages_per_block=1,
                                        decode_items=3, decode_kernel="xla",
                                        prefill_kernel="xla")),
    reads_kv_bits=True,
)
