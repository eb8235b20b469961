"""The sampler's per-slot state on device (penalties, min_tokens' stop ids, logit biases, the
tokens a request may never sample, its bad words and its latest outputs), set when a request
takes its slot and updated by every sampling step; and its rows a step gathers for the
sampler's logits processors (`LogitsProcessors`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import cast

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.sampling_params import MAX_BAD_WORD_SEQUENCES, MAX_BAD_WORD_TOKENS, MAX_LOGIT_BIAS

# A bad word's tokens before its last, right-aligned in MAX_BAD_WORD_TOKENS - 1 places:
# ANY_TOKEN before a shorter word; NO_TOKEN in `recent` where the output has no token yet
# (so a word longer than the output so far never matches).
BAD_PREFIX_LEN = MAX_BAD_WORD_TOKENS - 1
ANY_TOKEN, NO_TOKEN = -1, -2


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LogitsProcessors:
    """Per-row inputs of the logits processors that come before the penalties
    (worker/sampler.py applies them): `PenaltyState.processors` gathers a step's rows."""

    stop_mask: jax.Array  # bool[R, V]: ids min_tokens keeps out (EOS, stop_token_ids)
    bias_ids: jax.Array  # i32[R, B]: logit_bias token ids; V (out of range) = unused
    bias_values: jax.Array  # f32[R, B]
    # Structured outputs: i32[R, ceil(V / 32)], bit t % 32 of word t // 32 = token t allowed
    # (all bits set on rows without a grammar); None when no row of the step has one.
    allowed_bitmask: jax.Array | None = None
    # allowed_token_ids and bad_words (their layout above); None: none.
    banned_mask: jax.Array | None = None  # bool[R, V]: never sampled
    bad_prefixes: jax.Array | None = None  # i32[R, W, P]: a bad word's tokens before its last
    bad_last: jax.Array | None = None  # i32[R, W]: its last token (V: unused entry)
    recent: jax.Array | None = None  # i32[R, P]: the row's latest output tokens


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PenaltyState:
    prompt_mask: jax.Array  # bool[S, V]
    output_counts: jax.Array  # i32[S, V]
    stop_mask: jax.Array  # bool[S, V]: EOS and stop_token_ids, masked before min_tokens
    bias_ids: jax.Array  # i32[S, MAX_LOGIT_BIAS]; V = unused entry
    bias_values: jax.Array  # f32[S, MAX_LOGIT_BIAS]
    banned_mask: jax.Array  # bool[S, V]: outside allowed_token_ids, or a one-token bad word
    bad_prefixes: jax.Array  # i32[S, W, BAD_PREFIX_LEN]: longer bad words but their last token
    bad_last: jax.Array  # i32[S, W]: their last tokens; V = unused entry
    recent: jax.Array  # i32[S, BAD_PREFIX_LEN]: the latest output tokens, oldest first

    def processors(self, rows: jax.Array, bitmask: jax.Array | None) -> LogitsProcessors:
        """The sampler's LogitsProcessors for the step's `rows` (slots clipped into range)."""
        return LogitsProcessors(self.stop_mask[rows], self.bias_ids[rows], self.bias_values[rows],
                                bitmask, banned_mask=self.banned_mask[rows],
                                bad_prefixes=self.bad_prefixes[rows],
                                bad_last=self.bad_last[rows], recent=self.recent[rows])

    @classmethod
    def zeros(cls, num_slots: int, vocab_size: int) -> PenaltyState:
        """Host arrays (NumPy) of an empty state, to be placed on the mesh."""
        S, V, W, P = num_slots, vocab_size, MAX_BAD_WORD_SEQUENCES, BAD_PREFIX_LEN
        host = (np.zeros((S, V), bool), np.zeros((S, V), np.int32), np.zeros((S, V), bool),
                np.full((S, MAX_LOGIT_BIAS), V, np.int32),
                np.zeros((S, MAX_LOGIT_BIAS), np.float32),
                np.zeros((S, V), bool), np.full((S, W, P), ANY_TOKEN, np.int32),
                np.full((S, W), V, np.int32), np.full((S, P), NO_TOKEN, np.int32))
        # The leaves are NumPy until placed (device_put, or abstract for compile-only runners).
        return cls(*cast(tuple[jax.Array, ...], host))


