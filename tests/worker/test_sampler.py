"""The on-device sampler against a NumPy reference of vLLM's semantics."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.worker.penalty_state import LogitsProcessors
from jaxserve.worker.sampler import (
    SamplingMetadata,
    ThresholdSearch,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    largest_threshold,
    ordered_keys,
    sample,
)

R, V = 6, 50


def metadata(**kw) -> SamplingMetadata:
    base = dict(
        temperature=np.ones(R, np.float32), top_k=np.zeros(R, np.int32), top_p=np.ones(R, np.float32),
        min_p=np.zeros(R, np.float32), repetition_penalty=np.ones(R, np.float32),
        frequency_penalty=np.zeros(R, np.float32), presence_penalty=np.zeros(R, np.float32),
        seeds=np.arange(R, dtype=np.uint32), positions=np.zeros(R, np.int32),
        min_tokens_end=np.zeros(R, np.int32),
    )
    base.update({k: np.asarray(v, base[k].dtype if k in base else None) for k, v in kw.items()})
    return SamplingMetadata(**{k: jnp.asarray(v) for k, v in base.items()})


@pytest.fixture
def logits() -> np.ndarray:
    return np.random.default_rng(0).normal(size=(R, V)).astype(np.float32) * 3


def np_penalties(logits, prompt_mask, counts, rep, freq, pres):
    out = logits.copy()
    for r in range(R):
        for t in range(V):
            if prompt_mask[r, t] or counts[r, t] > 0:
                out[r, t] = out[r, t] / rep[r] if out[r, t] > 0 else out[r, t] * rep[r]
        out[r] -= freq[r] * counts[r] + pres[r] * (counts[r] > 0)
    return out


def np_top_k_top_p(logits, top_k, top_p):
    out = np.full_like(logits, -np.inf)
    for r in range(R):
        order = np.argsort(-logits[r], kind="stable")
        keep = order if top_k[r] <= 0 else order[: top_k[r]]
        p = np.exp(logits[r, keep] - logits[r, keep].max())
        p /= p.sum()
        before = np.cumsum(p) - p
        keep = keep[before < top_p[r]]
        out[r, keep] = logits[r, keep]
    return out


def np_min_p(logits, min_p):
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.where(p < min_p[:, None] * p.max(-1, keepdims=True), -np.inf, logits)


def test_penalties_match_numpy(logits) -> None:
    rng = np.random.default_rng(1)
    prompt_mask = rng.random((R, V)) < 0.2
    counts = rng.integers(0, 3, (R, V)) * (rng.random((R, V)) < 0.3)
    rep = np.array([1.0, 1.3, 0.8, 2.0, 1.0, 1.1], np.float32)
    freq = np.array([0.0, 0.5, -0.5, 1.0, 2.0, 0.0], np.float32)
    pres = np.array([0.0, 0.5, 1.0, -1.0, 0.0, 2.0], np.float32)
    md = metadata(repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres)
    got = apply_penalties(jnp.asarray(logits), jnp.asarray(prompt_mask), jnp.asarray(counts, jnp.int32), md)
    np.testing.assert_allclose(np.asarray(got), np_penalties(logits, prompt_mask, counts, rep, freq, pres), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("search", [ThresholdSearch(1, unrolled=False), ThresholdSearch(4)],
                         ids=["cpu", "device"])
def test_top_k_top_p_match_numpy(logits, search: ThresholdSearch) -> None:
    top_k = np.array([0, 1, 5, 0, 10, 3], np.int32)
    top_p = np.array([1.0, 1.0, 1.0, 0.5, 0.9, 0.3], np.float32)
    logits = logits.copy()
    logits[2, :7] = -np.inf  # masked by a processor before the filters
    got = np.asarray(apply_top_k_top_p(jnp.asarray(logits), jnp.asarray(top_k), jnp.asarray(top_p),
                                       search))
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(np_top_k_top_p(logits, top_k, top_p)))


@pytest.mark.parametrize("radix_bits,unrolled", [(1, False), (2, True), (4, True), (4, False)])
def test_largest_threshold_is_the_kth_largest_value(radix_bits: int, unrolled: bool) -> None:
    """Against a sort: negative and positive values, -inf, zeros of both signs, ties."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(4, 300)).astype(np.float32) * 50
    x[0, :40] = -np.inf
    x[1, ::3] = 1.5  # a tie of 100
    x[2, :50], x[2, 50:60] = 0.0, -0.0
    x[3] = np.round(x[3])
    k = np.array([1, 120, 55, 300], np.int32)
    t = largest_threshold(ordered_keys(jnp.asarray(x)), jnp.asarray(k),
                          search=ThresholdSearch(radix_bits, unrolled))
    want = np.sort(x, axis=-1)[:, ::-1][np.arange(4), k - 1]
    keys = np.asarray(ordered_keys(jnp.asarray(want)))
    np.testing.assert_array_equal(np.asarray(t), keys)


