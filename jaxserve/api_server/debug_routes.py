"""/debug: the map of boxes, live (docs/architecture.md, "The request path").

    GET /debug                  the page: boxes with live counters, a request's waterfall
    GET /debug/stats            the live counters per box (what the page draws)
    GET /debug/requests         running and recently finished requests, with summary timings
    GET /debug/requests/{id}    one request's trace: {"id", "events", "summary"}
    GET /debug/diagnose         {"findings": [{"symptom", "box", "evidence", "advice"}]}

Open like /metrics (no API key): traces hold ids, counts and timings, never text.
"""

from __future__ import annotations

import os
from http import HTTPStatus
from typing import Any

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, JSONResponse

from jaxserve.api_server.serving import ServingContext, error_response
from jaxserve.api_server.symptoms import diagnose

PAGE = os.path.join(os.path.dirname(__file__), "static", "debug.html")


def debug_router(ctx: ServingContext) -> APIRouter:
    router = APIRouter()
    with open(PAGE, encoding="utf-8") as f:
        page = f.read()

    @router.get("/debug", response_class=HTMLResponse, include_in_schema=False)
    async def debug_page() -> HTMLResponse:
        return HTMLResponse(page)

    @router.get("/debug/stats")
    async def debug_stats() -> dict[str, Any]:
        live = ctx.metrics.live()
        return {"model": ctx.model_name, "tracing": ctx.traces.enabled,
                "max_num_seqs": ctx.facts.max_num_seqs,
                "max_num_batched_tokens": ctx.facts.max_num_batched_tokens,
                "enforce_eager": ctx.facts.enforce_eager,
                "requests_running": len(ctx.traces.running),
                "boxes": boxes(live), "live": live}

    @router.get("/debug/requests")
    async def debug_requests() -> dict[str, Any]:
        return ctx.traces.listing()

    @router.get("/debug/requests/{request_id}")
    async def debug_request(request_id: str) -> Any:
        traces = ctx.traces.lookup(request_id)
        if not traces:
            return error_response(f"no trace of request {request_id!r} (finished requests are "
                                  f"kept until {ctx.traces.capacity} newer ones finish)",
                                  HTTPStatus.NOT_FOUND, "request_id")
        if len(traces) == 1:
            return JSONResponse({**traces[0].to_dict(), "id": request_id})
        # A completion with several prompts: each prompt's events, tagged with its index.
        events, summaries = [], []
        for t in traces:
            d = t.to_dict()
            i = int(t.request_id.rsplit("-", 1)[1])
            events += [{**e, "prompt": i} for e in d["events"]]
            summaries.append({"prompt": i, **d["summary"]})
        events.sort(key=lambda e: (e["start"], e["end"]))
        return JSONResponse({"id": request_id, "events": events, "summary": {"prompts": summaries}})

    @router.get("/debug/diagnose")
    async def debug_diagnose() -> dict[str, Any]:
        return {"findings": diagnose(ctx.traces, ctx.metrics, ctx.facts)}

    return router


def boxes(live: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The live counters grouped by the box they describe."""
    return {
        "api_server": {"tokens_per_s": live["tokens_per_s"]},
        "scheduler": {"waiting": live["waiting"], "running": live["running"],
                      "num_preemptions": live["num_preemptions"]},
        "kv_cache_manager": {"kv_cache_usage": live["kv_cache_usage"],
                             "kv_cache_usage_full_attention": live["kv_cache_usage_full_attention"],
                             "kv_cache_usage_sliding_window": live["kv_cache_usage_sliding_window"],
                             "state_slot_usage": live["state_slot_usage"],
                             "prefix_cache_hit_rate": live["prefix_cache_hit_rate"]},
        "model_runner": {"step_time_s": live["step_time_s"], "batch_size": live["batch_size"],
                         "num_steps": live["num_steps"], "num_compiles": live["num_compiles"],
                         "compile_s": live["compile_s"]},
    }
