"""What the engine core sends back to the front end after each step.

Token ids only (the front end detokenizes and checks stop strings). They cross the ZeroMQ
socket through the wire codec (engine_core/wire.py), each with the message's table of steps
as its context: {step number: StepTrace's record}, shared by every output of the message.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from jaxserve.engine_core.model_runner_output import LogprobsLists
from jaxserve.engine_core.step_trace import StepEntry, StepTrace, new_step_entry
from jaxserve.engine_core.wire import encode_record, wire_field
from jaxserve.outputs import FinishReason

if TYPE_CHECKING:
    from jaxserve.engine_core.request import Request


class EngineCoreEventType(enum.Enum):
    """A box the request passed, stamped with time.monotonic()."""

    QUEUED = "queued"  # entered the scheduler's waiting queue
    SCHEDULED = "scheduled"  # admitted from the waiting queue (again after a preemption)
    PREEMPTED = "preempted"  # its pages were taken back; it will be recomputed
    FIRST_TOKEN = "first_token"  # its first output token reached the engine core
    FINISHED = "finished"  # stopped, length-capped or aborted


@dataclass(slots=True)
class EngineCoreEvent:
    type: EngineCoreEventType
    timestamp: float


def _encode_trace(entries: list[StepEntry], steps: dict[int, list[Any]] | None) -> list[list[Any]]:
    """[step number, tokens, pages, computed before, admitted] per entry; each step's shared
    facts go once into the message's table `steps`."""
    rows = []
    for st, tokens, pages, computed, admitted in entries:
        if steps is not None and st.step not in steps:
            steps[st.step] = encode_record(st)
        rows.append([st.step, tokens, pages, computed, admitted])
    return rows


def _decode_trace(rows: list[list[Any]], steps: dict[int, StepTrace] | None) -> list[StepEntry] | None:
    """The entries back, each pointing at its step in the message's table (decoded once)."""
    if steps is None:
        return None
    return [new_step_entry(StepEntry, (steps[s], t, p, c, bool(a))) for s, t, p, c, a in rows
            if s in steps]


@dataclass(slots=True)
class EngineCoreOutput:
    """New tokens (and possibly the end) of one request after one step.

    `new_logprobs` has one row per token of `new_token_ids`. `events` carries
    the timestamps recorded since the request's previous output, or None.
    """

    req_id: str
    new_token_ids: list[int]
    new_logprobs: LogprobsLists | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    events: list[EngineCoreEvent] | None = None
    # With the first token of a prompt_logprobs request: rows for prompt tokens 1..P-1.
    prompt_logprobs: LogprobsLists | None = None
    # The steps it took part in since its previous output (step_trace.StepTracer); on the wire
    # each entry points into the message's table of steps (see _encode_trace).
    trace_steps: list[StepEntry] | None = wire_field(
        _encode_trace, _decode_trace, default=None)
    # A pooling request's result, with its finish (it has no new tokens): a vector, a
    # classifier's probabilities, or (token_embed) one vector per prompt token.
    pooling_output: list[float] | list[list[float]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def from_request(
        cls, request: Request, new_token_ids: list[int], new_logprobs: LogprobsLists | None
    ) -> EngineCoreOutput:
        """This step's output of `request` (whose tokens, status and events are updated)."""
        pooled = request.pooling_params is not None
        return cls(
            request.req_id,
            [] if pooled else new_token_ids,
            new_logprobs,
            request.get_finished_reason(),
            request.stop_reason,
            request.num_cached_tokens,
            request.take_events() if request.has_events else None,
            request.take_prompt_logprobs(),
            pooling_output=request.pooling_output,
        )

