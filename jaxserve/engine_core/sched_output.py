"""What the scheduler decided for one step: the only contract to the worker.

The worker keeps its own copy of every request in its batch. A request's full
data is sent once (NewRequestData), when it is admitted or resumed after a
preemption; afterwards only diffs (CachedRequestData). The worker appends its
own sampled tokens to its copy, so tokens never travel back here.

Worker order of operations for one SchedulerOutput:
  1. drop finished_req_ids and preempted_req_ids (ids it does not hold are ignored),
  2. add scheduled_new_reqs (block table = block_ids),
  3. extend block tables with new_block_ids of scheduled_cached_reqs,
  4. compute num_scheduled_tokens[r] tokens for each r from position
     num_computed_tokens, and sample for r iff that reaches the end of its
     tokens (with async scheduling: its tokens including its own sampled ones).
     In each layer, write the KV of every scheduled token before attention
     reads: a request may hit prefix-cache pages that another request of the
     same step is filling.
A step with total_num_scheduled_tokens == 0 only carries ids to drop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from jaxserve.pooling_params import PoolingParams
from jaxserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from jaxserve.engine_core.block_pool import KVCacheBlock
    from jaxserve.engine_core.request import Request


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # non-empty only when a preempted request is resumed (recompute)
    sampling_params: SamplingParams
    block_ids: tuple[list[int], ...]  # one block table per KV cache group
    num_computed_tokens: int  # prefix-cache hit length (or 0)
    # The sampler keeps it (and stop_token_ids) from being sampled before min_tokens.
    eos_token_id: int | None = None
    pooling_params: PoolingParams | None = None  # an embedding request (worker/pooler.py)

    @classmethod
    def from_request(cls, request: Request, block_ids: tuple[list[int], ...]) -> NewRequestData:
        return cls(
            req_id=request.req_id,
            prompt_token_ids=request.prompt_token_ids,
            # NOTE: a copy: the scheduler keeps appending to the request's list.
            output_token_ids=list(request.output_token_ids),
            sampling_params=request.sampling_params,
            block_ids=block_ids,
            num_computed_tokens=request.num_computed_tokens,
            eos_token_id=request.eos_token_id,
            pooling_params=request.pooling_params,
        )


@dataclass
class CachedRequestData:
    """Diffs for requests already in the worker's batch; parallel lists."""

    req_ids: list[str]
    new_block_ids: list[tuple[list[int], ...]]  # pages added to each group's table
    num_computed_tokens: list[int]  # before this step's tokens

    @classmethod
    def make_empty(cls) -> CachedRequestData:
        return cls(req_ids=[], new_block_ids=[], num_computed_tokens=[])

    @classmethod
    def from_requests(
        cls, requests: list[Request],
        req_to_new_blocks: dict[str, tuple[list[KVCacheBlock], ...]],
    ) -> CachedRequestData:
        """Diffs of `requests`, read before their num_computed_tokens advance."""
        data = cls.make_empty()
        for r in requests:
            data.req_ids.append(r.req_id)
            data.new_block_ids.append(
                tuple([b.block_id for b in blocks] for blocks in req_to_new_blocks[r.req_id]))
            data.num_computed_tokens.append(r.num_computed_tokens)
        return data


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]  # finished or aborted since the previous step; the worker drops them
    preempted_req_ids: set[str]  # the worker drops them; they come back later as NewRequestData
    # Structured outputs: req_id -> int32[ceil(vocab / 32)], the tokens its grammar allows now.
    grammar_bitmask: dict[str, Any] | None = None
    # Speculative decoding: req_id -> draft tokens, scheduled after the request's next
    # input token (num_scheduled_tokens counts them); the worker verifies them.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)

    @classmethod
    def make_empty(cls) -> SchedulerOutput:
        return cls([], CachedRequestData.make_empty(), {}, 0, set(), set())
