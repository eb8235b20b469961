"""The rejection sampler (speculative decoding's verification) keeps the target
distribution: checked statistically over many seeds, beside the plain sampler."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxserve.worker.rejection_sampler import rejection_sample
from jaxserve.worker.sampler import SamplerMode, SamplingMetadata, sample

V = 24  # >= the sampler's top-N logprobs (20)
N = 20_000  # requests, each with one draft: 2 rows (verify the draft, then a bonus row)


def metadata(rows: int, **kw) -> SamplingMetadata:
    base = dict(
        temperature=np.ones(rows, np.float32), top_k=np.zeros(rows, np.int32),
        top_p=np.ones(rows, np.float32), min_p=np.zeros(rows, np.float32),
        repetition_penalty=np.ones(rows, np.float32), frequency_penalty=np.zeros(rows, np.float32),
        presence_penalty=np.zeros(rows, np.float32), seeds=np.zeros(rows, np.uint32),
        positions=np.zeros(rows, np.int32), min_tokens_end=np.zeros(rows, np.int32),
    )
    base.update({k: np.asarray(v, base[k].dtype) for k, v in kw.items()})
    return SamplingMetadata(**{k: jnp.asarray(v) for k, v in base.items()})


def target_probs(logits: np.ndarray, top_k: int = 0) -> np.ndarray:
    if top_k:
        logits = np.where(logits >= np.sort(logits)[-top_k], logits, -np.inf)
    p = np.exp(logits - logits.max())
    return p / p.sum()


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    assert counts[probs == 0].sum() == 0, "a token outside the target's support was emitted"
    expected = probs * counts.sum()
    big = expected >= 5  # the rare tokens pooled into one bin, as the test requires
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    return stats.chisquare(obs[exp > 0], exp[exp > 0]).pvalue


def verify_pairs(row0: np.ndarray, row1: np.ndarray, draft: int, top_k: int = 0):
    """N requests with draft `draft` at row 0 (target logits row0) and a bonus row (row1);
    seeds 0..N-1. Returns (tokens, emitted) of shape [N, 2]."""
    logits = jnp.asarray(np.stack([row0, row1] * N).astype(np.float32))
    seeds = np.repeat(np.arange(N), 2)
    positions = np.tile([10, 11], N)
    md = metadata(2 * N, seeds=seeds, positions=positions, top_k=np.full(2 * N, top_k))
    mode = SamplerMode.FILTERED if top_k else SamplerMode.RANDOM
    zeros = jnp.zeros((2 * N, V), jnp.int32)
    out = jax.jit(rejection_sample, static_argnums=(4,))(
        logits, zeros.astype(bool), zeros, md, mode, None,
        jnp.asarray(np.tile([draft, -1], N), jnp.int32),
        jnp.asarray(np.repeat(np.arange(0, 2 * N, 2), 2), jnp.int32))
    tokens, emitted = np.asarray(out.sampled).reshape(N, 2), np.asarray(out.emitted).reshape(N, 2)
    final = np.asarray(out.final).reshape(N, 2)
    assert emitted[:, 0].all()  # the first row always emits (its draft, or a resample)
    assert (final.sum(axis=1) == 1).all() and (final == (emitted & ~np.roll(emitted, -1, 1)) |
                                              (emitted & [False, True])).all()
    return tokens, emitted


@pytest.mark.parametrize("top_k", [0, 3])
def test_emitted_tokens_follow_the_target_distribution(top_k: int) -> None:
    rng = np.random.default_rng(1)
    row0, row1 = rng.normal(size=V) * 2, rng.normal(size=V) * 2
    p0, p1 = target_probs(row0, top_k), target_probs(row1, top_k)
    draft = int(np.argsort(p0)[-2])  # a plausible but not the likeliest token
    tokens, emitted = verify_pairs(row0, row1, draft, top_k)
    # The first token: the draft with probability p0(draft), else p0 without it: i.e. p0.
    first = np.bincount(tokens[:, 0], minlength=V)
    assert chi2_pvalue(first, p0) > 1e-4
    accepted = tokens[:, 0] == draft
    assert (emitted[:, 1] == accepted).all()  # the bonus row emits iff the draft was accepted
    assert abs(accepted.mean() - p0[draft]) < 4 * np.sqrt(p0[draft] * (1 - p0[draft]) / N)
    # After an accepted draft, the bonus token is an ordinary sample from p1.
    second = np.bincount(tokens[accepted, 1], minlength=V)
    assert chi2_pvalue(second, p1) > 1e-4


def test_a_draft_outside_top_k_is_always_rejected() -> None:
    row = np.arange(V, dtype=np.float32)  # token V-1 likeliest
    tokens, emitted = verify_pairs(row, row, draft=0, top_k=3)
    assert not emitted[:, 1].any() and (tokens[:, 0] >= V - 3).all()


def test_bonus_rows_draw_the_plain_samplers_token() -> None:
    rows = 64
    logits = jnp.asarray(np.random.default_rng(2).normal(size=(rows, V)).astype(np.float32))
    md = metadata(rows, seeds=np.arange(rows), positions=np.arange(rows) + 5)
    zeros = jnp.zeros((rows, V), jnp.int32)
    plain = sample(logits, zeros.astype(bool), zeros, md, SamplerMode.RANDOM)
    verified = rejection_sample(logits, zeros.astype(bool), zeros, md, SamplerMode.RANDOM, None,
                                jnp.full(rows, -1, jnp.int32), jnp.arange(rows, dtype=jnp.int32))
    np.testing.assert_array_equal(verified.sampled, plain.sampled)
    assert np.asarray(verified.final).all()


def test_greedy_accepts_the_argmax_prefix() -> None:
    # One request, 3 drafts: the argmax of each row is 1, 2, 3, 4.
    logits = np.full((4, V), -1.0, np.float32)
    logits[np.arange(4), [1, 2, 3, 4]] = 5.0
    zeros = jnp.zeros((4, V), jnp.int32)
    md = metadata(4, temperature=np.zeros(4))
    for drafts, want in [([1, 2, 3], [1, 2, 3, 4]), ([1, 7, 3], [1, 2]), ([0, 2, 3], [1])]:
        out = rejection_sample(jnp.asarray(logits), zeros.astype(bool), zeros, md,
                               SamplerMode.GREEDY, None, jnp.asarray([*drafts, -1], jnp.int32),
                               jnp.zeros(4, jnp.int32))
        emitted = np.asarray(out.emitted)
        assert np.asarray(out.sampled)[emitted].tolist() == want
        assert np.asarray(out.final).tolist() == [i == len(want) - 1 for i in range(4)]
