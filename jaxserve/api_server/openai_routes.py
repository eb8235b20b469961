"""OpenAI's text generation routes: /v1/completions and /v1/chat/completions."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from jaxserve.api_server.protocol import ChatCompletionRequest, CompletionRequest
from jaxserve.api_server.route_utils import run_until_disconnected
from jaxserve.api_server.serving_chat import OpenAIServingChat
from jaxserve.api_server.serving_completion import OpenAIServingCompletion


def openai_router(completion: OpenAIServingCompletion, chat: OpenAIServingChat) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/completions")
    async def create_completion(body: CompletionRequest, raw: Request) -> Response:
        return await run_until_disconnected(raw, completion.create_completion(body))

    @router.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, raw: Request) -> Response:
        return await run_until_disconnected(raw, chat.create_chat_completion(body))

    return router
