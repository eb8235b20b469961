"""The engine core's side of request traces: what each step did, recorded once per step and
shared by the requests in it.

A `StepTrace` holds a step's timings (Unix seconds) and sizes; each request scheduled in the
step gets one small entry pointing at it (tokens scheduled, pages allocated, tokens computed
before). The entries ride on the request's next EngineCoreOutput, so the front end sees a
running request's steps as they happen and the engine keeps nothing per finished request.

Timings of one step, as the engine core sees them (async scheduling overlaps them):

    schedule_start ─ scheduler ─ schedule_end ─ worker prepares + dispatches ─ dispatched
    device_start (the later of `dispatched` and the previous step's `done`) ─ forward ─
    (done - sample_s) ─ sampler ─ done (tokens on the host) ─ scheduler update ─ update_end

The device runs without the host watching, so `done` is when the host saw the tokens and the
forward/sampler split uses the sampler's time measured per bucket at warm-up (`sample_s`).
JAX-free: the engine core imports it.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from jaxserve.engine_core.stats import StepStats

if TYPE_CHECKING:
    from jaxserve.engine_core.sched_output import SchedulerOutput


@dataclass(slots=True)
class StepTrace:
    step: int
    schedule_start: float
    schedule_end: float
    batch_size: int  # requests scheduled
    num_tokens: int  # tokens scheduled, all requests
    dispatched: float = 0.0
    device_start: float = 0.0
    done: float = 0.0
    update_end: float = 0.0
    sample_s: float = 0.0  # estimated; 0 when unmeasured (--enforce-eager: no warm-up)
    num_compiles: int = 0  # programs built while dispatching this step (0 once warm)
    compile_s: float = 0.0


class StepEntry(NamedTuple):
    """A request's part in one step (a tuple: cheap to make for every request of a step)."""

    trace: StepTrace  # the step, shared by the requests in it
    num_tokens: int  # tokens scheduled for the request
    num_pages: int  # pages allocated to it
    num_computed_tokens: int  # its tokens computed before the step
    admitted: bool  # its first step after waiting (new or resumed)


# A StepEntry from its values, without NamedTuple's argument parsing (one per request a step):
# new_step_entry(StepEntry, (trace, tokens, pages, computed, admitted)).
new_step_entry = tuple.__new__


class StepTracer:
    """Stamps each step and hands every request its entries; keeps recent steps for the
    live counters (step time, batch size, compiles)."""

    def __init__(self, block_size: int, enabled: bool = True) -> None:
        self.block_size = block_size
        self.enabled = enabled
        self.pending: dict[str, list[StepEntry]] = {}  # entries not yet sent, per request
        self.recent: deque[StepTrace] = deque(maxlen=32)
        self.num_steps = 0
        self.num_compiles = 0
        self.compile_s = 0.0
        self._last_done = 0.0

    def scheduled(self, so: SchedulerOutput, schedule_start: float) -> StepTrace | None:
        """Record a step the scheduler just made (None if tracing is off or it is empty)."""
        if not self.enabled or not so.num_scheduled_tokens:
            return None
        self.num_steps += 1
        st = StepTrace(self.num_steps, schedule_start, time.time(), len(so.num_scheduled_tokens),
                       so.total_num_scheduled_tokens)
        n, pending, bs = so.num_scheduled_tokens, self.pending, self.block_size
        for new in so.scheduled_new_reqs:
            # The prefix-cache hit's pages were found, not allocated (every group's table
            # has one entry per hit page, a sliding window's passed ones null).
            hit = new.num_computed_tokens // bs
            pages = sum(len(ids) - hit for ids in new.block_ids)
            pending.setdefault(new.req_id, []).append(
                new_step_entry(StepEntry, (st, n[new.req_id], pages, new.num_computed_tokens, True)))
        cached = so.scheduled_cached_reqs
        for req_id, blocks, computed in zip(cached.req_ids, cached.new_block_ids,
                                            cached.num_computed_tokens):
            pending.setdefault(req_id, []).append(
                new_step_entry(StepEntry, (st, n[req_id], sum(map(len, blocks)), computed,
                                           False)))
        return st

    def dispatched(self, st: StepTrace | None) -> None:
        if st is not None:
            st.dispatched = time.time()

    def done(self, st: StepTrace | None, sample_s: float, num_compiles: int,
             compile_s: float) -> None:
        """The step's tokens reached the host."""
        self.num_compiles += num_compiles
        self.compile_s += compile_s
        if st is None:
            return
        st.done = time.time()
        st.device_start = max(st.dispatched, self._last_done)
        st.sample_s = min(sample_s, st.done - st.device_start)
        st.num_compiles, st.compile_s = num_compiles, compile_s
        self._last_done = st.done

    def updated(self, st: StepTrace | None, outputs: list[Any]) -> None:
        """The scheduler applied the step: give each output its request's entries."""
        if st is None:
            return
        st.update_end = time.time()
        self.recent.append(st)
        pending = self.pending
        for out in outputs:
            entries = pending.pop(out.req_id, None)
            if entries and entries[-1].trace.step > st.step:
                later = [e for e in entries if e.trace.step > st.step]
                entries = [e for e in entries if e.trace.step <= st.step]
                if out.finish_reason is None:
                    # Async scheduling: a later step is already in flight; its entry waits.
                    # A finished request's in-flight step yields no output: forget it.
                    pending[out.req_id] = later
            out.trace_steps = entries or None

    def drop(self, req_ids: Any) -> None:
        """Forget aborted requests' unsent entries."""
        for r in [req_ids] if isinstance(req_ids, str) else req_ids:
            self.pending.pop(r, None)

    def stats(self) -> StepStats:
        """Live counters: steps so far, mean time between steps and batch size over the recent
        ones, programs compiled while serving."""
        recent = self.recent
        step_time = 0.0
        if len(recent) > 1:
            step_time = (recent[-1].done - recent[0].done) / (len(recent) - 1)
        batch = sum(s.batch_size for s in recent) / len(recent) if recent else 0.0
        return StepStats(self.num_steps, step_time, batch, self.num_compiles, self.compile_s)