def test_min_p_matches_numpy(logits) -> None:
    min_p = np.array([0.0, 0.05, 0.1, 0.3, 0.9, 1.0], np.float32)
    got = np.asarray(apply_min_p(jnp.asarray(logits), jnp.asarray(min_p)))
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(np_min_p(logits, min_p)))


def test_greedy_rows_take_the_argmax_of_penalized_logits(logits) -> None:
    md = metadata(temperature=[0, 0, 1, 0, 1, 0], repetition_penalty=[1, 5, 1, 1, 1, 1])
    mask = np.zeros((R, V), bool)
    mask[1, logits[1].argmax()] = True  # penalize row 1's best token away
    out = sample(jnp.asarray(logits), jnp.asarray(mask), jnp.zeros((R, V), jnp.int32), md)
    s = np.asarray(out.sampled)
    for r in (0, 3, 5):
        assert s[r] == logits[r].argmax()
    assert s[1] != logits[1].argmax()


def test_sampled_tokens_respect_filters_and_follow_the_distribution() -> None:
    rng = np.random.default_rng(2)
    row = rng.normal(size=V).astype(np.float32)
    n = 4000
    logits = jnp.asarray(np.tile(row, (n, 1)))
    md = SamplingMetadata(
        temperature=jnp.full(n, 0.7), top_k=jnp.full(n, 8, jnp.int32), top_p=jnp.full(n, 0.95),
        min_p=jnp.zeros(n), repetition_penalty=jnp.ones(n), frequency_penalty=jnp.zeros(n),
        presence_penalty=jnp.zeros(n), seeds=jnp.full(n, 7, jnp.uint32), positions=jnp.arange(n, dtype=jnp.int32),
        min_tokens_end=jnp.zeros(n, jnp.int32),
    )
    out = jax.jit(sample)(logits, jnp.zeros((n, V), bool), jnp.zeros((n, V), jnp.int32), md)
    s = np.asarray(out.sampled)
    allowed = np.isfinite(np_top_k_top_p((row / 0.7)[None].repeat(R, 0), np.full(R, 8), np.full(R, 0.95))[0])
    assert allowed[s].all()
    p = np.where(allowed, np.exp(row / 0.7 - (row / 0.7).max()), 0)
    p /= p.sum()
    freq = np.bincount(s, minlength=V) / n
    assert np.abs(freq - p).max() < 0.03


