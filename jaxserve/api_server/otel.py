"""`--otlp-traces-endpoint URL`: each finished request's trace exported as OpenTelemetry spans
(OTLP over HTTP/protobuf), the same events /debug/requests/{id} shows.

One root span per request (`llm_request`, its summary as attributes) with one child span per
event, named `{box}.{name}` and carrying `jaxserve.box`. Needs the `otel` extra
(`pip install -e '.[otel]'`: opentelemetry-sdk and its OTLP HTTP exporter). Spans are built
on a thread of their own and sent in batches, off the event loop.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from jaxserve.request_trace import RequestTrace

logger = logging.getLogger("jaxserve.api_server")


def _ns(t: float) -> int:
    return int(t * 1e9)


def _attr(v: Any) -> Any:
    """OpenTelemetry attributes are str, bool, int, float or lists of one of them."""
    if isinstance(v, bool | int | float | str):
        return v
    if isinstance(v, list | tuple) and all(isinstance(x, str) for x in v):
        return list(v)
    return str(v)


class OtlpTraceExporter:
    def __init__(self, endpoint: str, service_name: str = "jaxserve") -> None:
        """Raises ImportError (with the install hint) without the `otel` extra."""
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError as e:
            raise ImportError("--otlp-traces-endpoint needs OpenTelemetry: "
                              "pip install -e '.[otel]'") from e
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self.tracer = self.provider.get_tracer("jaxserve")
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="jaxserve-otlp")

    def __call__(self, trace: RequestTrace) -> None:
        """Export a finished trace (queued to this exporter's thread)."""
        self._thread.submit(self._export, trace)

    def _export(self, trace: RequestTrace) -> None:
        from opentelemetry.trace import set_span_in_context

        try:
            d = trace.to_dict()
            summary = {f"jaxserve.{k}": _attr(v) for k, v in d["summary"].items()
                       if v is not None and k != "time_by_box"}
            for box, secs in d["summary"].get("time_by_box", {}).items():
                summary[f"jaxserve.time_s.{box}"] = secs
            root = self.tracer.start_span("llm_request", start_time=_ns(trace.received),
                                          attributes={"gen_ai.response.id": d["id"], **summary})
            ctx = set_span_in_context(root)
            end = trace.received
            for e in d["events"]:
                attrs = {"jaxserve.box": e["box"]}
                attrs.update({f"jaxserve.{k}": _attr(v) for k, v in e.items()
                              if k not in ("box", "name", "start", "end") and v is not None})
                span = self.tracer.start_span(f"{e['box']}.{e['name']}", context=ctx,
                                              start_time=_ns(e["start"]), attributes=attrs)
                span.end(end_time=_ns(e["end"]))
                end = max(end, e["end"])
            root.end(end_time=_ns(max(end, trace.finished or end)))
        except Exception:  # noqa: BLE001 - never let telemetry take a request down
            logger.exception("exporting the trace of %s failed", trace.request_id)

    def shutdown(self) -> None:
        self._thread.shutdown(wait=True)
        self.provider.shutdown()  # flushes the batch
