"""Scheduler rules, one test each (issue 3)."""

import msgpack
import pytest

from jaxserve.config import SchedulingPolicy
from jaxserve.engine_core.core_outputs import EngineCoreEventType, EngineCoreOutput
from jaxserve.engine_core.model_runner_output import LogprobsLists, ModelRunnerOutput
from jaxserve.engine_core.request import RequestStatus
from jaxserve.engine_core.step_trace import StepEntry, StepTrace
from jaxserve.engine_core.wire import decode_record, encode_record
from jaxserve.outputs import FinishReason

from .helpers import (
    EOS,
    make_request,
    make_scheduler,
    model_output,
    run_until_done,
    schedule,
    step,
)

# --- budget, chunked prefill, contract -----------------------------------------


def test_chunked_prefill_under_the_token_budget():
    sched = make_scheduler(max_num_batched_tokens=16)
    sched.add_request(make_request("a", 40))
    so, outs = step(sched)
    assert so.num_scheduled_tokens == {"a": 16} and so.total_num_scheduled_tokens == 16
    (new,) = so.scheduled_new_reqs
    assert new.num_computed_tokens == 0 and new.output_token_ids == []
    assert len(new.block_ids[0]) == 10  # the whole prompt's pages are reserved at admission
    assert outs == {}  # partial prefill: nothing sampled
    so, outs = step(sched)
    assert so.scheduled_new_reqs == [] and so.scheduled_cached_reqs.req_ids == ["a"]
    assert so.scheduled_cached_reqs.num_computed_tokens == [16]
    assert so.num_scheduled_tokens == {"a": 16} and outs == {}
    so, outs = step(sched)
    assert so.num_scheduled_tokens == {"a": 8}
    assert outs["a"].new_token_ids == [7]
    so, outs = step(sched)
    assert so.num_scheduled_tokens == {"a": 1}  # decode
    assert so.scheduled_cached_reqs.num_computed_tokens == [40]
    last_page = sched.kv_cache_manager.get_block_ids("a")[0][-1]
    assert so.scheduled_cached_reqs.new_block_ids == [([last_page],)]


def test_new_request_data_once_then_diffs_with_new_pages():
    sched = make_scheduler()
    sched.add_request(make_request("a", 7))
    so, _ = step(sched)
    assert [n.req_id for n in so.scheduled_new_reqs] == ["a"]
    (block_ids,) = so.scheduled_new_reqs[0].block_ids
    so, _ = step(sched)  # position 7: still page 1
    assert so.scheduled_new_reqs == [] and so.scheduled_cached_reqs.new_block_ids == [([],)]
    so, _ = step(sched)  # position 8: a new page
    ((new_ids,),) = so.scheduled_cached_reqs.new_block_ids
    assert len(new_ids) == 1
    assert (block_ids + new_ids,) == sched.kv_cache_manager.get_block_ids("a")


def test_running_requests_are_served_before_waiting_ones():
    sched = make_scheduler(max_num_batched_tokens=16)
    sched.add_request(make_request("a", 8))
    step(sched)
    sched.add_request(make_request("b", 40))
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"a": 1, "b": 15}
    assert list(so.num_scheduled_tokens) == ["a", "b"]


def test_max_num_seqs_caps_running_requests():
    sched = make_scheduler(max_num_seqs=2)
    for r in "abc":
        sched.add_request(make_request(r, 4, max_tokens=2))
    so, _ = step(sched)
    assert set(so.num_scheduled_tokens) == {"a", "b"} and len(sched.running) == 2
    so, _ = step(sched)  # a and b finish (2 tokens each)
    assert set(so.num_scheduled_tokens) == {"a", "b"}
    so, _ = step(sched)
    assert set(so.num_scheduled_tokens) == {"c"}


def test_without_chunked_prefill_a_prompt_is_never_split():
    sched = make_scheduler(
        enable_chunked_prefill=False, max_num_batched_tokens=64, max_model_len=64
    )
    sched.add_request(make_request("a", 40))
    sched.add_request(make_request("b", 40))
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"a": 40}
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"a": 1, "b": 40}


