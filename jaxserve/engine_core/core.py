"""The engine core's busy loop: schedule, execute, update (vLLM's EngineCore).

With async scheduling the loop keeps up to `batch_queue_size` steps in flight:

    schedule 1, dispatch 1 | schedule 2, dispatch 2, wait 1, update 1 | schedule 3, ...

so the host schedules step N+1 while the device runs step N. Steps run on the
device in dispatch order, which is what makes freeing a finished request's
pages before its last in-flight step completes safe.
"""

from __future__ import annotations

import gc
import time
from collections import deque
from collections.abc import Iterable
from typing import Protocol, runtime_checkable

from jaxserve.engine_core.core_outputs import EngineCoreOutput
from jaxserve.engine_core.model_runner_output import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput
from jaxserve.engine_core.request import Request, RequestStatus
from jaxserve.engine_core.sched_output import SchedulerOutput
from jaxserve.engine_core.scheduler import Scheduler
from jaxserve.engine_core.stats import SchedulerStats
from jaxserve.engine_core.step_trace import StepTrace, StepTracer


class ModelRunnerOutputHandle(Protocol):
    """A step dispatched to the device; `result()` blocks until it is done."""

    def result(self) -> ModelRunnerOutput: ...


class Executor(Protocol):
    """What the engine core needs from the worker (vLLM's model executor: the Worker itself, or
    a LeaderWorker over several hosts; structural, never imported)."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...


@runtime_checkable
class AsyncExecutor(Protocol):
    def execute_model_async(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutputHandle: ...


def freeze_gc_heap() -> None:
    """Move every object alive now (KV pages, compiled programs, weights'
    metadata) out of the garbage collector's reach. Otherwise each full
    collection walks tens of thousands of start-up objects, a pause felt at
    a thousand running requests (scripts/bench_scheduler.py). vLLM's engine core
    does the same at start-up. Frozen cyclic garbage is never freed."""
    gc.collect()
    gc.freeze()


class _DoneHandle:
    """Handle for a worker without execute_model_async: already computed."""

    def __init__(self, output: ModelRunnerOutput) -> None:
        self._output = output

    def result(self) -> ModelRunnerOutput:
        return self._output


class EngineCore:
    """Owns the scheduler and drives the worker, one step at a time."""

    def __init__(
        self,
        scheduler: Scheduler,
        worker: Executor,
        batch_queue_size: int | None = None,
        freeze_gc: bool = False,
        request_tracing: bool = True,
    ) -> None:
        """`batch_queue_size`: steps in flight for step_with_batch_queue; by
        default 2 with async scheduling (overlap the host with the device),
        else 1. `freeze_gc`: call freeze_gc_heap() now; for a dedicated
        engine-core process, once everything is loaded (frozen objects are
        never collected, so not for processes that build many engines).
        `request_tracing`: stamp each step for request traces (StepTracer)."""
        if batch_queue_size is None:
            batch_queue_size = 2 if scheduler.async_scheduling else 1
        if batch_queue_size < 1:
            raise ValueError(f"batch_queue_size must be >= 1, got {batch_queue_size}")
        self.scheduler = scheduler
        self.worker = worker
        self.batch_queue_size = batch_queue_size
        self.tracer = StepTracer(scheduler.block_size, request_tracing)
        # In-flight steps, newest on the left.
        self.batch_queue: deque[tuple[ModelRunnerOutputHandle, SchedulerOutput, StepTrace | None]] = deque()
        self._execute_async = (
            worker.execute_model_async if isinstance(worker, AsyncExecutor) else None
        )
        if freeze_gc:
            freeze_gc_heap()

    def step_fn(self) -> list[EngineCoreOutput] | None:
        """The loop's one step, for the offline LLM and the engine-core process alike: None
        means a step was only dispatched (the next call collects it). A method, not a bound
        method kept on the core: that reference cycle kept a dropped LLM's compiled programs
        until Python's cyclic collector ran."""
        return self.step_with_batch_queue() if self.batch_queue_size > 1 else self.step()

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, req_ids: str | Iterable[str]) -> None:
        """Abort requests; their pages are freed now and the worker drops them
        with the next step. No output is produced for them."""
        self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)
        self.tracer.drop(req_ids)

    def has_work(self) -> bool:
        return self.scheduler.has_requests() or bool(self.batch_queue)

    def get_stats(self) -> SchedulerStats:
        stats = self.scheduler.make_stats()
        stats.step_stats = self.tracer.stats()
        return stats

    def step(self) -> list[EngineCoreOutput]:
        """One synchronous step: schedule, execute, update."""
        if not self.scheduler.has_requests():
            return []
        t0 = time.time()
        scheduler_output = self.scheduler.schedule()
        st = self.tracer.scheduled(scheduler_output, t0)
        t1 = time.perf_counter()
        self._wait_if_idle(scheduler_output)
        model_output = self._execute(scheduler_output, st)
        self.scheduler.observe_step_time(scheduler_output.total_num_scheduled_tokens,
                                         time.perf_counter() - t1)
        return self._update(scheduler_output, model_output, st)

    def _update(self, so: SchedulerOutput, model_output: ModelRunnerOutput,
                st: StepTrace | None) -> list[EngineCoreOutput]:
        self.tracer.done(st, model_output.sample_s, model_output.num_compiles,
                         model_output.compile_s)
        outputs = self.scheduler.update_from_output(so, model_output)
        self.tracer.updated(st, outputs)
        return outputs

    def step_with_batch_queue(self) -> list[EngineCoreOutput] | None:
        """One turn of the async loop. Schedules and dispatches a new step if
        the queue has room; then, if the queue is full or nothing new could be
        dispatched, waits for the oldest step and returns its outputs.
        Returns None when it only dispatched."""
        dispatched, scheduler_output = False, None
        if len(self.batch_queue) < self.batch_queue_size and self.scheduler.has_requests():
            t0 = time.time()
            scheduler_output = self.scheduler.schedule()
            if self._has_work_for_worker(scheduler_output):
                st = self.tracer.scheduled(scheduler_output, t0)
                handle = self._dispatch(scheduler_output)
                self.tracer.dispatched(st)
                self.batch_queue.appendleft((handle, scheduler_output, st))
                dispatched = True
        if not self.batch_queue:
            self._wait_if_idle(scheduler_output)
            return self.scheduler.take_unstepped_outputs()
        if dispatched and len(self.batch_queue) < self.batch_queue_size:
            return None
        handle, scheduler_output, st = self.batch_queue.pop()
        return self._update(scheduler_output, handle.result(), st)

    def _wait_if_idle(self, scheduler_output: SchedulerOutput | None) -> None:
        """A step with nothing to run while grammars compile waits for one (up to 10 ms)
        instead of spinning the engine loop."""
        if (scheduler_output is not None and not self._has_work_for_worker(scheduler_output)
                and self.scheduler.structured_output.compiling):
            self.scheduler.structured_output.wait_compiling(0.01)

    @staticmethod
    def _has_work_for_worker(scheduler_output: SchedulerOutput) -> bool:
        return bool(
            scheduler_output.total_num_scheduled_tokens
            or scheduler_output.finished_req_ids
            or scheduler_output.preempted_req_ids
        )

    def _execute(self, scheduler_output: SchedulerOutput, st: StepTrace | None) -> ModelRunnerOutput:
        # NOTE: a step with no tokens still reaches the worker when it carries
        # ids to drop; a step with nothing at all is skipped.
        if not self._has_work_for_worker(scheduler_output):
            return EMPTY_MODEL_RUNNER_OUTPUT
        handle = self._dispatch(scheduler_output)
        self.tracer.dispatched(st)
        return handle.result()

    def _dispatch(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutputHandle:
        if self._execute_async is not None:
            return self._execute_async(scheduler_output)
        return _DoneHandle(self.worker.execute_model(scheduler_output))
