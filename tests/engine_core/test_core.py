"""EngineCore: the three-line step, the batch queue, empty steps, aborts."""

import pytest

from jaxserve.engine_core.core import EngineCore
from jaxserve.engine_core.request import Request
from jaxserve.outputs import FinishReason
from jaxserve.sampling_params import SamplingParams

from .fake_worker import FakeAsyncWorker, FakeWorker
from .helpers import BS, EOS, make_scheduler


def run(core: EngineCore, use_batch_queue: bool, max_steps: int = 10_000):
    tokens: dict[str, list[int]] = {}
    finish: dict[str, FinishReason] = {}
    for _ in range(max_steps):
        if not core.has_work():
            return tokens, finish
        outs = core.step_with_batch_queue() if use_batch_queue else core.step()
        for o in outs or ():
            tokens.setdefault(o.req_id, []).extend(o.new_token_ids)
            if o.finished:
                assert o.req_id not in finish, "finished twice"
                finish[o.req_id] = o.finish_reason
    raise AssertionError("engine did not drain")


def make_core(*, async_scheduling, num_blocks=64, worker_cls=FakeAsyncWorker, **kw):
    sched = make_scheduler(async_scheduling=async_scheduling, num_blocks=num_blocks, **kw)
    worker = worker_cls(num_blocks, BS, eos_token_id=EOS, eos_prob=0.05)
    return EngineCore(sched, worker), worker


def add_requests(core, n=12, shared_prefix=True):
    for i in range(n):
        prefix = list(range(500, 512)) if shared_prefix and i % 2 else []
        prompt = prefix + [1000 + 37 * i + j for j in range(3 + 5 * (i % 4))]
        core.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=4 + i % 9)))


@pytest.mark.parametrize("num_blocks", [64, 12])  # 12 pages: preemptions
@pytest.mark.parametrize("caching", [True, False])
def test_sync_and_async_scheduling_generate_the_same_tokens(num_blocks, caching):
    results = []
    for async_scheduling in (False, True):
        core, worker = make_core(async_scheduling=async_scheduling, num_blocks=num_blocks,
                                 max_model_len=40, max_num_batched_tokens=24,
                                 enable_prefix_caching=caching)
        add_requests(core)
        results.append(run(core, use_batch_queue=async_scheduling))
        assert core.scheduler.kv_cache_manager.get_num_free_blocks() == num_blocks - 1
        if async_scheduling:
            assert worker.max_in_flight == 2
        if num_blocks == 12:
            assert core.scheduler.total_num_preemptions > 0
    assert results[0] == results[1]
    assert len(results[0][1]) == 12


def test_batch_queue_schedules_step_n_plus_1_before_waiting_for_step_n():
    core, worker = make_core(async_scheduling=True)
    core.add_request(Request("a", [10, 11, 12], SamplingParams(max_tokens=5, ignore_eos=True)))
    assert core.step_with_batch_queue() is None  # step 1 dispatched, not awaited
    assert len(worker.handles) == 1
    outs = core.step_with_batch_queue()  # step 2 dispatched, then step 1 awaited
    assert len(worker.handles) == 2 and worker.handles[0].result_called
    assert not worker.handles[1].result_called
    assert [o.new_token_ids for o in outs] == [[worker.reqs["a"].tokens[3]]]
    tokens, finish = run(core, use_batch_queue=True)
    assert finish == {"a": FinishReason.LENGTH}
    computing = [so for so in worker.steps if so.total_num_scheduled_tokens]
    assert len(computing) == 5  # exactly max_tokens steps: none wasted
    assert worker.steps[-1].finished_req_ids == {"a"}  # then one to drop it


def test_worker_without_async_api_works_with_the_batch_queue():
    core, worker = make_core(async_scheduling=True, worker_cls=FakeWorker)
    add_requests(core, n=4)
    _, finish = run(core, use_batch_queue=True)
    assert len(finish) == 4


