"""Anthropic's Messages API: /v1/messages and /v1/messages/count_tokens (errors in Anthropic's
shape: route_utils.api_error)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from jaxserve.api_server.messages_protocol import CountTokensRequest, MessagesRequest
from jaxserve.api_server.route_utils import run_until_disconnected
from jaxserve.api_server.serving_messages import AnthropicServingMessages


def messages_router(messages: AnthropicServingMessages) -> APIRouter:
    router = APIRouter()

    # Anthropic's clients add ?beta=true; its query parameters and beta headers are accepted.
    @router.post("/v1/messages")
    async def create_message(body: MessagesRequest, raw: Request) -> Response:
        return await run_until_disconnected(raw, messages.create_message(body))

    @router.post("/v1/messages/count_tokens")
    async def count_message_tokens(body: CountTokensRequest) -> dict[str, int]:
        return await messages.count_tokens(body)

    return router
