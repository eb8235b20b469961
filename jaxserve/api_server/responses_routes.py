"""OpenAI's Responses API: create, retrieve, delete and cancel a response (/v1/responses)."""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from jaxserve.api_server.responses_protocol import ResponsesRequest
from jaxserve.api_server.route_utils import run_until_disconnected
from jaxserve.api_server.serving_responses import OpenAIServingResponses


def responses_router(responses: OpenAIServingResponses) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/responses")
    async def create_response(body: ResponsesRequest, raw: Request) -> Response:
        return await run_until_disconnected(raw, responses.create_response(body))

    @router.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str) -> Response:
        return Response(json.dumps(responses.retrieve(response_id)), media_type="application/json")

    @router.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> dict[str, Any]:
        return responses.delete(response_id)

    @router.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str) -> Response:
        return Response(json.dumps(await responses.cancel(response_id)),
                        media_type="application/json")

    return router
