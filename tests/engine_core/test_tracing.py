"""Request traces from the engine core's side (host-only fake worker): ordered events that
cover every box a request passed; chunked prefill, prefix-cache hits, preemption and resume."""

from __future__ import annotations

import pytest

from jaxserve.engine_core.core import EngineCore
from jaxserve.engine_core.core_outputs import EngineCoreOutput
from jaxserve.request_trace import RequestTrace

from .fake_worker import FakeAsyncWorker
from .helpers import BS, EOS, make_request, make_scheduler


def traced_run(core: EngineCore, requests, use_batch_queue: bool) -> dict[str, RequestTrace]:
    """Run to the end, building each request's trace as the output processor does."""
    traces = {}
    for r in requests:
        traces[r.req_id] = RequestTrace(r.req_id)
        traces[r.req_id].num_prompt_tokens = len(r.prompt_token_ids)
        core.add_request(r)
    for _ in range(10_000):
        if not core.has_work():
            return traces
        outs: list[EngineCoreOutput] = (core.step_with_batch_queue() if use_batch_queue
                                        else core.step()) or []
        for o in outs:
            t = traces[o.req_id]
            t.add_engine_events(o.events or [])
            t.add_steps(o.trace_steps or [])
            t.num_output_tokens += len(o.new_token_ids)
            if o.finished:
                t.finish_reasons[0] = o.finish_reason.value
    raise AssertionError("engine did not drain")


def make_core(async_scheduling: bool, num_blocks: int = 64, **kw) -> EngineCore:
    sched = make_scheduler(async_scheduling=async_scheduling, num_blocks=num_blocks, **kw)
    return EngineCore(sched, FakeAsyncWorker(num_blocks, BS, eos_token_id=EOS, eos_prob=0.0))


