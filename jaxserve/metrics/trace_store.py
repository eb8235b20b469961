"""The API server's request traces, for /debug (the map, live): `TraceStore` holds the
traces of running requests and a ring of recently finished ones (bounded: `capacity`
requests). The live counters /debug draws come from ServerMetrics.live()."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from jaxserve.request_trace import RequestTrace

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
