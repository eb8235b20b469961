"""Pipeline microbatches: several synchronous steps in flight, each with requests of its
own, so a pipeline's stage 0 can start step N+1 while later stages finish step N."""

from __future__ import annotations

import pytest

from jaxserve.engine_core.core import EngineCore

from .fake_worker import FakeAsyncWorker
from .helpers import BS, EOS, make_scheduler
from .test_core import add_requests, run


def make_core(num_microbatches: int, num_blocks: int = 64):
    sched = make_scheduler(num_blocks=num_blocks, max_num_seqs=8, max_model_len=40,
                           max_num_batched_tokens=24, num_microbatches=num_microbatches)
    worker = FakeAsyncWorker(num_blocks, BS, eos_token_id=EOS, eos_prob=0.05)
    return EngineCore(sched, worker, batch_queue_size=num_microbatches), worker


@pytest.mark.parametrize("num_microbatches", [2, 3])
@pytest.mark.parametrize("num_blocks", [64, 12])  # 12 pages: preemptions
def test_steps_in_flight_hold_disjoint_requests_and_give_the_same_tokens(
        num_microbatches: int, num_blocks: int) -> None:
    core, _ = make_core(1, num_blocks)
    add_requests(core)
    want = run(core, use_batch_queue=False)
    core, worker = make_core(num_microbatches, num_blocks)
    dispatch = worker.execute_model_async
    overlaps = []

    def checked_dispatch(so):
        in_flight = [h for h in worker.handles if not h.result_called]
        # Requests whose in-flight step samples a token (the fake worker has it already).
        busy = {r for h in in_flight
                for r, toks in zip(h.result().req_ids, h.result().sampled_token_ids) if toks}
        for h in in_flight:
            h.result_called = False  # (peeking is not waiting)
        # A request whose token is in flight is never scheduled (its next prefill chunk
        # may be, after a chunk that sampled nothing).
        assert not busy & set(so.num_scheduled_tokens), busy & set(so.num_scheduled_tokens)
        assert len(so.num_scheduled_tokens) <= -(-8 // num_microbatches)
        overlaps.append(len(in_flight))
        return dispatch(so)

    core._execute_async = checked_dispatch
    add_requests(core)
    got = run(core, use_batch_queue=True)
    assert got == want
    # Steps dispatched while others were in flight (all of them, given enough pages).
    assert max(overlaps) >= 1
    if num_blocks == 64:
        assert max(overlaps) == num_microbatches - 1
    if num_blocks == 12:
        assert core.scheduler.total_num_preemptions > 0
