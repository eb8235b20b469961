"""On-device sampler: logits -> one token per request, in vLLM's order.

    raw logits ─┬─▶ log-sum-exp ─▶ logprobs of the sampled token and the top-N
                └─▶ min_tokens (EOS and stop ids masked) ─▶ grammar bitmask
                    ─▶ allowed_token_ids and bad_words ─▶ logit_bias
                    ─▶ penalties (repetition over prompt+output, frequency/presence
                    over output) ─▶ greedy argmax (temperature 0)
                    ─▶ temperature ─▶ min-p ─▶ top-k ─▶ top-p ─▶ random sample

Every parameter is a per-row array, so one compiled program serves any mix of
requests. Random rows draw (inverse CDF, one uniform each) from
`fold_in(key(seed), position)`, where position is the index of the token being
sampled in its sequence: the same seed gives the same tokens whatever else is
in the batch and however the steps fall.

Which stages run is a static `SamplerMode` the host picks per step from the
batch's parameters (as vLLM's `all_greedy` / `no_top_k` flags do), so the
compiled program has no data-dependent branch: a greedy batch never pays for
random draws, and only a batch with top-k / top-p / min-p pays for the filters.
Likewise the logits processors and penalties run only in a step where some row
has one (`needs_processors`, vLLM's `no_penalties`): each is a pass over a
[rows, vocab] array and a gather of per-slot [vocab] state.
Logprobs are computed for every row of every step (a variant without them would
double the sampler programs, and their compile time on TPUs); `top_logits`
finds the top-N in two levels, so they cost little more than one log-sum-exp.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxserve.sampling_params import MAX_LOGPROBS  # top-N returned at most
from jaxserve.worker.penalty_state import ANY_TOKEN, LogitsProcessors

_NEG_INF = -jnp.inf


class SamplerMode(enum.Enum):
    """The stages one step's batch needs (a static argument of the sampler)."""

    GREEDY = "greedy"  # every row has temperature 0
    RANDOM = "random"  # some rows sample; no top-k, top-p or min-p anywhere
    FILTERED = "filtered"  # some rows sample with top-k, top-p or min-p

    @classmethod
    def for_batch(cls, temperature, top_k, top_p, min_p) -> SamplerMode:
        """From the real rows' host (NumPy) parameters."""
        if not (temperature > 0).any():
            return cls.GREEDY
        sampling = temperature > 0
        if ((top_k > 0) | (top_p < 1.0) | (min_p > 0))[sampling].any():
            return cls.FILTERED
        return cls.RANDOM


def needs_processors(repetition_penalty, frequency_penalty, presence_penalty, min_tokens_end,
                     positions, has_processors) -> bool:
    """Whether some row of a step needs the logits processors or penalties, from the real
    rows' host (NumPy) parameters; `has_processors`: the row's request has a logit_bias,
    allowed_token_ids or bad_words (min_tokens is read from its end position)."""
    return bool((repetition_penalty != 1.0).any() or (frequency_penalty != 0.0).any()
                or (presence_penalty != 0.0).any() or (positions < min_tokens_end).any()
                or has_processors.any())


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplingMetadata:
    """Per-row sampling parameters, all of shape [R]."""

    temperature: jax.Array  # f32; 0 = greedy
    top_k: jax.Array  # i32; 0 = off
    top_p: jax.Array  # f32; 1 = off
    min_p: jax.Array  # f32; 0 = off
    repetition_penalty: jax.Array  # f32; 1 = off
    frequency_penalty: jax.Array  # f32; 0 = off
    presence_penalty: jax.Array  # f32; 0 = off
    seeds: jax.Array  # u32
    positions: jax.Array  # i32; index of the sampled token in its sequence
    min_tokens_end: jax.Array  # i32; stop ids are masked while positions < this
    # bool; the row's request asks for logprobs. None: every row does. A step where no row
    # does skips the log-sum-exp, top-N and rank passes over the vocabulary.
    logprobs: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplerOutput:
    sampled: jax.Array  # i32[R]
    logprob_token_ids: jax.Array  # i32[R, 1 + MAX_LOGPROBS]: sampled, then top-N
    logprobs: jax.Array  # f32[R, 1 + MAX_LOGPROBS]
    sampled_ranks: jax.Array  # i32[R]; 1 = most likely
    # Verification steps (rejection_sampler): rows whose token is emitted, and each
    # request's last emitted row. None for plain sampling (every row, one per request).
    emitted: jax.Array | None = None  # bool[R]
    final: jax.Array | None = None  # bool[R]