# --- admission and preemption ------------------------------------------------


def test_waiting_request_admitted_only_when_its_whole_prompt_fits():
    # 8 pages of 4 tokens. a takes 5; b needs 4 (only 3 free) though its first
    # chunk would fit; c fits but waits behind b (first come, first served).
    sched = make_scheduler(num_blocks=9, max_model_len=32, max_num_batched_tokens=24)
    sched.add_request(make_request("a", 20, max_tokens=1))
    sched.add_request(make_request("b", 16))
    sched.add_request(make_request("c", 4))
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"a": 20}
    assert [r.req_id for r in sched.waiting] == ["b", "c"]
    so, _ = step(sched)  # a finished and freed its pages
    assert so.num_scheduled_tokens == {"b": 16, "c": 4}


def _two_running_in_a_full_cache(policy, a_prio=0, b_prio=0):
    # 4 pages; a and b take 2 each; a's next token needs a third page.
    sched = make_scheduler(num_blocks=5, max_model_len=16, policy=policy,
                           enable_prefix_caching=False)
    sched.add_request(make_request("a", 8, priority=a_prio, arrival_time=1.0))
    sched.add_request(make_request("b", 8, priority=b_prio, arrival_time=2.0))
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"a": 8, "b": 8}
    assert sched.kv_cache_manager.get_num_free_blocks() == 0
    return sched


def test_fcfs_preempts_the_latest_arrival_by_recompute():
    sched = _two_running_in_a_full_cache(SchedulingPolicy.FCFS)
    sched.add_request(make_request("c", 3, arrival_time=3.0))  # would fit after the preemption
    b = sched.requests["b"]
    so, _ = step(sched)
    assert so.preempted_req_ids == {"b"}
    assert so.num_scheduled_tokens == {"a": 1}
    assert so.scheduled_new_reqs == []  # no admission in a step that preempted
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and sched.kv_cache_manager.get_block_ids("b") == ([],)
    assert [r.req_id for r in sched.waiting] == ["b", "c"]  # front of the queue
    resumed = None
    for _ in range(50):
        so, _ = step(sched)
        for new in so.scheduled_new_reqs:
            if new.req_id == "b":
                resumed = new
        if resumed:
            break
    assert resumed.output_token_ids == [7] and resumed.num_computed_tokens == 0
    assert so.num_scheduled_tokens["b"] == 9  # prompt + output recomputed
    assert set(run_until_done(sched)) <= {"a", "b", "c"}
    assert sched.kv_cache_manager.get_num_free_blocks() == 4


def test_priority_preempts_the_worst_priority_even_if_it_arrived_first():
    # b arrived later but has the better priority; FCFS would preempt b.
    sched = _two_running_in_a_full_cache(SchedulingPolicy.PRIORITY, a_prio=5, b_prio=0)
    so, _ = step(sched)
    assert so.preempted_req_ids == {"a"}
    assert so.num_scheduled_tokens == {"b": 1}


def test_preempting_a_request_scheduled_earlier_in_the_step_gives_back_its_tokens():
    sched = make_scheduler(num_blocks=5, max_model_len=16, policy=SchedulingPolicy.PRIORITY,
                           enable_prefix_caching=False)
    sched.add_request(make_request("worst", 6, priority=5))
    step(sched)  # worst: 7 tokens in pages 0-1
    sched.add_request(make_request("best", 8, priority=0))
    so, _ = step(sched)  # worst decodes inside page 1; best takes the last 2 pages
    assert so.num_scheduled_tokens == {"worst": 1, "best": 8}
    so, _ = step(sched)  # worst is scheduled first, then best needs a page
    assert so.preempted_req_ids == {"worst"}
    assert so.num_scheduled_tokens == {"best": 1}
    assert so.scheduled_cached_reqs.req_ids == ["best"]
    assert so.total_num_scheduled_tokens == 1


