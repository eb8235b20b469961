"""The engine core's view of one request (vLLM's `v1.request.Request`).

A request is a token sequence that grows: the prompt, then one sampled token
per step. The scheduler only tracks how far its KV cache has been computed:

    all_token_ids        [p0 p1 p2 p3 p4 | o0 o1]          num_tokens = 7
    num_computed_tokens  ^^^^^^^^^^^^^^^^^^^^^                 = 6
                         (the KV of o1 is computed next step, which samples o2)

With async scheduling a step is scheduled before the previous step's token is
known; `num_output_placeholders` counts those tokens, which the worker feeds
from its own sampled output and which are included in `num_computed_tokens`.
"""

from __future__ import annotations

import enum
import sys
import time
from collections.abc import Callable, Sequence

from jaxserve.engine_core.core_outputs import EngineCoreEvent, EngineCoreEventType
from jaxserve.engine_core.kv_cache_utils import BlockHash
from jaxserve.engine_core.model_runner_output import LogprobsLists
from jaxserve.outputs import FinishReason
from jaxserve.pooling_params import PoolingParams
from jaxserve.sampling_params import SamplingParams


class InvalidRequestError(ValueError):
    """A request that can never run (its own fault): refused to its sender, never fatal."""


class RequestStatus(enum.IntEnum):
    """Life cycle: WAITING -> RUNNING (<-> PREEMPTED) -> one FINISHED_* state."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # NOTE: every state after PREEMPTED is a finished one; is_finished relies on it.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    def is_finished(self) -> bool:
        """Works both as `status.is_finished()` and `RequestStatus.is_finished(status)`."""
        return self > RequestStatus.PREEMPTED

    def get_finished_reason(self) -> FinishReason | None:
        return _FINISHED_REASONS.get(self)


_FINISHED_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}

BlockHasher = Callable[["Request"], list[BlockHash]]


class Request:
    """One generation request inside the engine core.

    `arrival_time` and every other timestamp are time.monotonic() seconds
    (CLOCK_MONOTONIC is shared by the processes of one host). `priority`:
    lower is served first under the PRIORITY policy. `cache_salt` keeps
    this request's prefix-cache pages apart from other tenants'.

    With `pooling_params` it is an embedding request: `sampling_params` is then one greedy
    token (the sampler's row of its last prompt token, dropped), and it ends with the
    worker's vector in `pooling_output` instead.
    """

    def __init__(
        self,
        req_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        pooling_params: PoolingParams | None = None,
    ) -> None:
        self.req_id = req_id
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.sampling_params = sampling_params
        self.max_tokens = sampling_params.max_tokens
        self.eos_token_id = eos_token_id
        self.priority = priority
        self.cache_salt = cache_salt
        self.pooling_params = pooling_params
        self.pooling_output: list[float] | list[list[float]] | None = None
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time

        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self._output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_output_placeholders = 0
        self.num_steps_in_flight = 0  # scheduled steps whose output has not come back
        # Prefix-cache hit length at first scheduling; -1 until then.
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        # prompt_logprobs rows by prompt position, gathered over prefill chunks until the
        # first token goes out with them (a recompute after preemption overwrites).
        self._prompt_logprob_rows: dict[int, tuple[list[int], list[float], int]] = {}

        # Hashes of the full pages of real tokens, extended as tokens arrive.
        self.block_hashes: list[BlockHash] = []
        self._block_hasher: BlockHasher | None = None
        self._block_size = 0
        self._next_hash_at = sys.maxsize  # num_tokens at which the next page is full

        self.queued_time: float | None = None
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        self._events: list[EngineCoreEvent] = []

    # --- tokens -------------------------------------------------------------

    @property
    def num_tokens(self) -> int:
        """Real tokens (prompt + outputs), placeholders excluded."""
        return len(self._all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """Read-only view by convention: mutate only via append_output_token_ids."""
        return self._output_token_ids

    @property
    def all_token_ids(self) -> list[int]:
        """Read-only view by convention: mutate only via append_output_token_ids."""
        return self._all_token_ids

    def append_output_token_ids(self, token_ids: int | Sequence[int]) -> None:
        """Append sampled tokens and hash any page they fill."""
        all_token_ids = self._all_token_ids
        if isinstance(token_ids, int):
            self._output_token_ids.append(token_ids)
            all_token_ids.append(token_ids)
        else:
            self._output_token_ids.extend(token_ids)
            all_token_ids.extend(token_ids)
        if self.first_token_time is None:
            self.record_event(EngineCoreEventType.FIRST_TOKEN)
        if len(all_token_ids) >= self._next_hash_at:
            self._update_block_hashes()

    # --- prefix caching -----------------------------------------------------

    def set_block_hasher(self, block_hasher: BlockHasher, block_size: int) -> None:
        """Attach the KV cache manager's hasher and hash the full prompt pages."""
        self._block_hasher = block_hasher
        self._block_size = block_size
        self.block_hashes = []
        self._update_block_hashes()

    def _update_block_hashes(self) -> None:
        assert self._block_hasher is not None
        self.block_hashes.extend(self._block_hasher(self))
        self._next_hash_at = (len(self.block_hashes) + 1) * self._block_size

    # --- status and metrics -------------------------------------------------

    def is_finished(self) -> bool:
        return self.status > RequestStatus.PREEMPTED

    def get_finished_reason(self) -> FinishReason | None:
        return _FINISHED_REASONS.get(self.status)

    def record_event(self, event_type: EngineCoreEventType, timestamp: float | None = None) -> None:
        """Stamp a box the request passes; the events travel in its next output."""
        ts = time.monotonic() if timestamp is None else timestamp
        if event_type is EngineCoreEventType.QUEUED:
            self.queued_time = ts
        elif event_type is EngineCoreEventType.SCHEDULED:
            if self.first_scheduled_time is None:
                self.first_scheduled_time = ts
        elif event_type is EngineCoreEventType.FIRST_TOKEN:
            self.first_token_time = ts
        elif event_type is EngineCoreEventType.FINISHED:
            self.finished_time = ts
        self._events.append(EngineCoreEvent(event_type, ts))

    @property
    def has_events(self) -> bool:
        return bool(self._events)

    def add_prompt_logprobs(self, first_position: int, rows: LogprobsLists) -> None:
        """Keep a prefill chunk's prompt-logprob rows (only before the first output token:
        after it they were sent, and a resumed request's recompute repeats them)."""
        if self.num_output_tokens:
            return
        for j, row in enumerate(zip(rows.token_ids, rows.logprobs, rows.sampled_token_ranks)):
            self._prompt_logprob_rows[first_position + j] = row

    def take_prompt_logprobs(self) -> LogprobsLists | None:
        """Every gathered row in prompt order (then forgotten), or None."""
        if not self._prompt_logprob_rows:
            return None
        rows = [self._prompt_logprob_rows[p] for p in sorted(self._prompt_logprob_rows)]
        self._prompt_logprob_rows = {}
        return LogprobsLists(*map(list, zip(*rows)))

    def take_events(self) -> list[EngineCoreEvent] | None:
        """Events since the last call, or None (the common case, no allocation)."""
        if not self._events:
            return None
        events, self._events = self._events, []
        return events

    def __repr__(self) -> str:
        return (
            f"Request({self.req_id!r}, status={self.status.name}, "
            f"num_tokens={self.num_tokens}, num_computed_tokens={self.num_computed_tokens}, "
            f"placeholders={self.num_output_placeholders})"
        )
