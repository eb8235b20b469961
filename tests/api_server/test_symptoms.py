"""diagnose(): each symptom from recent traces and live counters names its box; healthy and
idle servers get no findings. Synthetic traces (the end-to-end cases are in test_debug.py)."""

from __future__ import annotations

import time

from jaxserve.api_server.symptoms import ServerFacts, diagnose
from jaxserve.engine_core.stats import SchedulerStats, StepStats
from jaxserve.engine_core.step_trace import StepEntry, StepTrace
from jaxserve.metrics.prometheus import ServerMetrics
from jaxserve.metrics.trace_store import TraceStore
from jaxserve.request_trace import RequestTrace

FACTS = ServerFacts(max_num_seqs=4, max_num_batched_tokens=512)


def finished_trace(store: TraceStore, rid: str, *, queue_s: float = 0.0, ttft_s: float = 0.1,
                   prefill_steps: int = 1, compiles: int = 0, preempted: bool = False,
                   lag_s: float = 0.0) -> RequestTrace:
    """A finished request received 10 s ago with the given shape."""
    t0 = time.time() - 10
    t = RequestTrace(rid, t0)
    t.num_prompt_tokens = 64 * prefill_steps
    t.add("engine_core", "queued", t0, t0)
    t.add("scheduler", "admitted", t0 + queue_s)
    for k in range(prefill_steps):
        st = StepTrace(k + 1, t0 + queue_s, t0 + queue_s, 1, 64, num_compiles=compiles,
                       compile_s=0.4 * compiles)
        t.add_steps([StepEntry(st, 64, 4, 64 * k, k == 0)])
    if preempted:
        t.add("kv_cache_manager", "preempted", t0 + ttft_s)
    t.add("engine_core", "first_token", t0 + ttft_s - lag_s)
    t.record_output(t0 + ttft_s, 1e-4, 1)
    store.start(t)
    store.finish(t)
    return t


def boxes(findings: list[dict]) -> list[str]:
    return [f["box"] for f in findings]


def test_idle_and_healthy_servers_have_no_findings() -> None:
    store, counters = TraceStore(), ServerMetrics("m")
    assert diagnose(store, counters, FACTS) == []
    for i in range(8):
        finished_trace(store, f"ok-{i}")
    counters.record_scheduler_stats(SchedulerStats(num_running_reqs=2, kv_cache_usage=0.3))
    assert diagnose(store, counters, FACTS) == []
    # A symptom older than a minute is forgotten.
    assert diagnose(store, counters, FACTS, now=time.time()) == []
    assert diagnose(store, ServerMetrics("m"), FACTS, now=time.time() + 120) == []


def test_each_symptom_names_its_box() -> None:
    cases = {
        "scheduler": dict(queue_s=2.0, ttft_s=2.2),
        "model_runner": dict(compiles=3),
        "kv_cache_manager": dict(preempted=True),
        "api_server": dict(lag_s=0.5),
    }
    for box, shape in cases.items():
        store, counters = TraceStore(), ServerMetrics("m")
        for i in range(4):
            finished_trace(store, f"{box}-{i}", **shape)
        if box == "model_runner":  # the engines report what compiled (traces repeat it per request)
            counters.record_scheduler_stats(SchedulerStats(step_stats=StepStats(num_compiles=3, compile_s=1.2)))
        found = diagnose(store, counters, FACTS)
        assert boxes(found) == [box], (box, found)
        assert all(f["evidence"] and f["advice"] for f in found)
    # Long prompts over many chunks: the scheduler's chunk size.
    store = TraceStore()
    finished_trace(store, "long", prefill_steps=6, ttft_s=3.0)
    [f] = diagnose(store, ServerMetrics("m"), FACTS)
    assert f["box"] == "scheduler" and "--max-num-batched-tokens" in f["advice"]


def test_live_counters_alone_are_evidence() -> None:
    counters = ServerMetrics("m")
    counters.record_scheduler_stats(SchedulerStats(num_running_reqs=4, num_waiting_reqs=9, kv_cache_usage=0.99))
    found = diagnose(TraceStore(), counters, FACTS)
    assert boxes(found) == ["scheduler", "kv_cache_manager"]
    # A hybrid model's full cache: the kind of layers holding most pages picks the advice.
    for by_kind, kind, knob in (({"full_attention": 0.3, "sliding_window": 0.69},
                                 "sliding-window", "--max-num-seqs"),
                                ({"full_attention": 0.9, "sliding_window": 0.09},
                                 "full-attention", "--max-model-len")):
        counters = ServerMetrics("m")
        counters.record_scheduler_stats(SchedulerStats(kv_cache_usage=0.99,
                                                       kv_cache_usage_by_kind=by_kind))
        [f] = diagnose(TraceStore(), counters, FACTS)
        assert f["symptom"].startswith(f"KV cache full by {kind} layers") and knob in f["advice"]
        assert f"{kind} layers' pages" in f["evidence"] or f"{kind} layers'" in f["evidence"]
    # A Gated DeltaNet hybrid: a full state pool is named apart from the pages, with its knobs.
    counters = ServerMetrics("m")
    counters.record_scheduler_stats(SchedulerStats(
        kv_cache_usage=0.4, kv_cache_usage_by_kind={"full_attention": 0.4, "recurrent_state": 1.0}))
    [f] = diagnose(TraceStore(), counters, FACTS)
    assert f["box"] == "kv_cache_manager" and f["symptom"] == "linear-attention state slots full"
    assert "--max-num-seqs" in f["advice"] and "--mamba-block-size" in f["advice"]
    assert counters.live()["state_slot_usage"] == 1.0
    eager = ServerFacts(4, 512, enforce_eager=True)
    counters = ServerMetrics("m")
    counters.record_scheduler_stats(SchedulerStats(step_stats=StepStats(num_compiles=5, compile_s=2.0)))
    [f] = diagnose(TraceStore(), counters, eager)
    assert f["box"] == "model_runner" and "--enforce-eager" in f["advice"]
    assert diagnose(TraceStore(), counters, eager, now=time.time() + 120) == []  # a minute later
    # One quick first-use compile (a grammar's masked sampler, ~0.1 s) is not a symptom.
    counters = ServerMetrics("m")
    counters.record_scheduler_stats(SchedulerStats(step_stats=StepStats(num_compiles=1, compile_s=0.1)))
    assert diagnose(TraceStore(), counters, FACTS) == []
