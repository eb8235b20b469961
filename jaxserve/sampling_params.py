"""Per-request sampling parameters, with vLLM's names, defaults and ranges.

Validated once at construction so that a bad value is reported to the user who
sent it (as a ValueError naming the field) instead of failing deep inside the
engine. Frozen: the engine core, the worker's sampler and the detokenizer all
read the same object and none of them may change it.

This module never imports JAX (the API server and the engine core read it).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeGuard

# The largest number of log-probabilities a request may ask for (vLLM's
# default `max_logprobs`). The worker's sampler is compiled for this many.
MAX_LOGPROBS = 20

# Token ids and top_k land in the worker's int32 arrays.
_INT32_MAX = 2**31 - 1

# logit_bias: at most this many tokens per request, each biased within +-100 (OpenAI's
# range). The worker keeps every slot's biases in a fixed [slots, MAX_LOGIT_BIAS] table.
MAX_LOGIT_BIAS = 300
LOGIT_BIAS_RANGE = 100.0

# bad_words, once tokenized (each word as it stands and after a space): at most this many
# token sequences per request, each at most this long. The worker keeps every slot's
# sequences in a fixed [slots, MAX_BAD_WORD_SEQUENCES, MAX_BAD_WORD_TOKENS] table.
MAX_BAD_WORD_SEQUENCES = 128
MAX_BAD_WORD_TOKENS = 16

# Temperatures below this are treated as greedy sampling (vLLM's _SAMPLING_EPS).
SAMPLING_EPS = 1e-5


class SamplingType(enum.Enum):
    """How the worker's sampler picks a token; it groups requests by this."""

    GREEDY = "greedy"
    RANDOM = "random"
    RANDOM_SEED = "random_seed"


