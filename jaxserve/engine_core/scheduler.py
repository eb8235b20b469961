"""Decides, every step, which requests compute how many tokens (vLLM V1's Scheduler).

There is no prefill or decode phase. Each request has `num_computed_tokens`
and `num_tokens`; a step gives requests tokens so the first catches up with the
second, under a token budget (`max_num_batched_tokens`) and a cap on running
requests (`max_num_seqs`). That one rule yields continuous batching, chunked
prefill and prefix-cache hits:

    step 1: A [prompt 0:512)   (chunk)           budget 512
    step 2: A [512:700) + B [0:324)              A first: running before waiting
    step 3: A decode 1  + B [324:600) ...

Running requests are served first, in order; when pages run out the worst one
(FCFS: latest arrival; PRIORITY: highest priority value, then latest arrival)
is preempted by recompute. Waiting requests are admitted only when their whole
remaining prompt fits in free pages (a sliding-window group's: the first chunk's,
since it gives pages back as the window moves), and never in a step that preempted.

Pipeline microbatches (`num_microbatches` > 1, without async scheduling): up to
that many steps are in flight, each with its own requests (one in flight is not
scheduled again: its tokens are not known) and at most max_num_seqs /
num_microbatches of them, so stage 0 of step N+1 runs while later pipeline
stages still work on step N.

Async scheduling: step N+1 is scheduled before step N's sampled tokens are
known. A step that brings a request to the end of its known tokens adds an
output placeholder; the next step computes that placeholder (the worker feeds
its own sampled token) and update_from_output replaces it with the real token.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from jaxserve.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from jaxserve.engine_core.block_pool import KVCacheBlock
from jaxserve.engine_core.core_outputs import EngineCoreEventType, EngineCoreOutput
from jaxserve.engine_core.kv_cache_manager import KVCacheManager
from jaxserve.engine_core.model_runner_output import ModelRunnerOutput
from jaxserve.engine_core.request import InvalidRequestError, Request, RequestStatus
from jaxserve.engine_core.request_queue import create_request_queue, select_victim
from jaxserve.engine_core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from jaxserve.engine_core.sched_utils import append_until_stop, check_new_request, waits_for_tokens_in_flight
from jaxserve.engine_core.spec_decode import Drafter
from jaxserve.engine_core.stats import SchedulerStats
from jaxserve.engine_core.structured_output import StructuredOutputManager
from jaxserve.kv_cache_spec import FULL_ATTENTION, KVCacheGroups

_RUNNING = RequestStatus.RUNNING


class Scheduler:
    """The engine core's scheduler. `num_blocks` (KV pages, page 0 included) comes from
    the worker's memory profiling, `kv_cache_groups` from the resolved config;
    `eos_token_id` is used for requests that do not carry their own."""

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        eos_token_id: int | None = None,
        structured_output: StructuredOutputManager | None = None,
        speculative_config: SpeculativeConfig | None = None,
        kv_cache_groups: KVCacheGroups = FULL_ATTENTION,
        num_state_slots: int = 0,
    ) -> None:
        self.scheduler_config = scheduler_config
        self.structured_output = structured_output or StructuredOutputManager()
        self.cache_config = cache_config
        self.max_num_running_reqs = scheduler_config.max_num_seqs
        self.max_num_scheduled_tokens = scheduler_config.max_num_batched_tokens
        if scheduler_config.max_model_len is None:
            raise ValueError("max_model_len must be resolved (engine/resolve.py) before a Scheduler is built")
        self.max_model_len: int = scheduler_config.max_model_len
        self.policy = scheduler_config.policy
        self.enable_chunked_prefill = scheduler_config.enable_chunked_prefill
        self.async_scheduling = scheduler_config.async_scheduling
        self.block_size = cache_config.block_size
        self.eos_token_id = eos_token_id

        kv_cache_groups.check_holds(num_blocks, self.max_model_len, self.block_size,
                                    self.max_num_scheduled_tokens)
        self.kv_cache_manager = KVCacheManager(
            num_blocks, self.block_size, self.max_model_len, cache_config.enable_prefix_caching,
            kv_cache_groups, num_state_slots,
        )
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(self.policy)
        self.running: list[Request] = []
        # Ids the worker must drop, sent with the next SchedulerOutput.
        self.finished_req_ids: set[str] = set()
        self.unstepped_outputs: list[EngineCoreOutput] = []  # of requests ended outside a step
        self.num_preemptions = 0  # since the previous make_stats()
        self.total_num_preemptions = 0
        spec = speculative_config
        if spec is not None and self.async_scheduling:
            raise ValueError("speculative decoding needs async_scheduling=False")
        if (not self.enable_chunked_prefill and cache_config.enable_prefix_caching
                and any(g.state_block_size for g in kv_cache_groups.groups)):
            raise ValueError("kept recurrent states (prefix caching of a model with "
                             "linear-attention layers) need chunked prefill: a step ends on "
                             "each state block's boundary")
        if spec is not None and kv_cache_groups.has_recurrent:
            raise ValueError("speculative decoding is not supported for models with recurrent "
                             "(linear-attention) layers: their state cannot be rolled back past "
                             "a rejected draft; drop --speculative-config")
        self.max_reqs_per_step = -(-self.max_num_running_reqs // scheduler_config.num_microbatches)
        self.drafter = Drafter(spec, self.max_num_running_reqs) if spec is not None else None

    # --- requests in and out ------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a new request; raises InvalidRequestError for one that can never run."""
        if request.req_id in self.requests:
            raise InvalidRequestError(f"request id {request.req_id!r} is already in the engine")
        check_new_request(request, self.max_model_len)
        if request.eos_token_id is None:
            request.eos_token_id = self.eos_token_id
        self.structured_output.add_request(request)
        kv = self.kv_cache_manager
        if kv.block_hasher is not None:
            request.set_block_hasher(kv.block_hasher, self.block_size)
        self.requests[request.req_id] = request
        self.waiting.add_request(request)
        request.record_event(EngineCoreEventType.QUEUED)

    def finish_requests(self, req_ids: str | Iterable[str], finished_status: RequestStatus) -> None:
        """End requests from outside the step (aborts). Unknown ids are ignored:
        the request may have finished on its own meanwhile."""
        if not finished_status.is_finished():
            raise ValueError(f"finished_status must be a FINISHED_* status, got {finished_status}")
        if isinstance(req_ids, str):
            req_ids = (req_ids,)
        stopped: list[tuple[Request, bool]] = []
        for req_id in req_ids:
            request = self.requests.get(req_id)
            if request is not None:
                was_running = request.status is _RUNNING
                request.status = finished_status
                self._free_request(request, was_running)
                stopped.append((request, was_running))
        self._drop_from_queues(stopped)

    def _free_request(self, request: Request, was_running: bool) -> None:
        """Release a request whose FINISHED_* status is set (`_drop_from_queues` follows)."""
        # NOTE: only a RUNNING request is in the worker's batch; a preempted
        # one was already dropped through preempted_req_ids.
        if was_running:
            self.finished_req_ids.add(request.req_id)
        request.record_event(EngineCoreEventType.FINISHED)
        self.kv_cache_manager.free(request)
        self.structured_output.remove_request(request.req_id)
        del self.requests[request.req_id]

    def _drop_from_queues(self, stopped: list[tuple[Request, bool]]) -> None:
        """Take freed requests (and whether each was running) out of `running` / `waiting`,
        one pass over each."""
        stopped_running = {r for r, was_running in stopped if was_running}
        if stopped_running:
            self.running = [r for r in self.running if r not in stopped_running]
        if len(stopped_running) < len(stopped):
            self.waiting.remove_requests([r for r, was_running in stopped if not was_running])

    # --- schedule -----------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Decide this step: running requests first, then admissions."""
        now = time.monotonic()
        num_scheduled_tokens: dict[str, int] = {}
        req_to_new_blocks: dict[str, tuple[list[KVCacheBlock], ...]] = {}
        scheduled_running_reqs: list[Request] = []
        scheduled_new_reqs: list[Request] = []
        preempted_reqs: list[Request] = []
        drafter = self.drafter
        if drafter is not None:
            drafter.start_step()
        self.kv_cache_manager.new_step()

        token_budget = self._schedule_running(
            self.max_num_scheduled_tokens, now, scheduled_running_reqs, req_to_new_blocks,
            num_scheduled_tokens, preempted_reqs,
        )
        if drafter is not None:
            token_budget = drafter.keep_if_they_pay(
                token_budget, self.max_num_scheduled_tokens, num_scheduled_tokens)
        # NOTE: no admissions in a step that preempted: the pages just freed
        # would go to a newcomer and the preempted request would thrash.
        if not preempted_reqs:
            token_budget = self._schedule_waiting(
                token_budget, now, scheduled_new_reqs, num_scheduled_tokens
            )

        # NOTE: the request data is built before _update_after_schedule
        # advances num_computed_tokens: the worker needs the old values.
        get_block_ids = self.kv_cache_manager.get_block_ids
        scheduler_output = SchedulerOutput(
            scheduled_new_reqs=[
                NewRequestData.from_request(r, get_block_ids(r.req_id)) for r in scheduled_new_reqs
            ],
            scheduled_cached_reqs=CachedRequestData.from_requests(
                scheduled_running_reqs, req_to_new_blocks
            ),
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=self.max_num_scheduled_tokens - token_budget,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids={r.req_id for r in preempted_reqs},
            grammar_bitmask=self.structured_output.step_bitmasks(num_scheduled_tokens),
            scheduled_spec_decode_tokens=drafter.step_drafts if drafter is not None else {},
        )
        self.finished_req_ids = set()
        self._update_after_schedule(scheduled_running_reqs, num_scheduled_tokens)
        self._update_after_schedule(scheduled_new_reqs, num_scheduled_tokens)
        return scheduler_output

    def _schedule_running(
        self,
        token_budget: int,
        now: float,
        scheduled_running_reqs: list[Request],
        req_to_new_blocks: dict[str, tuple[list[KVCacheBlock], ...]],
        num_scheduled_tokens: dict[str, int],
        preempted_reqs: list[Request],
    ) -> int:
        """Give running requests their tokens in order, preempting the worst
        running request whenever pages run out; returns the budget left."""
        running = self.running
        allocate_slots = self.kv_cache_manager.allocate_slots
        chunk_limit = self.kv_cache_manager.chunk_limit
        max_model_len = self.max_model_len
        req_index = 0
        max_reqs = self.max_reqs_per_step
        drafter = self.drafter
        while req_index < len(running) and token_budget > 0 and len(scheduled_running_reqs) < max_reqs:
            request = running[req_index]
            placeholders = request.num_output_placeholders
            if placeholders and waits_for_tokens_in_flight(request, max_model_len):
                req_index += 1
                continue
            num_computed = request.num_computed_tokens
            num_new_tokens = request.num_tokens + placeholders - num_computed
            if num_new_tokens > token_budget:
                num_new_tokens = token_budget
            if num_new_tokens > max_model_len - 1 - num_computed:
                # The token at the last position is sampled, never an input.
                num_new_tokens = max_model_len - 1 - num_computed
            limit = chunk_limit(num_computed)  # ends on a kept state's boundary
            if limit is not None and num_new_tokens > limit:
                num_new_tokens = limit
            if num_new_tokens <= 0:
                req_index += 1
                continue
            drafts = None
            if num_new_tokens == 1 and drafter is not None:
                drafts = drafter.propose(request, len(running), token_budget, max_model_len)
                num_new_tokens += len(drafts)
            while True:
                new_blocks = allocate_slots(request, num_new_tokens)
                if new_blocks is not None:
                    break
                victim_index = select_victim(running, self.policy)
                victim = running.pop(victim_index)
                if victim_index < req_index:
                    req_index -= 1
                    if victim.req_id in num_scheduled_tokens:
                        # Already scheduled in this step: give its tokens back.
                        scheduled_running_reqs.remove(victim)
                        token_budget += num_scheduled_tokens.pop(victim.req_id)
                        del req_to_new_blocks[victim.req_id]
                        if drafter is not None:
                            drafter.drop(victim.req_id)
                self._preempt_request(victim, now)
                preempted_reqs.append(victim)
                if victim is request:
                    break
            if new_blocks is None:
                if drafter is not None:
                    drafter.give_back(drafts)
                continue  # `request` preempted itself; running[req_index] is the next one
            scheduled_running_reqs.append(request)
            req_to_new_blocks[request.req_id] = new_blocks
            num_scheduled_tokens[request.req_id] = num_new_tokens
            if drafter is not None and drafts:
                drafter.step_drafts[request.req_id] = drafts
            token_budget -= num_new_tokens
            req_index += 1
        return token_budget

    def observe_step_time(self, num_tokens: int, seconds: float) -> None:
        """A synchronous step's duration (the engine core's clock), for DraftPolicy."""
        if self.drafter is not None:
            self.drafter.policy.observe_step(num_tokens, seconds)

    def _schedule_waiting(
        self,
        token_budget: int,
        now: float,
        scheduled_new_reqs: list[Request],
        num_scheduled_tokens: dict[str, int],
    ) -> int:
        """Admit waiting requests in queue order while their whole remaining
        prompt fits in free pages; returns the budget left."""
        kv = self.kv_cache_manager
        waiting = self.waiting
        skipped: list[Request] = []
        while (waiting and token_budget > 0 and len(self.running) < self.max_num_running_reqs
               and len(num_scheduled_tokens) < self.max_reqs_per_step):
            request = waiting.peek_request()
            ready = self.structured_output.ready(request.req_id)
            if ready is False:  # its grammar is still compiling: later requests may go first
                skipped.append(waiting.pop_request())
                continue
            if ready is not True:  # its grammar failed to compile: it ends, with the error
                waiting.pop_request()
                request.status, request.stop_reason = RequestStatus.FINISHED_ERROR, ready
                self._free_request(request, False)
                self.unstepped_outputs.append(EngineCoreOutput.from_request(request, [], None))
                continue
            if request.num_steps_in_flight:
                # NOTE: preempted while a step holding it was in flight; a token
                # it samples arrives with that step's output, then it can be
                # resumed with all its tokens known.
                skipped.append(waiting.pop_request())
                continue
            computed_blocks, num_computed = kv.get_computed_blocks(request)
            num_new_tokens = request.num_tokens - num_computed
            num_to_schedule = min(num_new_tokens, token_budget, kv.chunk_limit(num_computed)
                                  or num_new_tokens)
            if num_to_schedule < num_new_tokens and not self.enable_chunked_prefill:
                break
            new_blocks = kv.allocate_slots(
                request,
                num_to_schedule,
                num_computed,
                computed_blocks,
                num_lookahead_tokens=num_new_tokens - num_to_schedule,
            )
            if new_blocks is None:
                break  # head of line: later requests wait their turn
            waiting.pop_request()
            self.running.append(request)
            request.status = _RUNNING
            request.num_computed_tokens = num_computed
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_computed
            request.record_event(EngineCoreEventType.SCHEDULED, now)
            scheduled_new_reqs.append(request)
            num_scheduled_tokens[request.req_id] = num_to_schedule
            token_budget -= num_to_schedule
        if skipped:
            waiting.prepend_requests(skipped)
        return token_budget

    def _preempt_request(self, request: Request, timestamp: float) -> None:
        """Free the request's pages; it is recomputed from scratch when resumed.
        The caller has removed it from `running`."""
        assert request.status is _RUNNING
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.total_num_preemptions += 1
        request.record_event(EngineCoreEventType.PREEMPTED, timestamp)
        self.waiting.prepend_request(request)

    def _update_after_schedule(
        self, requests: list[Request], num_scheduled: dict[str, int]
    ) -> None:
        """Advance num_computed_tokens now (vLLM's _update_after_schedule), so
        the next step can be scheduled before this one's output arrives."""
        async_scheduling = self.async_scheduling
        for request in requests:
            request.num_computed_tokens += num_scheduled[request.req_id]
            request.num_steps_in_flight += 1
            if async_scheduling and (request.num_computed_tokens
                                     == request.num_tokens + request.num_output_placeholders):
                # This step samples a token for the request that is not known yet.
                request.num_output_placeholders += 1

    # --- update -------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append the sampled tokens, finish requests that stopped, and return
        one EngineCoreOutput per request with new tokens or a finish."""
        outputs = self.take_unstepped_outputs()
        sampled_token_ids = model_runner_output.sampled_token_ids
        req_id_to_index = model_runner_output.req_id_to_index
        logprobs = model_runner_output.logprobs
        prompt_lps = model_runner_output.prompt_logprobs
        pooled = model_runner_output.pooler_output
        requests = self.requests
        async_scheduling = self.async_scheduling
        stopped: list[tuple[Request, bool]] = []
        for req_id in scheduler_output.num_scheduled_tokens:
            request = requests.get(req_id)
            if request is None:
                continue  # finished or aborted while this step was in flight
            request.num_steps_in_flight -= 1
            index = req_id_to_index.get(req_id)
            if index is None:
                continue
            if prompt_lps and req_id in prompt_lps:
                request.add_prompt_logprobs(*prompt_lps[req_id])
            if pooled and req_id in pooled:  # an embedding request's prompt is done
                request.pooling_output = pooled[req_id]
            new_token_ids = sampled_token_ids[index]
            if not new_token_ids:
                continue  # partial prefill: nothing sampled
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
            if drafts:
                # Rejected drafts' KV is overwritten by the next steps.
                request.num_computed_tokens -= len(drafts) + 1 - len(new_token_ids)
                assert self.drafter is not None  # only the drafter schedules drafts
                self.drafter.verified(len(drafts), len(new_token_ids))
            if async_scheduling and not request.num_output_placeholders:
                continue  # a token nobody scheduled for: stale output
            was_running = request.status is _RUNNING
            new_token_ids, finished = append_until_stop(request, new_token_ids, self.max_model_len)
            if async_scheduling:  # the tokens fill their placeholders
                request.num_output_placeholders -= len(new_token_ids)
                self.kv_cache_manager.cache_filled_pages(request, len(new_token_ids))
            error = self.structured_output.accept_tokens(req_id, new_token_ids)
            if error is not None and not finished:  # never unconstrained text: it ends here
                request.status, request.stop_reason, finished = RequestStatus.FINISHED_ERROR, error, True
            if finished:
                stopped.append((request, was_running))
                self._free_request(request, was_running)
            new_logprobs = None
            if logprobs is not None and request.sampling_params.logprobs is not None:
                new_logprobs = logprobs.slice(index, index + 1)
            outputs.append(EngineCoreOutput.from_request(request, new_token_ids, new_logprobs))
        self._drop_from_queues(stopped)
        return outputs

    # --- state and stats ----------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return len(self.waiting) + len(self.running) > 0

    def take_unstepped_outputs(self) -> list[EngineCoreOutput]:
        """Outputs of requests ended outside a step, when no step will carry them."""
        outputs, self.unstepped_outputs = self.unstepped_outputs, []
        return outputs

    def has_requests(self) -> bool:
        """Whether a step has anything to do: schedule, or send finished ids to the worker."""
        return self.has_unfinished_requests() or bool(self.finished_req_ids)

    def make_stats(self) -> SchedulerStats:
        """Snapshot for metrics; resets the counters that are deltas."""
        stats = SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
            kv_cache_usage_by_kind=self.kv_cache_manager.usage_by_kind(),
            prefix_cache_stats=self.kv_cache_manager.make_prefix_cache_stats(),
            num_preemptions=self.num_preemptions,
            spec_decoding_stats=self.drafter.take_stats() if self.drafter is not None else None,
        )
        self.num_preemptions = 0
        return stats

    def reset_prefix_cache(self) -> bool:
        """Forget cached pages; refused (False) while requests hold pages."""
        return self.kv_cache_manager.reset_prefix_cache()
