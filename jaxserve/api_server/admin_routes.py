"""The server's own routes, open without the API key: /health (503 once the engine core is
gone), /version and /metrics (Prometheus)."""

from __future__ import annotations

from http import HTTPStatus

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

import jaxserve
from jaxserve.api_server.serving import ServingContext, error_response
from jaxserve.metrics.prometheus import ServerMetrics


def admin_router(ctx: ServingContext, metrics: ServerMetrics) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health() -> Response:
        if not ctx.client.is_alive:
            return error_response(ctx.client.dead_error or "engine core is dead",
                                  HTTPStatus.SERVICE_UNAVAILABLE)
        return Response(status_code=200)

    @router.get("/version")
    async def version() -> dict[str, str]:
        return {"version": jaxserve.__version__}

    @router.get("/metrics")
    async def show_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return router
