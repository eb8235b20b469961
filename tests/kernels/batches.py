"""Random ragged batches over a NaN-poisoned paged cache, and a naive NumPy oracle.

Every slot that holds no real context (unused pages, the tail of a last page, the null page 0)
is NaN, so a kernel that reads past a sequence's kv_len, or through a stale page-table entry,
turns its output NaN and fails the comparison.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class Batch:
    q: np.ndarray  # [num_tokens, num_q_heads, head_dim]
    kv_pages: np.ndarray  # [num_pages, page_size, 2 * num_kv_heads, head_dim]
    kv_lens: np.ndarray  # int32[max_num_seqs]
    page_indices: np.ndarray  # int32[max_num_seqs, pages_per_seq]
    cu_q_lens: np.ndarray  # int32[max_num_seqs + 1]
    num_seqs: np.ndarray  # int32[1]
    seqs: list[tuple[int, int]]  # (q_len, kv_len) of the real sequences

    @property
    def args(self) -> tuple[np.ndarray, ...]:
        return (self.q, self.kv_pages, self.kv_lens, self.page_indices, self.cu_q_lens,
                self.num_seqs)

    @property
    def num_real_tokens(self) -> int:
        return int(self.cu_q_lens[self.num_seqs[0]])


def make_batch(
    seqs: list[tuple[int, int]],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype=np.float32,
    num_tokens: int | None = None,
    max_num_seqs: int | None = None,
    pages_per_seq: int | None = None,
    extra_pages: int = 3,
    seed: int = 0,
) -> Batch:
    """A batch of sequences given as (q_len, kv_len), pages placed at random.

    Padding is deliberately hostile: entries of cu_q_lens / kv_lens / page_indices past the
    real sequences hold junk, padding query rows hold large values.
    """
    rng = np.random.default_rng(seed)
    assert all(1 <= kv and 0 <= q <= kv for q, kv in seqs), seqs
    total_q = sum(q for q, _ in seqs)
    num_tokens = num_tokens or total_q + 3
    max_num_seqs = max_num_seqs or len(seqs) + 2
    need = [-(-kv // page_size) for _, kv in seqs]
    pages_per_seq = pages_per_seq or max(need) + 1
    num_pages = 1 + sum(need) + extra_pages  # page 0 is the null page
    assert num_tokens >= total_q and max_num_seqs >= len(seqs) and pages_per_seq >= max(need)

    kv_pages = np.full((num_pages, page_size, 2 * num_kv_heads, head_dim), np.nan, np.float32)
    free = rng.permutation(np.arange(1, num_pages))
    # Junk table entries, some out of range: a kernel must never follow an unused entry.
    page_indices = rng.integers(0, 2 * num_pages, (max_num_seqs, pages_per_seq)).astype(np.int32)
    kv_lens = rng.integers(1, pages_per_seq * page_size + 1, max_num_seqs).astype(np.int32)
    cu_q_lens = np.zeros(max_num_seqs + 1, np.int32)  # junk past num_seqs: zeros
    for s, (q_len, kv_len) in enumerate(seqs):
        pages, free = free[: need[s]], free[need[s]:]
        page_indices[s, : need[s]] = pages
        for i in range(kv_len):
            kv_pages[pages[i // page_size], i % page_size] = rng.standard_normal(
                (2 * num_kv_heads, head_dim))
        kv_lens[s] = kv_len
        cu_q_lens[s + 1] = cu_q_lens[s] + q_len
    q = rng.standard_normal((num_tokens, num_q_heads, head_dim)).astype(np.float32)
    q[total_q:] = 1e4  # padding rows: must not matter
    # Round through the test dtype so the oracle sees exactly what the kernel sees.
    q = q.astype(dtype)
    kv_pages = kv_pages.astype(dtype)
    return Batch(q, kv_pages, kv_lens, page_indices, cu_q_lens,
                 np.array([len(seqs)], np.int32), list(seqs))


def naive_attention(batch: Batch, *, sm_scale: float, sliding_window: int | None = None,
                    soft_cap: float | None = None, sinks: np.ndarray | None = None) -> np.ndarray:
    """Per-sequence, per-token attention in float64: the oracle. Padding rows are zeros.
    `sinks` [num_q_heads]: as GPT-OSS's transformers code has them, one more logit column
    in each head's softmax, dropped before the values."""
    q = np.asarray(batch.q, np.float64)
    kv = np.asarray(batch.kv_pages, np.float64)
    num_tokens, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = kv.shape[1], kv.shape[2] // 2
    group = num_q_heads // num_kv_heads
    out = np.zeros_like(q)
    for s, (q_len, kv_len) in enumerate(batch.seqs):
        pages = batch.page_indices[s, : -(-kv_len // page_size)]
        ctx = kv[pages].reshape(-1, 2 * num_kv_heads, head_dim)[:kv_len]
        k, v = ctx[:, 0::2], ctx[:, 1::2]  # [kv_len, kvh, D]
        start = batch.cu_q_lens[s]
        for i in range(q_len):
            pos = kv_len - q_len + i
            lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            for h in range(num_q_heads):
                scores = k[lo: pos + 1, h // group] @ q[start + i, h] * sm_scale
                if soft_cap is not None:
                    scores = soft_cap * np.tanh(scores / soft_cap)
                if sinks is not None:
                    scores = np.append(scores, sinks[h])
                p = np.exp(scores - scores.max())
                p = p / p.sum()
                out[start + i, h] = p[: pos + 1 - lo] @ v[lo: pos + 1, h // group]
    return out


def tolerance(dtype) -> dict[str, float]:
    if np.dtype(dtype) == np.float32:
        return dict(atol=2e-5, rtol=2e-5)
    return dict(atol=3e-2, rtol=3e-2)