def test_no_admission_in_a_step_that_preempted():
    # c has the best rank in the waiting heap and fits in the page freed by
    # the preemption of b, but admitting it now would make b thrash.
    sched = _two_running_in_a_full_cache(SchedulingPolicy.PRIORITY, a_prio=0, b_prio=1)
    sched.add_request(make_request("c", 3, priority=0, arrival_time=3.0))
    so, _ = step(sched)
    assert so.preempted_req_ids == {"b"} and so.scheduled_new_reqs == []
    so, _ = step(sched)
    assert [n.req_id for n in so.scheduled_new_reqs] == ["c"]


def test_requests_after_an_undone_one_are_still_scheduled():
    sched = make_scheduler(num_blocks=7, max_model_len=16, policy=SchedulingPolicy.PRIORITY,
                           enable_prefix_caching=False)
    sched.add_request(make_request("worst", 6, priority=5))
    step(sched)
    sched.add_request(make_request("best", 8, priority=0, arrival_time=10.0))
    sched.add_request(make_request("third", 5, priority=1, arrival_time=11.0))
    so, _ = step(sched)  # all 6 pages in use
    assert sched.kv_cache_manager.get_num_free_blocks() == 0
    so, _ = step(sched)  # worst scheduled, then preempted for best; third still runs
    assert so.preempted_req_ids == {"worst"}
    assert so.num_scheduled_tokens == {"best": 1, "third": 1}


def test_priority_policy_orders_waiting_by_priority_then_arrival():
    sched = make_scheduler(max_num_seqs=1, policy=SchedulingPolicy.PRIORITY)
    sched.add_request(make_request("x", 4, priority=3, arrival_time=1.0, max_tokens=1))
    sched.add_request(make_request("y", 4, priority=1, arrival_time=2.0, max_tokens=1))
    sched.add_request(make_request("z", 4, priority=1, arrival_time=3.0, max_tokens=1))
    order = [step(sched)[0].scheduled_new_reqs[0].req_id for _ in range(3)]
    assert order == ["y", "z", "x"]


def test_fcfs_ignores_priority():
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request(make_request("x", 4, priority=3, max_tokens=1))
    sched.add_request(make_request("y", 4, priority=1, max_tokens=1))
    order = [step(sched)[0].scheduled_new_reqs[0].req_id for _ in range(2)]
    assert order == ["x", "y"]


# --- stop conditions ----------------------------------------------------------


@pytest.mark.parametrize(
    "sampling, tokens, n_out, reason, stop_reason",
    [
        ({}, [EOS], 1, FinishReason.STOP, None),
        ({"ignore_eos": True, "max_tokens": 3}, [EOS] * 3, 3, FinishReason.LENGTH, None),
        ({"stop_token_ids": [42]}, [5, 42], 2, FinishReason.STOP, 42),
        ({"min_tokens": 3}, [EOS, EOS, EOS], 3, FinishReason.STOP, None),
        ({"min_tokens": 2, "stop_token_ids": [42]}, [42, 42], 2, FinishReason.STOP, 42),
        ({"max_tokens": 3}, [5, 5, 5], 3, FinishReason.LENGTH, None),
        ({"max_tokens": 2}, [5, EOS], 2, FinishReason.STOP, None),  # EOS before length
    ],
)
def test_stop_conditions(sampling, tokens, n_out, reason, stop_reason):
    sched = make_scheduler()
    sched.add_request(make_request("a", 4, **sampling))
    got = []
    for tok in tokens:
        _, outs = step(sched, tok)
        got += outs["a"].new_token_ids
        if outs["a"].finished:
            break
    assert len(got) == n_out
    assert outs["a"].finish_reason is reason and outs["a"].stop_reason == stop_reason


