"""What the engine core sends back to the front end after each step.

Token ids only (the front end detokenizes and checks stop strings). These cross
a ZeroMQ socket as msgpack, so every field is a plain type or has a
`to_dict`/`from_dict` pair made only of lists, dicts, str, int, float and None.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from jaxserve.engine_core.model_runner_output import LogprobsLists
from jaxserve.engine_core.step_trace import StepEntry, StepTrace, new_step_entry
from jaxserve.engine_core.wire import encode_record
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
    # The steps it took part in since its previous output (tracing.StepTracer).
    trace_steps: list[StepEntry] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def from_request(
        cls, request: Request, new_token_ids: list[int], new_logprobs: LogprobsLists | None
    ) -> EngineCoreOutput:
        """This step's output of `request` (whose tokens, status and events are updated)."""
        return cls(
            request.req_id,
            new_token_ids,
            new_logprobs,
            request.get_finished_reason(),
            request.stop_reason,
            request.num_cached_tokens,
            request.take_events() if request.has_events else None,
            request.take_prompt_logprobs(),
        )

    def to_dict(self, steps: dict[int, list[Any]] | None = None) -> dict[str, Any]:
        """Plain types only, for msgpack. Its steps' shared facts go into `steps` (one table
        per message), the output keeps [step, tokens, pages, computed before, admitted]."""
        lp = self.new_logprobs
        trace = None
        if self.trace_steps is not None:
            trace = []
            for st, tokens, pages, computed, admitted in self.trace_steps:
                if steps is not None and st.step not in steps:
                    steps[st.step] = encode_record(st)
                trace.append([st.step, tokens, pages, computed, admitted])
        return {
            "trace_steps": trace,
            "req_id": self.req_id,
            "new_token_ids": self.new_token_ids,
            "new_logprobs": None
            if lp is None
            else [lp.token_ids, lp.logprobs, lp.sampled_token_ranks],
            "finish_reason": None if self.finish_reason is None else self.finish_reason.value,
            "stop_reason": self.stop_reason,
            "num_cached_tokens": self.num_cached_tokens,
            "events": None
            if self.events is None
            else [[e.type.value, e.timestamp] for e in self.events],
            "prompt_logprobs": None if self.prompt_logprobs is None else [
                self.prompt_logprobs.token_ids, self.prompt_logprobs.logprobs,
                self.prompt_logprobs.sampled_token_ranks],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any], steps: dict[int, StepTrace] | None = None
                  ) -> EngineCoreOutput:
        """`steps`: the message's step table, read back (see to_dict)."""
        lp = d["new_logprobs"]
        events = d["events"]
        trace = d.get("trace_steps")
        return cls(
            req_id=d["req_id"],
            new_token_ids=list(d["new_token_ids"]),
            new_logprobs=None if lp is None else LogprobsLists(lp[0], lp[1], lp[2]),
            finish_reason=None if d["finish_reason"] is None else FinishReason(d["finish_reason"]),
            stop_reason=d["stop_reason"],
            num_cached_tokens=d["num_cached_tokens"],
            events=None
            if events is None
            else [EngineCoreEvent(EngineCoreEventType(t), ts) for t, ts in events],
            prompt_logprobs=None if d.get("prompt_logprobs") is None
            else LogprobsLists(*d["prompt_logprobs"]),
            trace_steps=None if trace is None or steps is None
            else [new_step_entry(StepEntry, (steps[s], t, p, c, bool(a))) for s, t, p, c, a in trace
                  if s in steps],
        )
