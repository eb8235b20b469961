"""Input processing (vLLM's `Processor`): one place that checks a request against the served
model and builds its `SamplingParams`, for the offline `LLM` and the API server alike.

The checks here need the served model (its context length, vocabulary, EOS ids, grammar
engine); what a field may hold on its own is `SamplingParams`' to say. A refusal is an
`InvalidInputError`: a ValueError naming the field, which the server sends as a 400. JAX-free.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from jaxserve.classifier import ClassifierConfig
from jaxserve.config import PoolerConfig
from jaxserve.engine_core.sched_utils import EMPTY_PROMPT, prompt_too_long
from jaxserve.engine_core.structured_output import grammar_text
from jaxserve.pooling_params import PoolingParams
from jaxserve.sampling_params import MAX_LOGPROBS, SamplingParams

_FIELD_NAMES = {f.name for f in dataclasses.fields(SamplingParams)}

# What an embedding request samples: one greedy token, the end of its prompt (dropped).
POOLING_SAMPLING_PARAMS = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


class InvalidInputError(ValueError):
    """A request field the served model cannot take; `param` names it."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Processor:
    """The served model's limits, and the checks of a request against them."""

    max_model_len: int
    vocab_size: int
    model_eos_token_ids: frozenset[int] = frozenset()  # besides the tokenizer's own
    max_logprobs: int = MAX_LOGPROBS  # --max-logprobs
    # The served tokenizer's text -> ids without special tokens (bad_words are tokenized here).
    encode: Callable[[str], list[int]] | None = field(default=None, compare=False)
    pooler_config: PoolerConfig = PoolerConfig()  # --pooler-config: embedding requests
    # A sequence classifier (jaxserve/classifier.py) serves classify and score, nothing else.
    classifier: ClassifierConfig | None = None

    def check_prompt(self, token_ids: list[int], max_tokens: int | None) -> int:
        """The prompt against max_model_len and the vocabulary; returns max_tokens (None: as
        many as fit, as vLLM does for chat)."""
        n, limit = len(token_ids), self.max_model_len
        if n == 0:
            raise InvalidInputError(EMPTY_PROMPT, "prompt")
        if n >= limit:
            raise InvalidInputError(prompt_too_long(n, limit), "prompt")
        if bad := out_of_vocab(token_ids, self.vocab_size):
            raise InvalidInputError(f"Token id {bad} is out of vocabulary: prompt token ids must "
                                    f"be in [0, {self.vocab_size})", "prompt")
        if max_tokens is None:
            return limit - n
        if n + max_tokens > limit:
            raise InvalidInputError(
                f"prompt has {n} tokens and max_tokens is {max_tokens}, but max_model_len is "
                f"{limit}: lower max_tokens to at most {limit - n}", "max_tokens")
        return max_tokens

    def check_pooling_prompt(self, token_ids: list[int]) -> None:
        """An embedding request's prompt against max_model_len and the vocabulary (the
        engine runs it as a prompt with one token to sample, so it must leave room for it)."""
        n, limit = len(token_ids), self.max_model_len
        if n >= limit:
            raise InvalidInputError(f"input has {n} tokens but an embedding input may have at "
                                    f"most {limit - 1} (max_model_len {limit} - 1)", "input")
        self.check_prompt(token_ids, 1)

    def pooling_params(self, normalize: bool | None = None, dimensions: int | None = None,
                       task: str = "embed") -> PoolingParams:
        """A pooling request's PoolingParams under --pooler-config (`normalize` None: the
        server's default). `dimensions` is refused, as vLLM refuses it for a model that is
        not a Matryoshka one: cutting the vector would change what it means. A task the
        model cannot serve is refused in vLLM's words."""
        if dimensions is not None:
            raise InvalidInputError("dimensions is not supported: the served model does not "
                                    "support Matryoshka representations", "dimensions")
        self.check_task(task)
        try:  # PoolingParams' own checks (normalize a bool)
            return self.pooler_config.pooling_params(normalize, task)
        except ValueError as e:
            raise InvalidInputError(str(e), "normalize") from None

    def check_task(self, task: str) -> None:
        """A classifier serves classify and score (score with one label, as vLLM); any
        other model embed and token_embed."""
        head = self.classifier
        what = {"classify": "Classification API", "score": "Score API",
                "embed": "Embeddings API"}.get(task, f"the {task} task")
        if task in ("classify", "score") and head is None:
            raise InvalidInputError(
                f"The model does not support {what}: it has no classification head "
                "(a *ForSequenceClassification checkpoint, or --hf-overrides' "
                "classifier_from_token, has one)")
        if task == "score" and head is not None and head.num_labels != 1:
            raise InvalidInputError("Score API is only enabled for num_labels == 1 (this "
                                    f"classifier has {head.num_labels} labels)")
        if task in ("embed", "token_embed") and head is not None:
            raise InvalidInputError(f"The model does not support {what}: it is a sequence "
                                    "classifier (classify and score)")

    def check_grammar(self, kind: str, spec: str, param: str) -> tuple[str, str]:
        """(kind, spec) once its grammar compiles; refused naming `param` if it does not
        (slow for a large schema: the server calls it off its event loop)."""
        try:
            grammar_text(kind, spec)
        except ValueError as e:
            raise InvalidInputError(str(e), param) from None
        return kind, spec

    def make_params(self, **kwargs: Any) -> SamplingParams:
        """SamplingParams checked against the model (vocabulary, --max-logprobs), with the
        model's EOS ids as stop tokens."""
        self.check_generates()
        return self.check_params(self._build(kwargs))

    def check_generates(self) -> None:
        """A sequence classifier generates nothing (it has no LM head)."""
        if self.classifier is not None:
            raise InvalidInputError(
                "The model does not support generation: it is a sequence classifier (serve it "
                "with /classify, /score, /rerank or /pooling)")

    def check_params(self, params: SamplingParams) -> SamplingParams:
        """`params` checked against the model, with the model's EOS ids added."""
        vocab = self.vocab_size
        # Stored as (token, bias) pairs (SamplingParams.__post_init__); typed as given.
        bias = params.logit_bias or ()
        bias_tokens = list(bias) if isinstance(bias, Mapping) else [int(p[0]) for p in bias]
        if bad := out_of_vocab(bias_tokens, vocab):
            raise InvalidInputError(f"token_id(s) {bad} in logit_bias contain out-of-vocab token "
                                    f"ids: keys must be token ids in [0, {vocab})", "logit_bias")
        if params.top_k > vocab:
            raise InvalidInputError(f"top_k must be at most the vocabulary size ({vocab}), "
                                    f"got {params.top_k}", "top_k")
        for name in ("stop_token_ids", "allowed_token_ids"):
            if bad := out_of_vocab(getattr(params, name) or (), vocab):
                raise InvalidInputError(f"{name} contain out-of-vocab token id(s) {bad}: "
                                        f"they must be in [0, {vocab})", name)
        if params.bad_words and not params.bad_words_token_ids:
            params = self._tokenize_bad_words(params)
        if bad := out_of_vocab([t for s in params.bad_words_token_ids or () for t in s], vocab):
            raise InvalidInputError(f"bad_words_token_ids contain out-of-vocab token id(s) {bad}: "
                                    f"they must be in [0, {vocab})", "bad_words")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.max_logprobs:
                raise InvalidInputError(f"{name} must be at most {self.max_logprobs} "
                                        f"(--max-logprobs), got {value}", name)
        return params.with_model_eos(self.model_eos_token_ids)

    def _tokenize_bad_words(self, params: SamplingParams) -> SamplingParams:
        """Each bad word as token sequences the sampler bans: as it stands, and after a space
        when that spelling is another word of the same length (vLLM's rule: on tokenizers that
        make the space a token of its own, the bare spelling already covers it)."""
        if self.encode is None:
            raise InvalidInputError("bad_words need the served tokenizer", "bad_words")
        seqs: list[tuple[int, ...]] = []
        for word in params.bad_words or ():
            bare = tuple(self.encode(word.lstrip()))
            spaced = tuple(self.encode(" " + word.lstrip()))
            for ids in (bare, *([spaced] if spaced and bare and len(spaced) == len(bare)
                                and spaced[0] != bare[0] else [])):
                if ids and ids not in seqs:
                    seqs.append(ids)
        try:
            return dataclasses.replace(params, bad_words_token_ids=seqs)
        except ValueError as e:
            raise InvalidInputError(str(e), "bad_words") from None

    @staticmethod
    def _build(kwargs: dict[str, Any]) -> SamplingParams:
        try:
            return SamplingParams(**kwargs)
        except ValueError as e:
            word = str(e).split(" ", 1)[0]  # SamplingParams' messages start with the field
            raise InvalidInputError(str(e), word if word in _FIELD_NAMES else None) from None


def out_of_vocab(token_ids: Iterable[int], vocab_size: int, show: int = 5) -> str:
    """The ids outside [0, vocab_size) ("" if none), the first `show` of them, as error
    messages name them (vLLM's name the offending ids)."""
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if not bad:
        return ""
    more = f" and {len(bad) - show} more" if len(bad) > show else ""
    return (str(bad[0]) if len(bad) == 1 else ", ".join(map(str, bad[:show]))) + more