def apply_penalties(
    logits: jax.Array,  # f32[R, V]
    prompt_mask: jax.Array,  # bool[R, V]: token occurs in the prompt
    output_counts: jax.Array,  # i32[R, V]: occurrences in the output so far
    md: SamplingMetadata,
) -> jax.Array:
    """Repetition penalty over prompt and output tokens; frequency and presence penalties
    over the output (vLLM's and OpenAI's definitions)."""
    seen = prompt_mask | (output_counts > 0)
    rep = md.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - md.frequency_penalty[:, None] * output_counts
    return logits - md.presence_penalty[:, None] * (output_counts > 0)


_CHUNK = 512  # vocabulary entries per chunk of the two-level argmax and draws


def first_argmax(logits: jax.Array) -> jax.Array:
    """jnp.argmax over the last axis (the first of ties), in two levels: each chunk's max,
    the first chunk holding the largest, then the first index in that chunk. XLA's CPU
    argmax (a variadic reduce) is an order of magnitude slower over a vocabulary."""
    R, vocab = logits.shape
    pad = -vocab % _CHUNK
    chunks = jnp.pad(logits, ((0, 0), (0, pad)), constant_values=-jnp.inf).reshape(
        R, -1, _CHUNK)
    best = jnp.argmax(jnp.max(chunks, axis=-1), axis=-1)
    within = jnp.argmax(jnp.take_along_axis(chunks, best[:, None, None], axis=1)[:, 0], axis=-1)
    return (best * _CHUNK + within).astype(jnp.int32)


