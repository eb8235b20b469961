"""Ragged paged attention in plain `jax.numpy`: the CPU serving path and the test oracle.

One call serves a mixed batch: prefill chunks and decodes side by side, delimited by
`cu_q_lens`. Every other backend has this exact signature and is tested against this file.

Layout (page_size = 4, two sequences, the second one decoding)::

    q          [num_tokens, num_q_heads, head_dim]     tokens: | s0 s0 s0 | s1 | pad pad |
    cu_q_lens  int32[max_num_seqs + 1]                  [0, 3, 4, (ignored past num_seqs)]
    kv_lens    int32[max_num_seqs]                      [3, 6, ...]  (context incl. this step)
    page_indices int32[max_num_seqs, pages_per_seq]     s0 -> [7, x], s1 -> [2, 9]
    kv_pages   [num_pages, page_size, 2*num_kv_heads, head_dim]
                                   slot 2h = key of kv head h, slot 2h+1 = its value

    s1:   page 2: | k0 k1 k2 k3 |  page 9: | k4 k5 .  . |
          its single query token sits at position kv_len - q_len + 0 = 5 and sees k0..k5.

Query token i of sequence s sits at position `kv_lens[s] - q_len_s + i` and attends causally
to keys 0..position. q head j reads kv head `j // (num_q_heads // num_kv_heads)` (GQA).
Rows past `cu_q_lens[num_seqs]` are padding and come back as zeros.

Why the loop: the CPU path must stay memory-lean, so instead of gathering each token's whole
context (`[num_tokens, max_kv_len, ...]`) we run an online softmax over page positions j.
Iteration j gathers page j of every token's own sequence (`[num_tokens, page_size, 2*kvh, D]`)
and folds it into float32 running max / sum / accumulator. The trip count is data: the
largest number of pages any real sequence uses, so a batch of short sequences stays cheap
under one compiled shape.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from kernels_pallas.kv_cache import kv_cache_values
from kernels_pallas.registry import AttentionSpec, VariantPlan, register_backend


@dataclasses.dataclass(frozen=True)
class ReferenceTuning:
    """`pages_per_step` pages are folded in per loop iteration (None: about 64 keys while the
    per-step gather stays small; fewer, larger steps run faster on the CPU)."""

    pages_per_step: int | None = None

    def __post_init__(self) -> None:
        if self.pages_per_step is not None and self.pages_per_step < 1:
            raise ValueError(f"ReferenceTuning.pages_per_step must be >= 1 or None, got "
                             f"{self.pages_per_step}")


def gqa_layout(q: jax.Array, kv_pages: jax.Array) -> tuple[int, int]:
    """(num_kv_heads, q heads per kv head) of a q / cache pair; ValueError if they disagree."""
    _, num_q_heads, head_dim = q.shape
    num_kv_slots, head_dim_kv = kv_pages.shape[2:]
    num_kv_heads = num_kv_slots // 2
    if head_dim_kv != head_dim or num_kv_slots % 2 or num_q_heads % max(num_kv_heads, 1):
        raise ValueError(
            f"q {q.shape} and kv_pages {kv_pages.shape} disagree: expected kv_pages "
            f"[num_pages, page_size, 2 * num_kv_heads, {head_dim}] with num_q_heads "
            f"({num_q_heads}) a multiple of num_kv_heads"
        )
    return num_kv_heads, num_q_heads // num_kv_heads


def sink_denominator(sinks: jax.Array, m: jax.Array) -> jax.Array:
    """A sink's share of the softmax denominator, exp(sink - m), in the running max m's units
    (`sinks` broadcast against `m`). Added to the final sum it equals starting the online
    softmax at max = sink, sum = 1, acc = 0 (vLLM's kernels): the sink takes its share of the
    weight and contributes no value. A row that saw nothing has m = the mask value: its
    exp overflows to inf and its output to 0."""
    return jnp.exp(sinks.astype(jnp.float32) - m)


def no_sinks(kernel: Callable[..., Any], position: int) -> Callable[..., Any]:
    """A Pallas kernel body for calls without sinks: its refs with None in the sinks ref's
    `position` (the kernel then skips them)."""
    def run(*refs: Any, **static: Any) -> Any:
        return kernel(*refs[:position], None, *refs[position:], **static)
    return run


def token_metadata(
    kv_lens: jax.Array,  # int32[max_num_seqs]
    cu_q_lens: jax.Array,  # int32[max_num_seqs + 1]
    num_seqs: jax.Array,  # int32[1]
    num_tokens: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Map each query row to (its sequence, its position, whether it is real).

    Returns `seq_ids int32[num_tokens]` (clipped into range for padding rows),
    `positions int32[num_tokens]` and `valid bool[num_tokens]`.
    """
    max_num_seqs = kv_lens.shape[0]
    n = num_seqs[0]
    # Entries of cu_q_lens past num_seqs are unspecified; flatten them to the total so
    # the array is sorted and searchsorted is well defined.
    total = cu_q_lens[n]
    cu = jnp.where(jnp.arange(max_num_seqs + 1) <= n, cu_q_lens, total)
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    # side="right" puts a token on the last sequence whose start is <= t, which also
    # skips sequences with q_len == 0.
    seq_ids = jnp.searchsorted(cu[1:], t, side="right").astype(jnp.int32)
    seq_ids = jnp.minimum(seq_ids, max_num_seqs - 1)
    valid = t < total
    q_start = cu[seq_ids]
    q_len = cu[seq_ids + 1] - q_start
    positions = kv_lens[seq_ids] - q_len + (t - q_start)
    return seq_ids, positions, valid


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
    tuning: ReferenceTuning | None = None,
) -> jax.Array:
    """Ragged paged attention; see the module docstring for the layout.

    `spec` is what it computes (kernels_pallas/registry.py: window, soft cap, k / v scales,
    `kv_cache_dtype` of a cache holding bits); `sinks` (float32 [num_q_heads], GPT-OSS's
    attention sinks) are one learned logit per q head that joins every row's softmax
    denominator and has no value (`sink_denominator`). `plan` and `interpret` are ignored
    (no plan; plain jax.numpy). Returns `[num_tokens, num_q_heads, head_dim]` in `q.dtype`,
    zeros on padding rows.
    """
    del plan, interpret
    sm_scale, sliding_window, soft_cap = spec.sm_scale, spec.sliding_window, spec.soft_cap
    k_scale, v_scale, mask_value = spec.k_scale, spec.v_scale, spec.mask_value
    kv_cache_dtype = spec.kv_cache_dtype
    pages_per_step = (tuning or ReferenceTuning()).pages_per_step
    q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs = map(
        jnp.asarray, (q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs))
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_slots, _ = kv_pages.shape
    num_kv_heads, group = gqa_layout(q, kv_pages)
    pages_per_seq = page_indices.shape[1]
    if pages_per_step is None:
        # ~64 keys per step, but keep the gathered [T, keys, 2*kvh, D] block under ~4M values.
        budget = max(1, (1 << 22) // (num_tokens * page_size * num_kv_slots * head_dim))
        pages_per_step = max(1, min(64 // page_size, budget, pages_per_seq))
    n = pages_per_step
    block_k = n * page_size

    seq_ids, positions, valid = token_metadata(kv_lens, cu_q_lens, num_seqs, num_tokens)

    # Scale q once, in float32, grouped by the kv head it reads: [T, kvh, group, D].
    qf = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim) * sm_scale
    # [num_pages, page_size, kvh, 2, D]: k at [..., 0, :], v at [..., 1, :].
    kv_view = kv_pages.reshape(kv_pages.shape[0], page_size, num_kv_heads, 2, head_dim)
    # [T, pages_per_seq (+ pad to a multiple of n)]: small, int32. Pad entries point at the
    # null page; the keys they hold are past kv_len and masked.
    token_pages = page_indices[seq_ids]
    token_pages = jnp.pad(token_pages, ((0, 0), (0, -pages_per_seq % n)))

    # Loop bounds are data. Upper: the most pages any real sequence holds.
    real_seq = jnp.arange(kv_lens.shape[0]) < num_seqs[0]
    seq_pages = jnp.where(real_seq, (kv_lens + page_size - 1) // page_size, 0)
    end_step = (jnp.minimum(jnp.max(seq_pages), pages_per_seq) + n - 1) // n
    # Lower: with a sliding window, pages wholly before every real token's window.
    if sliding_window is not None:
        window_start = jnp.maximum(positions - sliding_window + 1, 0)
        first_key = jnp.where(valid, window_start, positions.max())
        start_step = jnp.min(first_key) // block_k
    else:
        start_step = jnp.int32(0)

    slot = jnp.arange(block_k, dtype=jnp.int32)

    def body(j, carry):
        m, l, acc = carry  # [T, kvh, g], [T, kvh, g], [T, kvh, g, D]
        pages = jax.lax.dynamic_slice_in_dim(token_pages, j * n, n, axis=1)  # [T, n]
        kv = kv_cache_values(kv_view[pages], kv_cache_dtype)
        kv = kv.reshape(num_tokens, block_k, num_kv_heads, 2, head_dim)
        k = kv[:, :, :, 0, :].astype(jnp.float32)
        v = kv[:, :, :, 1, :].astype(jnp.float32)
        if k_scale is not None:
            k = k * k_scale
        if v_scale is not None:
            v = v * v_scale
        key_pos = j * block_k + slot  # [block_k]
        visible = key_pos[None, :] <= positions[:, None]  # [T, block_k]
        if sliding_window is not None:
            visible &= key_pos[None, :] > positions[:, None] - sliding_window
        # Unused slots may hold anything, NaN included; 0 * NaN is NaN, so zero the values.
        v = jnp.where(visible[:, :, None, None], v, 0.0)
        s = jnp.einsum("tkgd,tpkd->tkgp", qf, k)
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        s = jnp.where(visible[:, None, None, :], s, mask_value)
        m_new = jnp.maximum(m, s.max(axis=-1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[..., None])
        l = alpha * l + p.sum(axis=-1)
        acc = alpha[..., None] * acc + jnp.einsum("tkgp,tpkd->tkgd", p, v)
        return m_new, l, acc

    init = (
        jnp.full((num_tokens, num_kv_heads, group), mask_value, jnp.float32),
        jnp.zeros((num_tokens, num_kv_heads, group), jnp.float32),
        jnp.zeros((num_tokens, num_kv_heads, group, head_dim), jnp.float32),
    )
    # fori_loop with traced bounds lowers to a while_loop: one compiled body, data trip count.
    m, l, acc = jax.lax.fori_loop(start_step, end_step, body, init)
    if sinks is not None:
        l = l + sink_denominator(sinks.reshape(num_kv_heads, group), m)
    # Every real token sees at least itself, so l >= 1 there; guard only the padding rows.
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    out = jnp.where(valid[:, None, None, None], out, 0.0)
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)


register_backend(
    "reference",
    ragged_paged_attention,
    platforms=("cpu", "cuda", "tpu"),
    description="plain jax.numpy online softmax over pages; the CPU path and the oracle",
    reads_kv_bits=True,
)
