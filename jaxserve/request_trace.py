"""A request's trace: what each box did with it, and when (docs/architecture.md's map, per request).

Boxes, in the order a request meets them:

    api_server        received, chat template, tokenize, response / stream, finished
    engine_core       sent over ZeroMQ, queued (waiting for the scheduler), first token
    scheduler         each step it took part in (tokens scheduled; prefill or decode), update,
                      preempted / resumed, finished
    kv_cache_manager  prefix-cache hit tokens, pages allocated per step
    model_runner      per step: prepare + dispatch (compiles show here), forward on the device
    sampler           per step: sampling on the device (estimated from warm-up timings)
    output_processor  detokenizing, stop strings

Events are (box, name, start, end, attrs) in Unix seconds; an instant has start == end.
Steps are kept as the engine's shared StepTrace objects and expanded into events only when
the trace is read, so recording costs one list append per request per step.
JAX-free: the API server and the offline LLM both keep traces.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from jaxserve.engine_core.core_outputs import EngineCoreEvent, EngineCoreEventType
from jaxserve.engine_core.step_trace import StepEntry

BOXES = ("api_server", "engine_core", "scheduler", "kv_cache_manager", "model_runner", "sampler",
         "output_processor")


@dataclass(slots=True)
class TraceEvent:
    box: str
    name: str
    start: float
    end: float
    attrs: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        d = {"box": self.box, "name": self.name, "start": self.start, "end": self.end}
        if self.attrs:
            d.update(self.attrs)
        return d


def _seq(e: TraceEvent) -> int:
    """The sequence (of an n > 1 request) an event belongs to."""
    return e.attrs.get("seq", 0) if e.attrs else 0


def unix_time(monotonic_ts: float) -> float:
    """A time.monotonic() stamp (any process on this machine) as Unix seconds."""
    return monotonic_ts + (time.time() - time.monotonic())


class RequestTrace:
    """One request's events, stamped by each box as it passes."""

    def __init__(self, request_id: str, received: float | None = None) -> None:
        self.request_id = request_id
        self.received = time.time() if received is None else received
        self.events: list[TraceEvent] = [TraceEvent("api_server", "received", self.received, self.received)]
        self.steps: list[tuple[int, StepEntry]] = []  # (sequence index, entry)
        self.num_prompt_tokens = 0
        self.num_output_tokens = 0
        self.num_cached_tokens = 0
        self.finish_reasons: dict[int, str] = {}
        self.first_token: float | None = None
        self.finished: float | None = None
        self.detokenize_s = 0.0
        self.num_outputs = 0
        self.last_output: float | None = None
        self._summary: dict[str, Any] | None = None

    def add(self, box: str, name: str, start: float, end: float | None = None, **attrs: Any) -> None:
        self.events.append(TraceEvent(box, name, start, start if end is None else end, attrs or None))

    def add_engine_events(self, events: list[EngineCoreEvent], seq: int = 0) -> None:
        """The engine core's own stamps (queued, scheduled, preempted, first token, finished)."""
        for e in events:
            t = unix_time(e.timestamp)
            attrs = {"seq": seq} if seq else {}
            kind = e.type
            if kind is EngineCoreEventType.QUEUED:
                self.add("engine_core", "queued", t, **attrs)
            elif kind is EngineCoreEventType.SCHEDULED:
                self.add("scheduler", "admitted", t, **attrs)
            elif kind is EngineCoreEventType.PREEMPTED:
                self.add("kv_cache_manager", "preempted", t, **attrs)
            elif kind is EngineCoreEventType.FIRST_TOKEN:
                self.add("engine_core", "first_token", t, **attrs)
            elif kind is EngineCoreEventType.FINISHED:
                self.add("scheduler", "finished", t, **attrs)

    def add_steps(self, entries: list[StepEntry], seq: int = 0) -> None:
        self.steps.extend((seq, e) for e in entries)

    def record_output(self, now: float, busy_s: float, num_new_tokens: int) -> None:
        """The output processor handled one output of this request (`busy_s` seconds)."""
        self.num_outputs += 1
        self.detokenize_s += busy_s
        self.num_output_tokens += num_new_tokens
        if num_new_tokens and self.first_token is None:
            self.first_token = now
            self.add("output_processor", "first_token", now - busy_s, now)
        self.last_output = now

    # --- reading ----------------------------------------------------------------------

    def all_events(self) -> list[TraceEvent]:
        """Every event, steps expanded, in time order."""
        # Copies: reading must not change what was recorded.
        events = [TraceEvent(e.box, e.name, e.start, e.end, e.attrs) for e in self.events]
        for q, end in self._queue_spans(events):
            q.end = end
        preempted: set[int] = set()  # sequences (n > 1) waiting to be resumed
        for e in sorted(events, key=lambda e: e.start):
            seq = _seq(e)
            if e.name == "preempted":
                preempted.add(seq)
            elif e.name == "admitted" and seq in preempted:
                e.name = "resumed"
                preempted.discard(seq)
        for seq, (st, tokens, pages, computed, admitted) in self.steps:
            a = {"step": st.step, "seq": seq} if seq else {"step": st.step}
            kind = ("prefill" if computed < self.num_prompt_tokens
                    else "recompute" if tokens > 1 else "decode")
            sched = {**a, "kind": kind, "tokens": tokens, "computed_before": computed,
                     "batch_size": st.batch_size, "step_tokens": st.num_tokens}
            if admitted:
                sched["admitted"] = True
            events.append(TraceEvent("scheduler", "schedule", st.schedule_start, st.schedule_end, sched))
            if admitted and computed:  # found in the prefix cache, not computed
                events.append(TraceEvent("kv_cache_manager", "prefix_cache_hit", st.schedule_end,
                                         st.schedule_end, {**a, "tokens": computed}))
            if pages:
                events.append(TraceEvent("kv_cache_manager", "allocate", st.schedule_end,
                                         st.schedule_end, {**a, "pages": pages}))
            if st.dispatched:
                events.append(TraceEvent("model_runner", "prepare_dispatch", st.schedule_end,
                                         st.dispatched, {**a, "compiles": st.num_compiles}
                                         if st.num_compiles else a))
            if st.done:
                split = st.done - st.sample_s
                events.append(TraceEvent("model_runner", "forward", st.device_start, split,
                                         {**a, "batch_size": st.batch_size, "step_tokens": st.num_tokens}))
                if st.sample_s:
                    events.append(TraceEvent("sampler", "sample", split, st.done,
                                             {**a, "estimated": True}))
            if st.update_end:
                events.append(TraceEvent("scheduler", "update", st.done, st.update_end, a))
        if self.last_output is not None and self.num_outputs:
            events.append(TraceEvent("output_processor", "detokenize",
                                     self.first_token or self.last_output, self.last_output,
                                     {"outputs": self.num_outputs, "busy_s": self.detokenize_s}))
        events.sort(key=lambda e: (e.start, e.end))
        return events

    def summary(self) -> dict[str, Any]:
        """Where the request's time went: per box, and the usual latencies. Computed from the
        recorded stamps without expanding the steps (the page asks for every request's each
        second); a finished trace's is computed once (`freeze`)."""
        if self._summary is not None:
            return self._summary
        by_box: dict[str, float] = defaultdict(float)
        for e in self.events:
            if e.attrs and "busy_s" in e.attrs:  # a span the box was only partly busy in
                by_box[e.box] += e.attrs["busy_s"]
            elif e.name != "first_token":
                by_box[e.box] += e.end - e.start
        queue_s = self._queue_s()
        by_box["engine_core"] += queue_s
        for _, (st, _tokens, pages, computed, admitted) in self.steps:
            by_box["scheduler"] += st.schedule_end - st.schedule_start
            if st.dispatched:
                by_box["model_runner"] += st.dispatched - st.schedule_end
            if st.done:
                by_box["model_runner"] += st.done - st.sample_s - st.device_start
                if st.sample_s:
                    by_box["sampler"] += st.sample_s
            if st.update_end:
                by_box["scheduler"] += st.update_end - st.done
            if pages or (admitted and computed):
                by_box["kv_cache_manager"] += 0.0
        if self.num_outputs:
            by_box["output_processor"] += self.detokenize_s
        steps = [s for _, s in self.steps]
        end = self.finished or time.time()
        return {
            "status": "finished" if self.finished else "running",
            "finish_reason": ",".join(sorted(set(self.finish_reasons.values()))) or None,
            "prompt_tokens": self.num_prompt_tokens,
            "output_tokens": self.num_output_tokens,
            "cached_tokens": self.num_cached_tokens,
            "e2e_s": end - self.received,
            "ttft_s": None if self.first_token is None else self.first_token - self.received,
            "queue_s": queue_s,
            "num_steps": len(steps),
            "prefill_steps": sum(1 for s in steps
                                 if s.num_computed_tokens < self.num_prompt_tokens),
            "num_preemptions": sum(1 for e in self.events if e.name == "preempted"),
            "num_compiles": sum(s.trace.num_compiles for s in steps),
            "compile_s": sum(s.trace.compile_s for s in steps),
            "time_by_box": {b: round(by_box[b], 6) for b in BOXES if b in by_box},
        }

    @staticmethod
    def _queue_spans(events: list[TraceEvent]) -> list[tuple[TraceEvent, float]]:
        """Each queued stamp with the end of its wait: its sequence's next admission."""
        spans = []
        for q in events:
            if q.name == "queued":
                later = [a.start for a in events if a.name == "admitted" and _seq(a) == _seq(q)
                         and a.start >= q.start]
                if later:
                    spans.append((q, min(later)))
        return spans

    def _queue_s(self) -> float:
        """Time waiting for the scheduler: the longest wait of the request's sequences."""
        return max((end - q.start for q, end in self._queue_spans(self.events)), default=0.0)

    def freeze(self) -> None:
        """The request is over: keep its summary."""
        self._summary = None
        self._summary = self.summary()

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.request_id, "events": [e.to_dict() for e in self.all_events()],
                "summary": self.summary()}