def admit(penalties: PenaltyState, slot, prompt_ids, output_ids, stop_ids, bias_ids,
          bias_values, allowed_ids, any_allowed, banned_ids, bad_prefixes, bad_last,
          recent) -> PenaltyState:
    """Reset a slot's rows: penalties from its prompt (and outputs, when resumed), the ids
    min_tokens masks, its logit biases, the tokens it may never sample, its bad words and
    latest outputs. Id arrays are padded with `vocab_size`, which is dropped."""
    V = penalties.prompt_mask.shape[1]
    # Every id set in one scatter-add (set k's id t at k * V + t; padding past the end): five
    # scatters of their own were most of TPU start-up's compile (docs/benchmarks.md).
    sets = (prompt_ids, output_ids, stop_ids, allowed_ids, banned_ids)
    flat = jnp.concatenate([jnp.where(ids < V, ids + k * V, len(sets) * V)
                            for k, ids in enumerate(sets)])
    hits = jnp.zeros((len(sets) * V,), jnp.int32).at[flat].add(1, mode="drop").reshape(len(sets), V)
    mask, counts, stop = hits[0] > 0, hits[1], hits[2] > 0
    allowed = any_allowed | (hits[3] > 0)
    banned = ~allowed | (hits[4] > 0)
    return PenaltyState(
        penalties.prompt_mask.at[slot].set(mask),
        penalties.output_counts.at[slot].set(counts),
        penalties.stop_mask.at[slot].set(stop),
        penalties.bias_ids.at[slot].set(bias_ids),
        penalties.bias_values.at[slot].set(bias_values),
        penalties.banned_mask.at[slot].set(banned),
        penalties.bad_prefixes.at[slot].set(bad_prefixes),
        penalties.bad_last.at[slot].set(bad_last),
        penalties.recent.at[slot].set(recent),
    )


def admit_inputs(max_model_len: int, vocab_size: int, prompt: list[int], outputs: list[int],
                 stop_ids: Collection[int] = (),
                 logit_bias: tuple[tuple[int, float], ...] = (),
                 allowed_token_ids: Sequence[int] | None = None,
                 bad_words_token_ids: Sequence[Sequence[int]] = ()
                 ) -> tuple[np.ndarray | np.bool_, ...]:
    """`admit`'s id and bias arrays, padded to fixed shapes (one compiled program)."""
    L, V = max_model_len, vocab_size
    prompt_ids = np.full(L, V, np.int32)
    prompt_ids[: len(prompt)] = prompt
    output_ids = np.full(L, V, np.int32)
    output_ids[: len(outputs)] = outputs
    stop = np.fromiter((t for t in stop_ids if t < V), np.int32)
    stop_arr = np.full(L, V, np.int32)
    stop_arr[: min(len(stop), L)] = stop[:L]
    bias_ids = np.full(MAX_LOGIT_BIAS, V, np.int32)
    bias_values = np.zeros(MAX_LOGIT_BIAS, np.float32)
    for i, (tok, b) in enumerate(logit_bias):
        bias_ids[i], bias_values[i] = min(tok, V), b  # ids >= V: dropped on device
    allowed = np.full(V, V, np.int32)  # up to V distinct ids
    if allowed_token_ids is not None:
        ids = np.unique(np.asarray(allowed_token_ids, np.int64))
        allowed[: len(ids)] = np.minimum(ids, V)
    banned = np.full(MAX_BAD_WORD_SEQUENCES, V, np.int32)  # one-token bad words
    W, P = MAX_BAD_WORD_SEQUENCES, BAD_PREFIX_LEN
    prefixes, last = np.full((W, P), ANY_TOKEN, np.int32), np.full(W, V, np.int32)
    for i, seq in enumerate(bad_words_token_ids):
        if len(seq) == 1:
            banned[i] = min(seq[0], V)
        else:
            prefixes[i, P - len(seq) + 1:], last[i] = seq[:-1], min(seq[-1], V)
    recent = np.full(P, NO_TOKEN, np.int32)
    tail = list(outputs)[-P:]
    if tail:
        recent[P - len(tail):] = tail
    return (prompt_ids, output_ids, stop_arr, bias_ids, bias_values, allowed,
            np.bool_(allowed_token_ids is None), banned, prefixes, last, recent)


def with_sampled(recent: jax.Array, slots: jax.Array, rows: jax.Array, sampled: jax.Array,
                 took: jax.Array) -> jax.Array:
    """`recent` after this step: each slot whose row `took` a token appends it. `rows`: the
    slots clipped into range; padding rows' writes are dropped."""
    S = recent.shape[0]
    shifted = jnp.concatenate([recent[rows][:, 1:], sampled[:, None]], axis=1)
    return recent.at[jnp.where(took, slots, S)].set(shifted, mode="drop")


def after_sampling(penalties: PenaltyState, slots: jax.Array, rows: jax.Array,
                   sampled: jax.Array, counted: jax.Array, took: jax.Array) -> PenaltyState:
    """The state after a step that ran the processors: each row `counted` adds its token to
    its slot's output counts, each that `took` it appends it to `recent` (padding rows carry
    an out-of-range slot; their writes are dropped)."""
    S = penalties.output_counts.shape[0]
    counts = penalties.output_counts.at[jnp.where(counted, slots, S), sampled].add(1, mode="drop")
    return dataclasses.replace(penalties, output_counts=counts,
                               recent=with_sampled(penalties.recent, slots, rows, sampled, took))