def names(trace: RequestTrace, box: str, name: str) -> list[dict]:
    return [e.to_dict() for e in trace.all_events() if e.box == box and e.name == name]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_chunked_prefill_shows_every_step_in_order(async_scheduling: bool) -> None:
    core = make_core(async_scheduling, max_num_batched_tokens=16, max_model_len=128)
    traces = traced_run(core, [make_request("long", 50, max_tokens=5)], async_scheduling)
    t = traces["long"]
    events = t.all_events()
    assert [e.start for e in events] == sorted(e.start for e in events)
    assert {e.box for e in events} >= {"engine_core", "scheduler", "kv_cache_manager", "model_runner"}
    steps = names(t, "scheduler", "schedule")
    prefill = [s for s in steps if s["kind"] == "prefill"]
    assert [s["tokens"] for s in prefill] == [16, 16, 16, 2]
    assert [s["computed_before"] for s in prefill] == [0, 16, 32, 48]
    assert len(steps) == 4 + 4  # the 5th token is sampled by the last prefill chunk's step
    assert [s["step"] for s in steps] == sorted(s["step"] for s in steps)
    # Every step ran on the "device" after it was scheduled, and was updated after that.
    for f in names(t, "model_runner", "forward"):
        s = next(x for x in steps if x["step"] == f["step"])
        assert s["end"] <= f["start"] <= f["end"]
    assert sum(a["pages"] for a in names(t, "kv_cache_manager", "allocate")) == -(-54 // BS)
    queued = names(t, "engine_core", "queued")
    assert len(queued) == 1 and queued[0]["end"] <= steps[0]["start"] + 1e-3
    summary = t.summary()
    assert summary["prefill_steps"] == 4 and summary["num_steps"] == 8
    assert set(summary["time_by_box"]) >= {"scheduler", "model_runner"}


def test_prefix_cache_hit_shows_its_tokens() -> None:
    core = make_core(False)
    shared = list(range(100, 100 + 2 * BS))
    first = traced_run(core, [make_request("a", prompt=shared + [7, 8, 9], max_tokens=2)], False)
    second = traced_run(core, [make_request("b", prompt=shared + [5, 6], max_tokens=2)], False)
    assert names(first["a"], "kv_cache_manager", "prefix_cache_hit") == []
    [hit] = names(second["b"], "kv_cache_manager", "prefix_cache_hit")
    assert hit["tokens"] == 2 * BS
    [step] = [s for s in names(second["b"], "scheduler", "schedule") if s["kind"] == "prefill"]
    assert step["tokens"] == 2 and step["computed_before"] == 2 * BS


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preempted_request_shows_preempt_and_resume(async_scheduling: bool) -> None:
    # 11 usable pages for 6 requests growing to ~36 tokens (9 pages each): some are
    # preempted and recomputed.
    core = make_core(async_scheduling, num_blocks=12, max_model_len=40, max_num_batched_tokens=32)
    reqs = [make_request(f"r{i}", 6 + i, max_tokens=25) for i in range(6)]
    traces = traced_run(core, reqs, async_scheduling)
    assert core.scheduler.total_num_preemptions > 0
    preempted = [t for t in traces.values() if names(t, "kv_cache_manager", "preempted")]
    assert preempted
    for t in preempted:
        p = names(t, "kv_cache_manager", "preempted")
        r = names(t, "scheduler", "resumed")
        assert len(r) == len(p) and all(a["start"] <= b["start"] for a, b in zip(p, r))
        assert t.summary()["num_preemptions"] == len(p)
        # Each admission (the first and every resume) starts with a step that recomputes
        # what the prefix cache does not still hold.
        admitted = [s for s in names(t, "scheduler", "schedule") if s.get("admitted")]
        assert len(admitted) == 1 + len(p)
        assert all(a["start"] >= x["start"] - 1e-3 for a, x in zip(admitted[1:], r))
    for t in traces.values():
        assert t.finish_reasons[0] == "length" and t.num_output_tokens == 25


def test_tracing_off_records_nothing_but_counts_steps() -> None:
    sched = make_scheduler(num_blocks=64)
    core = EngineCore(sched, FakeAsyncWorker(64, BS, eos_token_id=EOS, eos_prob=0.0),
                      request_tracing=False)
    traces = traced_run(core, [make_request("x", 20, max_tokens=3)], False)
    assert traces["x"].steps == [] and core.tracer.pending == {}
    assert core.get_stats().step_stats.num_steps == 0


def test_requests_ending_with_a_step_in_flight_leave_nothing_behind() -> None:
    # EOS ends requests while the next step (async) is already dispatched: that step gives
    # them no output, and its entries must not stay behind in the tracer.
    sched = make_scheduler(async_scheduling=True, num_blocks=64)
    core = EngineCore(sched, FakeAsyncWorker(64, BS, eos_token_id=EOS, eos_prob=0.3))
    reqs = [make_request(f"e{i}", 5 + i, max_tokens=40) for i in range(8)]
    traces = traced_run(core, reqs, use_batch_queue=True)
    assert any(t.finish_reasons[0] == "stop" for t in traces.values())
    assert core.tracer.pending == {}


def test_queue_time_pairs_each_sequence_with_its_own_admission() -> None:
    from jaxserve.request_trace import RequestTrace

    t = RequestTrace("r", received=100.0)
    t.add("engine_core", "queued", 100.0)
    t.add("engine_core", "queued", 100.0, seq=1)
    t.add("scheduler", "admitted", 100.002)
    t.add("scheduler", "admitted", 103.0, seq=1)
    t.add("kv_cache_manager", "preempted", 104.0, seq=1)
    t.add("scheduler", "admitted", 105.0, seq=1)
    assert abs(t.summary()["queue_s"] - 3.0) < 1e-9  # the longest wait, not the sum or seq 0's
    names = [(e.name, e.attrs) for e in t.all_events() if e.box == "scheduler"]
    assert names == [("admitted", None), ("admitted", {"seq": 1}), ("resumed", {"seq": 1})]
