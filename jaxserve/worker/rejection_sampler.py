"""Verifying draft tokens on device (vLLM's RejectionSampler, for drafts with no
distribution of their own, such as n-gram proposals).

A request with drafts d1..dk has k + 1 rows: row j holds the target distribution p_j of
the token after d_j (row 0: after the request's last token). Row j accepts d_{j+1}
with probability p_j(d_{j+1}) (greedy: iff it is the argmax); the first rejected row
emits a token drawn from p_j with d_{j+1} taken out, renormalized; if every draft
is accepted, the last row (no draft) emits an ordinary sample. This is speculative
sampling with a one-hot draft distribution q: accept min(1, p/q) = p(d), resample from
(p - q)+, so every emitted token is distributed exactly as without speculation.

    rows      r0    r1    r2    r3(bonus)
    drafts    d1    d2    d3    -
    accepted  yes   yes   no    -
    emitted   d1    d2    x~p2(.|not d3)          3 tokens from one forward

Random rows use the same per-(seed, position) key as the plain sampler: a bonus row
draws exactly the token `sample` would.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve.worker.penalty_state import LogitsProcessors
from jaxserve.worker.sampler import (
    DEFAULT_SEARCH,
    SamplerMode,
    SamplerOutput,
    SamplingMetadata,
    ThresholdSearch,
    first_argmax,
    inverse_cdf_sample,
    processed_logits,
    scaled_logits,
    with_logprobs,
)


def rejection_sample(
    logits: jax.Array,  # f32[R, V]
    prompt_mask: jax.Array | None,  # bool[R, V]; None with output_counts: no penalties
    output_counts: jax.Array | None,  # i32[R, V]
    md: SamplingMetadata,
    mode: SamplerMode,
    processors: LogitsProcessors | None,
    draft_ids: jax.Array,  # i32[R]: the draft this row verifies; -1: none (a request's last row)
    group_first: jax.Array,  # i32[R]: index of the first row of this row's request
    search: ThresholdSearch = DEFAULT_SEARCH,  # top-k / top-p's (sampler.largest_threshold)
) -> SamplerOutput:
    """One emitted-or-not token per row; `emitted` marks each request's accepted drafts
    and its final token, `final` the final token's row."""
    raw_logits = logits
    logits = processed_logits(logits, prompt_mask, output_counts, md, processors)
    target = first_argmax(logits)
    accepted = draft_ids == target
    if mode is not SamplerMode.GREEDY:
        scaled = scaled_logits(logits, md, mode, search)
        keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(md.seeds, md.positions)
        plain = inverse_cdf_sample(scaled, jax.vmap(jax.random.uniform)(keys))
        has_draft = draft_ids >= 0
        probs = jax.nn.softmax(scaled, axis=-1)
        p_draft = jnp.take_along_axis(probs, jnp.maximum(draft_ids, 0)[:, None], axis=-1)[:, 0]
        u = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, 1)))(keys)
        vocab = jnp.arange(logits.shape[-1])[None, :]
        residual = jnp.where(vocab == draft_ids[:, None], -jnp.inf, scaled)
        recovered = inverse_cdf_sample(
            residual, jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, 2)))(keys))
        is_greedy = md.temperature <= 0.0
        target = jnp.where(is_greedy, target,
                           jnp.where(has_draft, recovered, plain).astype(jnp.int32))
        accepted = jnp.where(is_greedy, accepted, u < p_draft)
    accepted &= draft_ids >= 0
    # A row is emitted iff every earlier row of its request accepted its draft.
    rejected = (~accepted).astype(jnp.int32)
    rejected_before = jnp.cumsum(rejected) - rejected
    emitted = rejected_before == rejected_before[group_first]
    final = emitted & ~accepted
    tokens = jnp.where(final, target, jnp.maximum(draft_ids, 0))
    return dataclasses.replace(with_logprobs(raw_logits, tokens, md.logprobs), emitted=emitted,
                               final=final)
