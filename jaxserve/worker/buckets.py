"""Compiled shape buckets: the stand-in for vLLM's CUDA graphs.

Every step pads its token count up to a bucket (powers of two from 16 up to
`max_num_batched_tokens`) and its sampled-request count up to a request bucket
(powers of two up to `max_num_seqs`), so a handful of programs compiled at
start-up serve every step.

On the CPU the token buckets start at 1: there a step is compute-bound, and a
single decode padded to 16 tokens costs several times one at 1 (XLA's CPU
matrix-vector product is its fastest matmul; docs/benchmarks.md, "Figures behind
choices in the code"). A 1-token step once took seconds: XLA turned the one-row KV scatter
into a dynamic-update-slice that copied the whole cache (see kernels_pallas/kv_cache.py).
"""

from __future__ import annotations

import bisect


def power_of_two_buckets(smallest: int, largest: int) -> tuple[int, ...]:
    """smallest, 2*smallest, ... and `largest` itself (which need not be a power of two)."""
    out: list[int] = []
    b = smallest
    while b < largest:
        out.append(b)
        b *= 2
    out.append(largest)
    return tuple(out)


MIN_TOKEN_BUCKET = 16
MIN_TOKEN_BUCKET_CPU = 1


def token_buckets(max_num_batched_tokens: int, smallest: int = MIN_TOKEN_BUCKET) -> tuple[int, ...]:
    return power_of_two_buckets(min(smallest, max_num_batched_tokens), max_num_batched_tokens)


def request_buckets(max_num_seqs: int) -> tuple[int, ...]:
    return power_of_two_buckets(1, max_num_seqs)


def verify_buckets(max_verify_rows: int) -> tuple[int, ...]:
    """The verification sampler's row buckets: a step with drafts has at least two rows (a
    request's draft and its bonus row), so none of 1."""
    return power_of_two_buckets(min(2, max_verify_rows), max_verify_rows)


def pad_to_bucket(n: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket >= n; raises if n exceeds the largest."""
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]