def _is_int(value: object) -> TypeGuard[int]:
    # NOTE: bool is a subclass of int; `n=True` is a caller bug, not 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """Sampling parameters for one request (vLLM's `SamplingParams`).

    `top_k` of -1 or 0 both mean "off" and are stored as 0. `stop`,
    `stop_token_ids` and `logit_bias` ({token id: bias}, added to the logits before
    sampling) are stored as tuples so the object stays hashable. `min_tokens` keeps
    EOS and `stop_token_ids` from being sampled (not just from stopping the request)
    until that many tokens exist.
    `n > 1` is fanned out into `n` engine requests by the front end: the
    engine core schedules single sequences.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    max_tokens: int = 16
    min_tokens: int = 0
    logprobs: int | None = None
    # vLLM's prompt_logprobs: per prompt token (but the first), its logprob given the
    # tokens before it and the top-N. Such a request reads nothing from the prefix cache.
    prompt_logprobs: int | None = None
    # (kind, spec): kind json (spec: a JSON schema), json_object (spec ignored), regex,
    # choice (spec: a JSON list of strings) or grammar (Lark or GBNF); the sampler keeps the
    # output inside it (vLLM's structured_outputs / guided decoding).
    structured_outputs: tuple[str, str] | Sequence[str] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: Mapping[int, float] | Sequence[Sequence[float]] | None = None
    # vLLM's allowed_token_ids: only these tokens may be sampled (None: any).
    allowed_token_ids: Sequence[int] | None = None
    # vLLM's bad_words: never produced. The input processor tokenizes them into
    # bad_words_token_ids (jaxserve/engine/processor.py); the sampler bans a sequence's last
    # token wherever the output so far ends with the rest of it.
    bad_words: Sequence[str] | None = None
    bad_words_token_ids: Sequence[Sequence[int]] | None = None

    def __post_init__(self) -> None:
        # Normalise first so that validation reads the stored form. NOTE: the fields are typed
        # with what a caller may pass; the stored forms are these typed locals, which is what
        # _verify_args checks.
        stop: tuple[str, ...]
        if self.stop is None:
            stop = ()
        elif isinstance(self.stop, str):
            stop = (self.stop,)
        else:
            stop = tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        stop_token_ids = () if self.stop_token_ids is None else tuple(self.stop_token_ids)
        object.__setattr__(self, "stop_token_ids", stop_token_ids)
        raw_bias = self.logit_bias or ()
        pairs = raw_bias.items() if isinstance(raw_bias, Mapping) else raw_bias
        try:
            bias: tuple[tuple[float, float], ...] = tuple(sorted((tok, b) for tok, b in pairs))
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}") from None
        object.__setattr__(self, "logit_bias", bias)
        if self.structured_outputs is not None:
            object.__setattr__(self, "structured_outputs", tuple(self.structured_outputs))
        if _is_int(self.top_k) and self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        bad_words = tuple(self.bad_words or ())
        object.__setattr__(self, "bad_words", bad_words)
        try:
            seqs = tuple(tuple(s) for s in self.bad_words_token_ids or ())
        except TypeError:
            raise ValueError("bad_words_token_ids must be lists of token ids, got "
                             f"{self.bad_words_token_ids!r:.100}") from None
        object.__setattr__(self, "bad_words_token_ids", seqs)
        self._verify_args(stop, stop_token_ids, bias, bad_words, seqs)

    def _verify_args(
        self,
        stop: tuple[object, ...],
        stop_token_ids: tuple[object, ...],
        logit_bias: tuple[tuple[object, object], ...],
        bad_words: tuple[object, ...],
        bad_words_token_ids: tuple[tuple[object, ...], ...],
    ) -> None:
        # The collections arrive normalised but unchecked: whatever the caller put in them.
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")
        for name, lo, hi in (
            ("presence_penalty", -2.0, 2.0),
            ("frequency_penalty", -2.0, 2.0),
        ):
            value = getattr(self, name)
            if not _is_number(value) or not lo <= value <= hi:
                raise ValueError(f"{name} must be in [{lo}, {hi}], got {value!r}")
        rp = self.repetition_penalty
        if not _is_number(rp) or not (rp > 0 and math.isfinite(rp)):
            raise ValueError(f"repetition_penalty must be > 0, got {rp!r}")
        t = self.temperature
        if not _is_number(t) or not (t >= 0 and math.isfinite(t)):
            raise ValueError(f"temperature must be >= 0, got {t!r}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or not 0 <= self.top_k <= _INT32_MAX:
            raise ValueError(f"top_k must be -1 or 0 (off) or in [1, {_INT32_MAX}], got {self.top_k!r}")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not (_is_int(self.seed) and -(2**63) <= self.seed < 2**63):
            raise ValueError(f"seed must be None or a 64-bit int, got {self.seed!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an int >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        for s in stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must contain only non-empty strings, got {s!r}")
        for tok in stop_token_ids:
            if not _is_int(tok) or not 0 <= tok <= _INT32_MAX:
                raise ValueError(f"stop_token_ids must contain only ints in [0, {_INT32_MAX}], "
                                 f"got {tok!r}")
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(
                f"logprobs must be None or an int in [0, {MAX_LOGPROBS}], got {self.logprobs!r}"
            )
        if len(logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias may bias at most {MAX_LOGIT_BIAS} tokens, "
                             f"got {len(logit_bias)}")
        for tok, b in logit_bias:
            if not _is_int(tok) or not 0 <= tok <= _INT32_MAX:
                raise ValueError(f"logit_bias keys must be token ids in [0, {_INT32_MAX}], got {tok!r}")
            if not _is_number(b) or not -LOGIT_BIAS_RANGE <= b <= LOGIT_BIAS_RANGE:
                raise ValueError(f"logit_bias values must be in [-{LOGIT_BIAS_RANGE:g}, "
                                 f"{LOGIT_BIAS_RANGE:g}], got {b!r} for token {tok}")
        if self.prompt_logprobs is not None and (
            not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(f"prompt_logprobs must be None or an int in [0, {MAX_LOGPROBS}], "
                             f"got {self.prompt_logprobs!r}")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty (omit it to allow any token)")
            for tok in self.allowed_token_ids:
                if not _is_int(tok) or not 0 <= tok <= _INT32_MAX:
                    raise ValueError(f"allowed_token_ids must contain only ints in "
                                     f"[0, {_INT32_MAX}], got {tok!r}")
        for word in bad_words:
            if not isinstance(word, str) or not word.strip():
                raise ValueError(f"bad_words must contain only non-blank strings, got {word!r}")
        seqs = bad_words_token_ids
        if len(seqs) > MAX_BAD_WORD_SEQUENCES:
            raise ValueError(f"bad_words may make at most {MAX_BAD_WORD_SEQUENCES} token "
                             f"sequences (each word as it stands and after a space), got {len(seqs)}")
        for seq in seqs:
            if not 1 <= len(seq) <= MAX_BAD_WORD_TOKENS:
                raise ValueError(f"each of bad_words must be 1 to {MAX_BAD_WORD_TOKENS} tokens, "
                                 f"got {len(seq)}")
            if not all(_is_int(t) and 0 <= t <= _INT32_MAX for t in seq):
                raise ValueError(f"bad_words_token_ids must contain only token ids, got {seq!r}")
        so = self.structured_outputs
        if so is not None and (len(so) != 2 or not all(isinstance(x, str) for x in so) or so[0]
                               not in ("json", "json_object", "regex", "choice", "grammar")):
            raise ValueError("structured_outputs must be (kind, spec) with kind one of json, "
                             f"json_object, regex, choice, grammar; got {so!r}")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

    @property
    def sampling_type(self) -> SamplingType:
        """Greedy below SAMPLING_EPS; seeded random needs a per-request generator."""
        if self.temperature < SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def bans_by_history(self) -> bool:
        """Whether a bad word of several tokens makes the sampler read the output so far (such
        a request gets no speculative drafts: the sampler checks one token a step)."""
        return any(len(s) > 1 for s in self.bad_words_token_ids or ())

    def with_model_eos(self, eos_token_ids: Collection[int]) -> SamplingParams:
        """These params with the model's other EOS ids (generation_config's list, a GGUF's
        end-of-turn id) among stop_token_ids, unless ignore_eos (vLLM's
        update_from_generation_config): they stop the request, and min_tokens keeps them out."""
        stop_token_ids = self.stop_token_ids or ()  # never None once built
        extra = set(eos_token_ids) - set(stop_token_ids)
        if self.ignore_eos or not extra:
            return self
        return dataclasses.replace(self, stop_token_ids=(*stop_token_ids, *sorted(extra)))

    def all_stop_token_ids(self, eos_token_id: int | None) -> frozenset[int]:
        """Token ids that end the request: the sampler masks these until
        `min_tokens` outputs exist (vLLM's `all_stop_token_ids`)."""
        ids = set(self.stop_token_ids or ())  # never None once built
        if eos_token_id is not None and not self.ignore_eos:
            ids.add(eos_token_id)
        return frozenset(ids)
