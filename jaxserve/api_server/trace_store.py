"""The API server's request traces and live counters, for /debug (the map, live).

`TraceStore` holds the traces of running requests and a ring of recently finished ones
(bounded: `capacity` requests). `LiveCounters` keeps the engine cores' latest scheduler
stats and a token rate, the numbers /debug draws on each box.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any

from jaxserve.engine_core.stats import SchedulerStats
from jaxserve.tracing import RequestTrace

DEFAULT_CAPACITY = 256


class TraceStore:
    def __init__(self, capacity: int = DEFAULT_CAPACITY, enabled: bool = True,
                 exporter: Callable[[RequestTrace], None] | None = None) -> None:
        """`exporter`: called with each finished trace (OpenTelemetry, otel.py)."""
        self.enabled = enabled
        self.capacity = capacity
        self.exporter = exporter
        self.running: dict[str, RequestTrace] = {}
        self.finished: OrderedDict[str, RequestTrace] = OrderedDict()

    def new(self, request_id: str, received: float | None = None) -> RequestTrace | None:
        """A new trace (None with tracing off); `start` registers it once the request runs."""
        return RequestTrace(request_id, received) if self.enabled else None

    def start(self, trace: RequestTrace | None) -> None:
        """Register a trace as running. Called where `finish` is sure to follow (inside the
        request's generator): a request dropped before it starts leaves nothing behind."""
        if trace is not None:
            self.running[trace.request_id] = trace

    def finish(self, trace: RequestTrace | None, reason: str | None = None) -> None:
        """Move a trace to the ring of finished ones (the oldest drops out)."""
        if trace is None or self.running.pop(trace.request_id, None) is None:
            return
        if trace.finished is None:
            trace.finished = time.time()
            trace.add("api_server", "finished", trace.finished, reason=reason)
        trace.freeze()
        self.finished[trace.request_id] = trace
        while len(self.finished) > self.capacity:
            self.finished.popitem(last=False)
        if self.exporter is not None:
            self.exporter(trace)

    def lookup(self, request_id: str) -> list[RequestTrace]:
        """The traces behind an OpenAI response id: itself, or its prompts' (`{id}-{i}`) when
        a completion had several prompts."""
        for table in (self.running, self.finished):
            if request_id in table:
                return [table[request_id]]
        prefix = request_id + "-"
        return [t for table in (self.running, self.finished) for k, t in table.items()
                if k.startswith(prefix) and k[len(prefix):].isdigit()]

    def recent(self, since: float = 0.0) -> list[RequestTrace]:
        """Finished traces that ended after `since` (Unix seconds), oldest first."""
        return [t for t in self.finished.values() if (t.finished or 0.0) >= since]

    def listing(self) -> dict[str, Any]:
        def row(t: RequestTrace) -> dict[str, Any]:
            s = t.summary()
            return {"id": t.request_id, "received": t.received, **{
                k: s[k] for k in ("status", "finish_reason", "prompt_tokens", "output_tokens",
                                  "e2e_s", "ttft_s", "queue_s", "num_steps")}}
        return {"running": [row(t) for t in self.running.values()],
                "finished": [row(t) for t in reversed(self.finished.values())]}


class LiveCounters:
    """The engine cores' latest stats, summed over data-parallel ranks, and tokens/s."""

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self.stats: dict[int, SchedulerStats] = {}
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.num_preemptions = 0
        self._tokens: deque[tuple[float, int]] = deque()
        # Compiles as they happened: (Unix time, programs, seconds), from the engines' totals.
        self._compiles: deque[tuple[float, int, float]] = deque(maxlen=1024)
        self._compile_totals: dict[int, tuple[int, float]] = {}

    def record_stats(self, stats: SchedulerStats, engine_index: int = 0) -> None:
        self.stats[engine_index] = stats
        self.prefix_queries += stats.prefix_cache_stats.queries
        self.prefix_hits += stats.prefix_cache_stats.hits
        self.num_preemptions += stats.num_preemptions
        n, s = stats.step_stats.get("num_compiles", 0), stats.step_stats.get("compile_s", 0.0)
        n0, s0 = self._compile_totals.get(engine_index, (0, 0.0))
        if n > n0:
            self._compiles.append((time.time(), int(n - n0), s - s0))
            self._compile_totals[engine_index] = (n, s)

    def recent_compiles(self, since: float) -> tuple[int, float]:
        """Programs compiled while serving since `since` (Unix seconds), and their seconds."""
        recent = [(n, s) for t, n, s in self._compiles if t >= since]
        return sum(n for n, _ in recent), sum(s for _, s in recent)

    def record_tokens(self, n: int, now: float | None = None) -> None:
        if n:
            self._tokens.append((time.monotonic() if now is None else now, n))

    def tokens_per_s(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        while self._tokens and self._tokens[0][0] < now - self.window_s:
            self._tokens.popleft()
        return sum(n for _, n in self._tokens) / self.window_s

    def snapshot(self) -> dict[str, Any]:
        s = list(self.stats.values())
        steps = [x.step_stats for x in s if x.step_stats]
        n = max(len(steps), 1)
        return {
            "waiting": sum(x.num_waiting_reqs for x in s),
            "running": sum(x.num_running_reqs for x in s),
            "kv_cache_usage": max((x.kv_cache_usage for x in s), default=0.0),
            "prefix_cache_hit_rate": self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0,
            "num_preemptions": self.num_preemptions,
            "num_steps": sum(x.get("num_steps", 0) for x in steps),
            "step_time_s": sum(x.get("step_time_s", 0.0) for x in steps) / n,
            "batch_size": sum(x.get("batch_size", 0.0) for x in steps) / n,
            "num_compiles": sum(x.get("num_compiles", 0) for x in steps),
            "compile_s": sum(x.get("compile_s", 0.0) for x in steps),
            "tokens_per_s": self.tokens_per_s(),
        }