def apply_logits_processors(logits: jax.Array, md: SamplingMetadata,
                            lp: LogitsProcessors) -> jax.Array:
    """min_tokens: EOS and stop ids cannot be sampled before the request has min_tokens
    outputs (vLLM's MinTokensLogitsProcessor). Structured outputs: only the tokens the
    grammar allows. allowed_token_ids and one-token bad words: a fixed mask; a longer bad
    word: its last token, where the output so far ends with the rest of it (vLLM's order:
    output tokens only). logit_bias: added to the logits (OpenAI's)."""
    early = (md.positions < md.min_tokens_end)[:, None]
    logits = jnp.where(early & lp.stop_mask, _NEG_INF, logits)
    if lp.allowed_bitmask is not None:
        vocab = logits.shape[-1]
        bits = (lp.allowed_bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
        allowed = bits.reshape(bits.shape[0], -1)[:, :vocab].astype(bool)
        logits = jnp.where(allowed, logits, _NEG_INF)
    rows = jnp.arange(logits.shape[0])[:, None]
    if lp.banned_mask is not None:
        logits = jnp.where(lp.banned_mask, _NEG_INF, logits)
    if lp.bad_prefixes is not None:
        assert lp.recent is not None and lp.bad_last is not None  # set together (PenaltyState)
        p = lp.bad_prefixes
        match = jnp.all((p == ANY_TOKEN) | (p == lp.recent[:, None, :]), axis=-1)  # [R, W]
        ids = jnp.where(match, lp.bad_last, logits.shape[-1])
        logits = logits.at[rows, ids].set(_NEG_INF, mode="drop")
    return logits.at[rows, lp.bias_ids].add(lp.bias_values, mode="drop")


def apply_min_p(logits: jax.Array, min_p: jax.Array) -> jax.Array:
    """Drop tokens whose probability is below min_p times the most likely one's."""
    probs = jax.nn.softmax(logits, axis=-1)
    threshold = min_p[:, None] * probs.max(axis=-1, keepdims=True)
    return jnp.where(probs < threshold, _NEG_INF, logits)


def ordered_keys(x: jax.Array) -> jax.Array:
    """float32 -> uint32 in the same order (-inf lowest): the sign bit set on non-negative
    values, every bit flipped on negative ones."""
    x = jnp.where(x == 0, 0.0, x.astype(jnp.float32))  # -0.0 ties +0.0, as in a comparison
    b = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where((b >> 31) == 1, ~b, b | jnp.uint32(0x80000000))


@dataclass(frozen=True)
class ThresholdSearch:
    """How top-k and top-p find their thresholds (`largest_threshold`).

    `radix_bits`: bits of the threshold found per pass over the vocabulary (fewer passes,
    2^bits - 1 compares each). `unrolled`: every pass a copy in the program, which XLA's
    cost analysis counts (the device roofline reads it), or one loop body run 32 / bits
    times, as fast on the CPU and a fifth of the compile."""

    radix_bits: int = 1
    unrolled: bool = True


DEFAULT_SEARCH = ThresholdSearch()  # 1 bit a pass, unrolled


def largest_threshold(keys: jax.Array, target: jax.Array, weights: jax.Array | None = None,
                      search: ThresholdSearch = DEFAULT_SEARCH) -> jax.Array:
    """Per row, the largest key t whose entries at or above it weigh at least `target` (a
    count without `weights`): the k-th largest key, or top-p's last kept one. Exact, and no
    sort: t is built `search.radix_bits` bits at a time, from the top, each digit's
    2^bits - 1 candidates weighed in one pass over the row (t is always a key of the row)."""
    bits = search.radix_bits
    digits = jnp.arange(1, 1 << bits, dtype=jnp.uint32)

    def digit(shift: jax.Array | int, t: jax.Array) -> jax.Array:
        candidates = t[:, None] | (digits[None, :] << shift)  # [R, 2^bits - 1], increasing
        above = keys[:, None, :] >= candidates[:, :, None]  # [R, 2^bits - 1, V]
        weight = (jnp.sum(above, axis=-1) if weights is None
                  else jnp.sum(jnp.where(above, weights[:, None, :], 0.0), axis=-1))
        return t | (jnp.sum(weight >= target[:, None], axis=-1).astype(jnp.uint32) << shift)

    t = jnp.zeros(keys.shape[:1], jnp.uint32)
    if search.unrolled:
        for shift in range(32 - bits, -1, -bits):
            t = digit(shift, t)
        return t
    return jax.lax.fori_loop(
        0, 32 // bits,
        lambda i, t: digit(jnp.uint32(32 - bits) - jnp.uint32(bits) * i.astype(jnp.uint32), t), t)


def apply_top_k_top_p(logits: jax.Array, top_k: jax.Array, top_p: jax.Array,
                      search: ThresholdSearch = DEFAULT_SEARCH) -> jax.Array:
    """Keep the top_k most likely tokens (ties with the k-th too), then the smallest set
    reaching top_p (vLLM's order). Thresholds found by `largest_threshold`, not a sort of
    the vocabulary: a full sort per row was most of a filtered sampler's compile on TPUs
    and of its run time on CPUs."""
    vocab = logits.shape[-1]
    keys = ordered_keys(logits)
    use_k = top_k > 0
    kth = largest_threshold(keys, jnp.where(use_k, jnp.minimum(top_k, vocab), 1),
                            search=search)
    logits = jnp.where(use_k[:, None] & (keys < kth[:, None]), _NEG_INF, logits)
    # Token t is kept while the mass of the tokens above it is below top_p: the last kept
    # one is the largest key whose tokens at or above it reach top_p. top_p = 1 keeps
    # everything exactly (the sum can round below 1).
    probs = jax.nn.softmax(logits, axis=-1)
    last = largest_threshold(keys, top_p, probs, search=search)
    return jnp.where((top_p < 1.0)[:, None] & (keys < last[:, None]), _NEG_INF, logits)


def random_sample(logits: jax.Array, seeds: jax.Array, positions: jax.Array) -> jax.Array:
    """One draw per row from softmax(logits), its key fold_in(key(seed), position)."""
    keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(seeds, positions)
    return inverse_cdf_sample(logits, jax.vmap(jax.random.uniform)(keys))


def inverse_cdf_sample(logits: jax.Array, u: jax.Array) -> jax.Array:
    """The token where the cumulative softmax(logits) of each row first exceeds u (one
    uniform in [0, 1) per row), found in two levels: the chunk, then the token in it. One
    random number per row instead of a Gumbel per token (the vocabulary's worth of random
    bits cost more than the rest of the sampler on the CPU); a token of probability 0 (a
    -inf logit) is never drawn."""
    R, vocab = logits.shape
    C = _CHUNK
    x = jnp.pad(logits, ((0, 0), (0, -vocab % C)), constant_values=-jnp.inf).reshape(R, -1, C)
    p = jnp.exp(x - jnp.max(x, axis=(1, 2), keepdims=True))  # [R, n, C]
    mass = p.sum(-1)  # [R, n]
    cum = jnp.cumsum(mass, -1)
    target = u * cum[:, -1]

    def first_above(cum: jax.Array, t: jax.Array, mass: jax.Array) -> jax.Array:
        """The first entry whose running sum exceeds t, kept on an entry with mass (t
        rounding past either end of the sum)."""
        n = cum.shape[-1]
        i = jnp.sum(cum <= t[:, None], axis=-1)
        lo = jnp.argmax(mass > 0, axis=-1)
        hi = n - 1 - jnp.argmax((mass > 0)[:, ::-1], axis=-1)
        return jnp.clip(i, lo, hi)

    chunk = first_above(cum, target, mass)
    before = jnp.take_along_axis(cum - mass, chunk[:, None], axis=-1)[:, 0]
    row = jnp.take_along_axis(p, chunk[:, None, None], axis=1)[:, 0]  # [R, C]
    within = first_above(jnp.cumsum(row, -1), target - before, row)
    return (chunk * C + within).astype(jnp.int32)


def processed_logits(
    logits: jax.Array, prompt_mask: jax.Array | None, output_counts: jax.Array | None,
    md: SamplingMetadata, processors: LogitsProcessors | None,
) -> jax.Array:
    """The logits after the processors and penalties (greedy takes their argmax). None: a
    step where no row has them (`needs_processors`), so no [rows, vocab] pass is spent."""
    if processors is not None:
        logits = apply_logits_processors(logits, md, processors)
    if prompt_mask is None or output_counts is None:
        return logits
    return apply_penalties(logits, prompt_mask, output_counts, md)


def scaled_logits(logits: jax.Array, md: SamplingMetadata, mode: SamplerMode,
                  search: ThresholdSearch = DEFAULT_SEARCH) -> jax.Array:
    """The distribution random rows draw from: temperature, then the filters (FILTERED)."""
    is_greedy = md.temperature <= 0.0
    scaled = logits / jnp.where(is_greedy, 1.0, md.temperature)[:, None]
    if mode is SamplerMode.FILTERED:  # each filter is a no-op on rows without it
        scaled = apply_min_p(scaled, md.min_p)
        scaled = apply_top_k_top_p(scaled, md.top_k, md.top_p, search)
    return scaled


def sample(
    logits: jax.Array,  # f32[R, V]
    prompt_mask: jax.Array | None,  # bool[R, V]; None with output_counts: no penalties
    output_counts: jax.Array | None,  # i32[R, V]
    md: SamplingMetadata,
    mode: SamplerMode = SamplerMode.FILTERED,
    processors: LogitsProcessors | None = None,
    search: ThresholdSearch = DEFAULT_SEARCH,
) -> SamplerOutput:
    """Sample one token per row and report logprobs (of the raw model distribution).

    `mode` must cover the batch (`SamplerMode.for_batch`); FILTERED covers every batch.
    `search`: how top-k and top-p find their thresholds (`largest_threshold`).
    """
    raw_logits = logits
    logits = processed_logits(logits, prompt_mask, output_counts, md, processors)
    sampled = first_argmax(logits)
    if mode is not SamplerMode.GREEDY:
        scaled = scaled_logits(logits, md, mode, search)
        sampled = jnp.where(md.temperature <= 0.0, sampled,
                            random_sample(scaled, md.seeds, md.positions))
    return with_logprobs(raw_logits, sampled, md.logprobs)


_TOP_CHUNK = 128  # vocabulary entries per chunk of top_logprobs' first level


def top_logits(logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """jax.lax.top_k over the last axis (ties: the lower index first), in two levels: the k
    chunks with the largest maxima, then the top k of their entries. Exact: an entry of the
    top k has fewer than k entries before it, so fewer than k chunks' maxima come before its
    chunk's. XLA's CPU top-k over a whole vocabulary is most of the logprobs' cost."""
    R, vocab = logits.shape
    C = _TOP_CHUNK
    n = -(-vocab // C)
    if n <= k:
        vals, ids = jax.lax.top_k(logits, k)
        return vals, ids.astype(jnp.int32)
    chunks = jnp.pad(logits, ((0, 0), (0, n * C - vocab)), constant_values=-jnp.inf
                     ).reshape(R, n, C)
    _, best = jax.lax.top_k(jnp.max(chunks, axis=-1), k)  # [R, k] chunk indices
    best = jnp.sort(best, axis=-1)  # index order, so ties keep the lower index first
    entries = jnp.take_along_axis(chunks, best[:, :, None], axis=1).reshape(R, k * C)
    vals, pos = jax.lax.top_k(entries, k)
    ids = jnp.take_along_axis(best, pos // C, axis=-1) * C + pos % C
    return vals, ids.astype(jnp.int32)


def with_logprobs(raw_logits: jax.Array, sampled: jax.Array,
                  wanted: jax.Array | None = None) -> SamplerOutput:
    """The sampled tokens with their logprobs (of the raw model distribution), the top-N and
    their ranks, for every row; when no row is `wanted` (bool[R]; None: all are), zeros in
    their place (a device-side branch: the host reads them only when a request asked)."""
    def logprobs(logits: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        lse = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
        top_vals, top_ids = top_logits(logits, MAX_LOGPROBS)
        sampled_logit = jnp.take_along_axis(logits, sampled[:, None], axis=-1)
        ranks = 1 + jnp.sum(logits > sampled_logit, axis=-1).astype(jnp.int32)
        return (jnp.concatenate([sampled[:, None], top_ids], axis=-1),
                jnp.concatenate([sampled_logit, top_vals], axis=-1) - lse, ranks)

    def none(logits: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        R = logits.shape[0]
        return (jnp.zeros((R, 1 + MAX_LOGPROBS), jnp.int32),
                jnp.zeros((R, 1 + MAX_LOGPROBS), jnp.float32), jnp.zeros((R,), jnp.int32))

    if wanted is None:
        ids, lps, ranks = logprobs(raw_logits)
    else:
        ids, lps, ranks = jax.lax.cond(jnp.any(wanted), logprobs, none, raw_logits)
    return SamplerOutput(sampled=sampled, logprob_token_ids=ids, logprobs=lps, sampled_ranks=ranks)
