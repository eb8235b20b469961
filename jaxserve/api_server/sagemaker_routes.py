"""SageMaker's /invocations (vLLM serves it): the body's shape picks the endpoint."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import ValidationError

from jaxserve.api_server.embedding_protocol import ClassificationRequest, EmbeddingRequest
from jaxserve.api_server.protocol import ChatCompletionRequest, CompletionRequest
from jaxserve.api_server.route_utils import describe_validation_errors, run_until_disconnected
from jaxserve.api_server.serving import OpenAIError, ServingContext
from jaxserve.api_server.serving_chat import OpenAIServingChat
from jaxserve.api_server.serving_completion import OpenAIServingCompletion
from jaxserve.api_server.serving_embedding import OpenAIServingEmbedding
from jaxserve.api_server.serving_score import RerankRequest, ScoreRequest, ServingScores


def sagemaker_router(ctx: ServingContext, completion: OpenAIServingCompletion,
                     chat: OpenAIServingChat, embedding: OpenAIServingEmbedding,
                     scores: ServingScores) -> APIRouter:
    router = APIRouter()
    # (the body's key, its request model, the handler), tried in this order.
    invocation_routes: list[tuple[str, type[Any], Callable[[Any], Awaitable[Any]]]] = [
        ("messages", ChatCompletionRequest, chat.create_chat_completion),
        ("prompt", CompletionRequest, completion.create_completion),
        ("input", ClassificationRequest, scores.classify) if ctx.processor.classifier
        else ("input", EmbeddingRequest, embedding.create_embedding),
        ("query", RerankRequest, scores.rerank),
        ("text_1", ScoreRequest, scores.score),
    ]

    @router.post("/invocations")
    async def invocations(raw: Request) -> Response:
        try:
            body = json.loads(await raw.body())
        except ValueError as e:
            raise OpenAIError(f"the body is not valid JSON ({e})") from None
        for key, model, handler in invocation_routes:
            if isinstance(body, dict) and key in body:
                try:
                    request = model.model_validate(body)
                except ValidationError as e:
                    message, param = describe_validation_errors(e.errors())
                    raise OpenAIError(message, param=param) from None
                reply = await run_until_disconnected(raw, handler(request))
                return reply if isinstance(reply, Response) else Response(
                    reply.model_dump_json(), media_type="application/json")
        raise OpenAIError("cannot find a route for this body: /invocations takes a chat "
                          "(messages), completion (prompt), embedding or classification "
                          "(input), rerank (query) or score (text_1) request")

    return router