def test_seeded_rows_do_not_depend_on_the_batch(logits) -> None:
    md = metadata(temperature=np.ones(R), seeds=[11] * R, positions=[5] * R)
    same_row = jnp.asarray(np.tile(logits[2], (R, 1)))
    out = sample(same_row, jnp.zeros((R, V), bool), jnp.zeros((R, V), jnp.int32), md)
    assert len(set(np.asarray(out.sampled).tolist())) == 1  # same seed+position -> same token
    # Different positions draw afresh: over 32 positions a flat-ish row cannot give one token.
    n = 32
    md = SamplingMetadata(**{**md.__dict__, "seeds": jnp.full(n, 11, jnp.uint32),
                             "positions": jnp.arange(n, dtype=jnp.int32),
                             **{k: jnp.resize(getattr(md, k), n) for k in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty", "min_tokens_end")}})
    flat = jnp.zeros((n, V))
    out = sample(flat, jnp.zeros((n, V), bool), jnp.zeros((n, V), jnp.int32), md)
    assert len(set(np.asarray(out.sampled).tolist())) > 1


def test_logprobs_report_the_raw_distribution(logits) -> None:
    md = metadata(temperature=np.zeros(R))
    out = sample(jnp.asarray(logits), jnp.zeros((R, V), bool), jnp.zeros((R, V), jnp.int32), md)
    ref = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(-1, keepdims=True)
    ids, lps, ranks = map(np.asarray, (out.logprob_token_ids, out.logprobs, out.sampled_ranks))
    np.testing.assert_array_equal(ids[:, 0], logits.argmax(-1))
    np.testing.assert_array_equal(ranks, 1)
    np.testing.assert_allclose(lps[:, 0], ref.max(-1), rtol=1e-5)
    np.testing.assert_array_equal(ids[:, 1:6], np.argsort(-logits, -1)[:, :5])


def test_min_tokens_masks_stop_ids_and_logit_bias_adds(logits) -> None:
    B = 4
    stop_mask = np.zeros((R, V), bool)
    stop_mask[:, 7] = stop_mask[:, 9] = True
    bias_ids = np.full((R, B), V, np.int32)  # V: unused entries
    bias_values = np.zeros((R, B), np.float32)
    bias_ids[1, :2], bias_values[1, :2] = [3, 4], [100.0, -5.0]
    bias_ids[2, 0], bias_values[2, 0] = 9, 100.0  # biased, but masked: still out
    # Rows 0-2 before min_tokens (position < end), rows 3-5 past it.
    md = metadata(temperature=np.zeros(R), positions=[4] * R, min_tokens_end=[5, 5, 5, 4, 0, 0])
    x = logits.copy()
    x[:, 7] = x[:, 9] = 50.0  # the stop ids would win greedy
    lp = LogitsProcessors(jnp.asarray(stop_mask), jnp.asarray(bias_ids), jnp.asarray(bias_values))
    out = sample(jnp.asarray(x), jnp.zeros((R, V), bool), jnp.zeros((R, V), jnp.int32), md,
                 processors=lp)
    expect = x.copy()
    expect[:3, 7] = expect[:3, 9] = -np.inf
    expect[1, 3] += 100.0
    expect[1, 4] -= 5.0
    np.testing.assert_array_equal(np.asarray(out.sampled), expect.argmax(-1))
    assert np.asarray(out.sampled)[1] == 3 and np.asarray(out.sampled)[3] in (7, 9)
    # Logprobs stay the model's own (before processors), as vLLM's raw logprobs.
    raw = np.asarray(jax.nn.log_softmax(jnp.asarray(x), axis=-1))
    np.testing.assert_allclose(np.asarray(out.logprobs)[:, 1:], np.sort(raw, -1)[:, ::-1][:, :20],
                               rtol=1e-5, atol=1e-5)


def test_banned_tokens_and_bad_words_against_a_reference(logits) -> None:
    """The worker's tables (admit_inputs) and the sampler's check, against vLLM's rule: a bad
    word's last token is banned where the output so far ends with the rest of it."""
    from jaxserve.worker.penalty_state import admit_inputs, with_sampled

    words = [(5,), (11, 12), (20, 21, 22)]
    outputs = [[], [11], [20, 21], [1, 20, 21], [21], [3]]  # each row's output so far
    allowed = [None, None, None, None, [12, 22, 30], None]
    tables = [admit_inputs(8, V, [1], out, (), (), allowed[i], words) for i, out in enumerate(outputs)]
    *_, allowed_ids, any_allowed, banned, prefixes, last, recent = zip(*tables)
    banned_mask = np.zeros((R, V), bool)
    for i in range(R):
        if not any_allowed[i]:
            banned_mask[i] = ~np.isin(np.arange(V), allowed_ids[i])
        banned_mask[i, [t for t in banned[i] if t < V]] = True
    lp = LogitsProcessors(jnp.zeros((R, V), bool), jnp.full((R, 1), V, jnp.int32),
                          jnp.zeros((R, 1), jnp.float32), banned_mask=jnp.asarray(banned_mask),
                          bad_prefixes=jnp.asarray(np.stack(prefixes)),
                          bad_last=jnp.asarray(np.stack(last)), recent=jnp.asarray(np.stack(recent)))
    x = logits.copy()
    x[:, [5, 12, 22]] = 60.0, 50.0, 40.0  # the bad words' last tokens would win greedy
    out = sample(jnp.asarray(x), jnp.zeros((R, V), bool), jnp.zeros((R, V), jnp.int32),
                 metadata(temperature=np.zeros(R)), processors=lp)
    expect = x.copy()
    for i, past in enumerate(outputs):
        if allowed[i] is not None:
            expect[i, ~np.isin(np.arange(V), allowed[i])] = -np.inf
        for w in words:
            if len(w) - 1 <= len(past) and tuple(past[len(past) - len(w) + 1:]) == w[:-1]:
                expect[i, w[-1]] = -np.inf
    np.testing.assert_array_equal(np.asarray(out.sampled), expect.argmax(-1))
    assert np.asarray(out.sampled).tolist()[:4] == [12, 22, 12, 12]  # 5 always out; 12 after 11
    # The window moves on with each sampled token (rows that sampled).
    rec = with_sampled(jnp.asarray(np.stack(recent)), jnp.arange(R), jnp.arange(R),
                       out.sampled, jnp.asarray([True] * 5 + [False]))
    assert np.asarray(rec)[1, -2:].tolist() == [11, int(out.sampled[1])]
    assert np.asarray(rec)[5].tolist() == list(np.stack(recent)[5])


def test_first_argmax_is_argmax_with_ties_and_masked_rows() -> None:
    from jaxserve.worker.sampler import first_argmax

    rng = np.random.default_rng(5)
    x = rng.integers(0, 4, size=(64, 300)).astype(np.float32)  # many ties
    x[3] = -np.inf  # a fully masked row
    x[7, 10:] = -np.inf
    np.testing.assert_array_equal(np.asarray(jax.jit(first_argmax)(jnp.asarray(x))), x.argmax(-1))


def test_two_level_top_k_is_exact() -> None:
    """top_logits equals jax.lax.top_k, ties (lower index first) and -inf entries included,
    whether the top entries share a chunk or not."""
    from jaxserve.worker.sampler import top_logits

    rng = np.random.default_rng(6)
    x = rng.integers(0, 6, size=(32, 1000)).astype(np.float32)  # many ties
    x[1] = rng.normal(size=1000)
    x[2, :] = -np.inf
    x[2, 900:] = rng.normal(size=100)  # everything in the last (padded) chunks
    x[3, 5:30] = 99.0  # the top 20 inside one chunk
    x[4] = -np.inf  # nothing finite
    for k in (1, 20):
        vals, ids = jax.jit(top_logits, static_argnums=1)(jnp.asarray(x), k)
        want_vals, want_ids = jax.lax.top_k(jnp.asarray(x), k)
        np.testing.assert_array_equal(vals, want_vals)
        np.testing.assert_array_equal(np.asarray(ids)[[0, 1, 3]], np.asarray(want_ids)[[0, 1, 3]])
        finite = np.isfinite(np.asarray(want_vals))
        np.testing.assert_array_equal(np.asarray(ids)[finite], np.asarray(want_ids)[finite])


def test_penalties_apply_when_one_row_has_one(logits) -> None:
    """A penalty changes the row that has it and no other."""
    counts = np.zeros((R, V), np.int32)
    top = logits.argmax(-1)
    counts[np.arange(R), top] = 3
    args = (jnp.asarray(logits), jnp.zeros((R, V), bool), jnp.asarray(counts))
    plain = jax.jit(sample)(*args, metadata(temperature=np.zeros(R)))
    np.testing.assert_array_equal(plain.sampled, top)
    pen = jax.jit(sample)(*args, metadata(temperature=np.zeros(R),
                                          frequency_penalty=[0, 0, 100.0, 0, 0, 0]))
    s = np.asarray(pen.sampled)
    assert s[2] != top[2] and (np.delete(s, 2) == np.delete(top, 2)).all()


def test_inverse_cdf_sample_follows_the_distribution_over_chunks() -> None:
    """A vocabulary over several chunks (not a multiple of one), masked tokens and whole
    masked chunks: the draws follow softmax, the ends of [0, 1) land on the first and last
    tokens with mass, and a masked token is never drawn."""
    from jaxserve.worker.sampler import inverse_cdf_sample

    vocab, n = 1300, 20_000
    rng = np.random.default_rng(9)
    row = rng.normal(scale=2.0, size=vocab).astype(np.float32)
    row[:3] = -np.inf
    row[600:1100] = -np.inf  # a masked stretch: all of chunk 1 (512..1023) but its start
    row[-1] = -np.inf
    p = np.where(np.isfinite(row), np.exp(row - row[np.isfinite(row)].max()), 0.0)
    p /= p.sum()
    u = (np.arange(n) + 0.5) / n  # evenly spread: the draws are the quantiles
    got = np.asarray(jax.jit(inverse_cdf_sample)(jnp.asarray(np.tile(row, (n, 1))),
                                                   jnp.asarray(u, jnp.float32)))
    assert np.isfinite(row[got]).all()
    freq = np.bincount(got, minlength=vocab) / n
    assert np.abs(freq - p).max() < 2e-3
    ends = np.asarray(inverse_cdf_sample(jnp.asarray(np.tile(row, (2, 1))),
                                         jnp.asarray([0.0, np.nextafter(1.0, 0.0)], jnp.float32)))
    assert ends.tolist() == [3, vocab - 2]


def test_logprobs_are_skipped_only_when_no_row_asks(logits) -> None:
    """A step where no request asks for logprobs skips their passes over the vocabulary (zeros
    come back, never read); one asking row brings every row's real values, as with None."""
    prompt_mask, counts = np.zeros((R, V), bool), np.zeros((R, V), np.int32)
    run = jax.jit(lambda md: sample(jnp.asarray(logits), prompt_mask, counts, md))
    every = run(metadata(temperature=np.zeros(R)))
    none = run(metadata(temperature=np.zeros(R), logprobs=np.zeros(R, bool)))
    one = run(metadata(temperature=np.zeros(R), logprobs=np.eye(1, R, 2, dtype=bool)[0]))
    np.testing.assert_array_equal(none.sampled, every.sampled)
    assert not np.asarray(none.logprobs).any() and not np.asarray(none.sampled_ranks).any()
    want = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(every.logprobs)[:, 1],
                               np.sort(want, axis=-1)[:, -1], rtol=1e-5)
    for field in ("logprob_token_ids", "logprobs", "sampled_ranks"):
        np.testing.assert_array_equal(getattr(one, field), getattr(every, field))
