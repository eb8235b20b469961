"""Small builders shared by the scheduler tests."""

from __future__ import annotations

import zlib

from jaxserve.config import CacheConfig, SchedulerConfig, SchedulingPolicy, SpeculativeConfig
from jaxserve.engine_core.core_outputs import EngineCoreOutput
from jaxserve.engine_core.model_runner_output import ModelRunnerOutput
from jaxserve.engine_core.request import Request
from jaxserve.engine_core.sched_output import SchedulerOutput
from jaxserve.engine_core.scheduler import Scheduler
from jaxserve.sampling_params import SamplingParams

EOS = 2
BS = 4


def make_scheduler(
    *,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 64,
    num_blocks: int = 64,
    policy: SchedulingPolicy = SchedulingPolicy.FCFS,
    enable_prefix_caching: bool = True,
    async_scheduling: bool = False,
    enable_chunked_prefill: bool = True,
    speculative_config: SpeculativeConfig | None = None,
    num_microbatches: int = 1,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            policy=policy,
            async_scheduling=async_scheduling,
            enable_chunked_prefill=enable_chunked_prefill,
            num_microbatches=num_microbatches,
        ),
        CacheConfig(block_size=BS, enable_prefix_caching=enable_prefix_caching),
        num_blocks=num_blocks,
        eos_token_id=EOS,
        speculative_config=speculative_config,
    )


def make_request(
    req_id: str,
    num_prompt_tokens: int = 8,
    *,
    prompt: list[int] | None = None,
    priority: int = 0,
    arrival_time: float | None = None,
    **sampling: object,
) -> Request:
    sampling.setdefault("max_tokens", 16)
    if prompt is None:
        # Distinct per request (no accidental prefix hits), never EOS.
        base = 1000 * (zlib.crc32(req_id.encode()) % 1000 + 1)
        prompt = [base + i for i in range(num_prompt_tokens)]
    return Request(
        req_id,
        prompt,
        SamplingParams(**sampling),  # type: ignore[arg-type]
        priority=priority,
        arrival_time=arrival_time,
    )


def schedule(sched: Scheduler) -> SchedulerOutput:
    """sched.schedule(), noting which requests this step samples for (those
    whose scheduled chunk reaches the end of their tokens, placeholders
    included), as the worker would know."""
    so = sched.schedule()
    so.samples = {  # type: ignore[attr-defined]
        r: sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens
        for r in so.num_scheduled_tokens
    }
    return so


def model_output(
    sched: Scheduler, so: SchedulerOutput, tokens: dict[str, int] | int = 7
) -> ModelRunnerOutput:
    """What a worker returns for `so` (from schedule()): a token for every
    request it samples for, [] for partial prefills."""
    req_ids = list(so.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        tok = tokens.get(req_id, 7) if isinstance(tokens, dict) else tokens
        sampled.append([tok] if so.samples[req_id] else [])  # type: ignore[attr-defined]
    return ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled)


def step(
    sched: Scheduler, tokens: dict[str, int] | int = 7
) -> tuple[SchedulerOutput, dict[str, EngineCoreOutput]]:
    so = schedule(sched)
    outs = sched.update_from_output(so, model_output(sched, so, tokens))
    return so, {o.req_id: o for o in outs}


def run_until_done(sched: Scheduler, tokens: dict[str, int] | int = 7, max_steps: int = 1000):
    finished: dict[str, EngineCoreOutput] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return finished
        _, outs = step(sched, tokens)
        finished.update({r: o for r, o in outs.items() if o.finished})
    raise AssertionError("requests did not finish")
