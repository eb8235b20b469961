"""User-facing results of generation, shaped like vLLM's `RequestOutput`.

These are what `LLM.generate` returns and what the API server turns into
OpenAI responses. The engine core speaks `EngineCoreOutput` (token ids only);
the front end detokenizes and builds these.

This module never imports JAX.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, cast


class FinishReason(enum.Enum):
    """Why a request stopped; `.value` is the OpenAI `finish_reason` string."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"  # the client went away or the request was cancelled
    ERROR = "error"  # the engine could not go on with it (its grammar matcher failed)

    def __str__(self) -> str:
        return self.value


@dataclass
class Logprob:
    """Log-probability of one candidate token (vLLM's `Logprob`)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated token: candidate token id -> its Logprob.
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class CompletionOutput:
    """One generated sequence of a request (vLLM's `CompletionOutput`).

    `finish_reason` is the string value of a FinishReason ("stop", "length",
    "abort") or None while the sequence is still running. `stop_reason` is the
    stop token id or stop string that ended it, None for EOS or length.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timestamps of one request (time.monotonic() seconds) for latency metrics."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    # Box by box (jaxserve.request_trace.RequestTrace; None with tracing off): `trace.to_dict()`.
    trace: Any = None

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def time_in_queue(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time


@dataclass
class RequestOutput:
    """Result of one request so far (vLLM's `RequestOutput`)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int | None = None


@dataclass
class EmbeddingOutput:
    """A pooling request's result (vLLM's `EmbeddingOutput`): a vector; for classify and
    score a classifier's probabilities (or score); for token_embed a vector per prompt token."""

    embedding: list[float] | list[list[float]]

    @property
    def probs(self) -> list[float]:
        """A classify request's class probabilities (vLLM's `ClassificationOutput.probs`)."""
        # cast: the union's other half, a vector per token, is token_embed's only.
        return cast(list[float], self.embedding)

    @property
    def score(self) -> float:
        """A score request's score (vLLM's `ScoringOutput.score`)."""
        # cast: a score request's output is one vector (its first entry the score).
        return float(cast(list[float], self.embedding)[0])


@dataclass
class EmbeddingRequestOutput:
    """Result of one embedding request (vLLM's `EmbeddingRequestOutput`, what `LLM.embed`
    returns); `outputs` is None until it finishes."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput | None
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int | None = None