def test_max_model_len_caps_the_request():
    sched = make_scheduler(max_model_len=16)
    sched.add_request(make_request("a", 14, max_tokens=10, min_tokens=5))
    got = []
    for _ in range(5):
        _, outs = step(sched)
        got += outs["a"].new_token_ids
        if outs["a"].finished:
            break
    assert len(got) == 2 and outs["a"].finish_reason is FinishReason.LENGTH


def test_finished_request_pages_freed_and_id_sent_with_next_step():
    sched = make_scheduler()
    total = sched.kv_cache_manager.get_num_free_blocks()
    sched.add_request(make_request("a", 10, max_tokens=1))
    so, outs = step(sched)
    assert outs["a"].finished and sched.kv_cache_manager.get_num_free_blocks() == total
    assert so.finished_req_ids == set()
    assert sched.has_requests() and not sched.has_unfinished_requests()
    so = schedule(sched)
    assert so.finished_req_ids == {"a"} and so.total_num_scheduled_tokens == 0
    assert schedule(sched).finished_req_ids == set()
    assert not sched.has_requests()


def test_abort_running_and_waiting_requests():
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request(make_request("a", 8))
    sched.add_request(make_request("b", 8))
    so_in_flight = schedule(sched)
    sched.finish_requests(["a", "b", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert not sched.has_unfinished_requests() and sched.running == [] and len(sched.waiting) == 0
    # The step dispatched before the abort still returns a token: ignored.
    assert sched.update_from_output(so_in_flight, model_output(sched, so_in_flight)) == []
    so = schedule(sched)
    assert so.finished_req_ids == {"a"}  # b never reached the worker
    assert sched.kv_cache_manager.usage == 0.0
    with pytest.raises(ValueError, match="FINISHED"):
        sched.finish_requests("a", RequestStatus.RUNNING)


# --- prefix caching -------------------------------------------------------------


def test_prefix_cache_hit_is_sent_as_num_computed_tokens():
    sched = make_scheduler()
    prompt = list(range(100, 112))
    sched.add_request(make_request("a", prompt=prompt))
    step(sched)
    sched.add_request(make_request("b", prompt=prompt))
    so, outs = step(sched)
    new_b = next(n for n in so.scheduled_new_reqs if n.req_id == "b")
    assert new_b.num_computed_tokens == 8 and so.num_scheduled_tokens["b"] == 4
    assert new_b.block_ids[0][:2] == sched.kv_cache_manager.get_block_ids("a")[0][:2]
    assert outs["b"].num_cached_tokens == 8
    stats = sched.make_stats().prefix_cache_stats
    assert (stats.queries, stats.hits) == (24, 8)


# --- validation -----------------------------------------------------------------


def test_add_request_rejects_what_can_never_run():
    sched = make_scheduler(max_model_len=64)
    sched.add_request(make_request("a", 4))
    with pytest.raises(ValueError, match="already"):
        sched.add_request(make_request("a", 4))
    with pytest.raises(ValueError, match="empty"):
        sched.add_request(make_request("e", prompt=[]))
    with pytest.raises(ValueError, match="prompt has 64 tokens but max_model_len is 64"):
        sched.add_request(make_request("long", 64))


def test_kv_cache_must_hold_one_request_of_max_model_len():
    with pytest.raises(ValueError, match="--max-model-len 64 needs 16"):
        make_scheduler(num_blocks=16, max_model_len=64)  # 15 pages * 4 = 60 tokens
    make_scheduler(num_blocks=17, max_model_len=64)


# --- async scheduling -----------------------------------------------------------


def test_async_schedules_the_next_step_before_the_output_is_known():
    sched = make_scheduler(async_scheduling=True)
    sched.add_request(make_request("a", 8))
    a = sched.requests["a"]
    so1 = schedule(sched)
    assert so1.num_scheduled_tokens == {"a": 8} and a.num_output_placeholders == 1
    so2 = schedule(sched)  # step 1 still in flight
    assert so2.num_scheduled_tokens == {"a": 1}
    assert so2.scheduled_cached_reqs.num_computed_tokens == [8]
    assert a.num_output_placeholders == 2 and a.num_computed_tokens == 9
    outs = sched.update_from_output(so1, model_output(sched, so1, 11))
    assert outs[0].new_token_ids == [11] and a.num_output_placeholders == 1
    sched.update_from_output(so2, model_output(sched, so2, 12))
    assert a.output_token_ids == [11, 12] and a.num_output_placeholders == 0


@pytest.mark.parametrize(
    "max_tokens, prompt_len, max_model_len", [(1, 8, 64), (2, 8, 64), (8, 14, 16)]
)
def test_async_never_schedules_past_max_tokens_or_max_model_len(
    max_tokens, prompt_len, max_model_len
):
    sched = make_scheduler(async_scheduling=True, max_model_len=max_model_len)
    sched.add_request(make_request("a", prompt_len, max_tokens=max_tokens))
    expected_steps = min(max_tokens, max_model_len - prompt_len)
    in_flight = [schedule(sched) for _ in range(expected_steps + 2)]
    assert [len(so.num_scheduled_tokens) for so in in_flight] == [1] * expected_steps + [0, 0]
    outs = [o for so in in_flight for o in sched.update_from_output(so, model_output(sched, so))]
    assert sum(len(o.new_token_ids) for o in outs) == expected_steps
    assert outs[-1].finish_reason is FinishReason.LENGTH


def test_async_output_for_a_finished_request_is_ignored():
    sched = make_scheduler(async_scheduling=True)
    sched.add_request(make_request("a", 8))
    so1, so2 = schedule(sched), schedule(sched)
    outs = sched.update_from_output(so1, model_output(sched, so1, EOS))
    assert outs[0].finish_reason is FinishReason.STOP
    assert sched.kv_cache_manager.usage == 0.0  # freed now; step 2 still runs first on device
    assert sched.update_from_output(so2, model_output(sched, so2, 5)) == []
    assert schedule(sched).finished_req_ids == {"a"}


def _async_preempted_with_token_in_flight():
    sched = make_scheduler(num_blocks=5, max_model_len=16, async_scheduling=True,
                           enable_prefix_caching=False)
    sched.add_request(make_request("a", 8, arrival_time=1.0))
    sched.add_request(make_request("b", 8, arrival_time=2.0))
    so1 = schedule(sched)
    so2 = schedule(sched)  # a needs a page: b is preempted with its step-1 token in flight
    assert so2.preempted_req_ids == {"b"}
    b = sched.requests["b"]
    assert b.num_output_placeholders == 1
    return sched, so1, so2, b


def test_async_preempted_request_resumes_only_after_its_in_flight_token():
    sched, so1, so2, b = _async_preempted_with_token_in_flight()
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)  # now b would fit
    so3 = schedule(sched)
    assert so3.num_scheduled_tokens == {}  # b's step-1 token is unknown yet
    sched.update_from_output(so1, model_output(sched, so1, 9))
    assert b.output_token_ids == [9] and b.num_output_placeholders == 0
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    sched.update_from_output(so2, model_output(sched, so2))
    so4 = schedule(sched)
    (resumed,) = so4.scheduled_new_reqs
    assert resumed.req_id == "b" and resumed.output_token_ids == [9]
    assert so4.num_scheduled_tokens == {"b": 9}


def test_async_output_is_not_applied_to_a_new_request_reusing_the_id():
    sched = make_scheduler(async_scheduling=True)
    sched.add_request(make_request("a", 8))
    so1, so2 = schedule(sched), schedule(sched)
    sched.update_from_output(so1, model_output(sched, so1, EOS))
    sched.add_request(make_request("a", 4))
    assert sched.update_from_output(so2, model_output(sched, so2, 5)) == []
    assert sched.requests["a"].output_token_ids == []


def test_async_preempted_request_can_finish_with_its_in_flight_token():
    sched, so1, so2, b = _async_preempted_with_token_in_flight()
    outs = sched.update_from_output(so1, model_output(sched, so1, {"a": 5, "b": EOS}))
    assert {o.req_id: o.finish_reason for o in outs} == {"a": None, "b": FinishReason.STOP}
    assert [r.req_id for r in sched.waiting] == [] and "b" not in sched.requests
    assert schedule(sched).finished_req_ids == set()  # the worker dropped b at preemption


# --- outputs, metrics ------------------------------------------------------------


def test_logprobs_are_sliced_per_request_only_when_requested():
    sched = make_scheduler()
    sched.add_request(make_request("a", 4, logprobs=2))
    sched.add_request(make_request("b", 4))
    so = schedule(sched)
    lp = LogprobsLists([[7, 7, 3], [8, 1, 8]], [[-0.1, -0.1, -3.0], [-1.0, -0.5, -1.0]], [1, 2])
    mro = ModelRunnerOutput(["a", "b"], {"a": 0, "b": 1}, [[7], [8]], lp)
    outs = {o.req_id: o for o in sched.update_from_output(so, mro)}
    assert outs["a"].new_logprobs == LogprobsLists([[7, 7, 3]], [[-0.1, -0.1, -3.0]], [1])
    assert outs["b"].new_logprobs is None


def test_events_and_timestamps_are_recorded():
    sched = make_scheduler()
    sched.add_request(make_request("a", 4, max_tokens=2))
    a = sched.requests["a"]
    _, outs = step(sched)
    types = [e.type for e in outs["a"].events]
    assert types == [EngineCoreEventType.QUEUED, EngineCoreEventType.SCHEDULED,
                     EngineCoreEventType.FIRST_TOKEN]
    _, outs = step(sched)
    assert [e.type for e in outs["a"].events] == [EngineCoreEventType.FINISHED]
    assert a.arrival_time <= a.queued_time <= a.first_scheduled_time <= a.first_token_time
    assert a.first_token_time <= a.finished_time


def test_stats_snapshot_resets_deltas():
    sched = _two_running_in_a_full_cache(SchedulingPolicy.FCFS)
    step(sched)
    stats = sched.make_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs, stats.num_preemptions) == (1, 1, 1)
    assert stats.kv_cache_usage == 0.75
    assert sched.make_stats().num_preemptions == 0
    wire = msgpack.unpackb(msgpack.packb(encode_record(stats)))
    assert decode_record(type(stats), wire) == stats