def test_empty_steps_are_skipped_but_finished_ids_reach_the_worker():
    core, worker = make_core(async_scheduling=False)
    assert core.step() == [] and worker.num_executed == 0
    core.add_request(Request("a", [10, 11, 12], SamplingParams(max_tokens=1)))
    (out,) = core.step()
    assert out.finished and worker.num_executed == 1
    assert core.step() == []  # only a finished id to deliver
    assert worker.num_executed == 2 and worker.steps[-1].finished_req_ids == {"a"}
    assert worker.steps[-1].total_num_scheduled_tokens == 0 and worker.reqs == {}
    assert not core.has_work()
    core.step()
    assert worker.num_executed == 2


def test_abort_through_the_core():
    for async_scheduling in (False, True):
        core, worker = make_core(async_scheduling=async_scheduling)
        core.add_request(Request("a", [10, 11, 12], SamplingParams(max_tokens=50, ignore_eos=True)))
        core.add_request(Request("b", [20, 21, 22], SamplingParams(max_tokens=3, ignore_eos=True)))
        step = core.step_with_batch_queue if async_scheduling else core.step
        step()
        step()
        core.abort_requests("a")
        tokens, finish = run(core, use_batch_queue=async_scheduling)
        assert "a" not in finish and finish["b"] is FinishReason.LENGTH
        assert "a" not in worker.reqs
        assert core.scheduler.kv_cache_manager.usage == 0.0


def test_abort_on_the_final_step():
    """An abort that arrives while the step sampling a request's last token is in flight
    (vLLM's test_abort_final_step): the request ends once, as aborted, the in-flight token is
    dropped, its pages go back and the worker forgets it."""
    core, worker = make_core(async_scheduling=True)
    core.add_request(Request("a", [10, 11, 12], SamplingParams(max_tokens=3, ignore_eos=True)))
    core.add_request(Request("b", [20, 21, 22], SamplingParams(max_tokens=6, ignore_eos=True)))
    seen: dict[str, list[int]] = {}
    for _ in range(3):  # dispatch steps 1..3 (3 samples a's last token), await 1..2
        for o in core.step_with_batch_queue() or ():
            assert not o.finished
            seen.setdefault(o.req_id, []).extend(o.new_token_ids)
    assert len(core.batch_queue) == 1 and len(seen["a"]) == 2
    core.abort_requests("a")
    tokens, finish = run(core, use_batch_queue=True)
    assert "a" not in finish and "a" not in tokens  # nothing more for a, finished or not
    assert finish == {"b": FinishReason.LENGTH} and len(seen["b"] + tokens["b"]) == 6
    assert "a" not in worker.reqs and core.scheduler.kv_cache_manager.usage == 0.0
    assert not core.scheduler.has_requests()


def test_stats_from_the_core():
    core, _ = make_core(async_scheduling=False)
    for i in range(3):
        core.add_request(Request(f"r{i}", [10, 11, 12], SamplingParams(ignore_eos=True)))
    core.step()
    stats = core.get_stats()
    assert stats.num_running_reqs == 3 and stats.kv_cache_usage > 0


def test_batch_queue_size_follows_async_scheduling_and_gc_is_frozen():
    import gc

    sched = make_scheduler(async_scheduling=True)
    gc.unfreeze()
    core = EngineCore(sched, FakeWorker(64, BS), freeze_gc=True)
    assert core.batch_queue_size == 2 and gc.get_freeze_count() > 0
    gc.unfreeze()
    core = EngineCore(make_scheduler(), FakeWorker(64, BS))
    assert core.batch_queue_size == 1 and gc.get_freeze_count() == 0


def test_batch_queue_of_one_is_the_synchronous_loop():
    results = []
    for use_batch_queue in (False, True):
        core, _ = make_core(async_scheduling=False)
        assert core.batch_queue_size == 1
        add_requests(core, n=6)
        results.append(run(core, use_batch_queue=use_batch_queue))
    assert results[0] == results[1]