def test_engine_core_output_survives_msgpack():
    sched = make_scheduler()
    sched.add_request(make_request("a", 4, logprobs=1, stop_token_ids=[9]))
    so = schedule(sched)
    lp = LogprobsLists([[9, 9]], [[-0.25, -0.25]], [1])
    (out,) = sched.update_from_output(so, ModelRunnerOutput(["a"], {"a": 0}, [[9]], lp))
    assert out.finished and out.events
    st = StepTrace(7, 1.0, 1.5, 1, 4, dispatched=1.6)
    out.trace_steps = [StepEntry(st, 4, 1, 0, True), StepEntry(st, 1, 0, 4, False)]
    steps: dict = {}  # the message's table of steps, which trace entries point into
    wire, table = msgpack.unpackb(msgpack.packb([encode_record(out, steps), steps]),
                                  strict_map_key=False)
    back = decode_record(EngineCoreOutput, wire, {s: decode_record(StepTrace, v)
                                                  for s, v in table.items()})
    assert back == out and back.trace_steps[0].trace.step == out.trace_steps[0].trace.step


def test_request_status_is_finished_both_ways():
    assert RequestStatus.FINISHED_ABORTED.is_finished()
    assert RequestStatus.is_finished(RequestStatus.FINISHED_STOPPED)
    assert not RequestStatus.PREEMPTED.is_finished()
    assert RequestStatus.FINISHED_LENGTH_CAPPED.get_finished_reason() is FinishReason.LENGTH
