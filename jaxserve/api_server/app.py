"""The FastAPI application: its routers, middleware and error handlers.

    openai_routes.py     /v1/completions, /v1/chat/completions
    responses_routes.py  /v1/responses (create, retrieve, delete, cancel)
    messages_routes.py   /v1/messages, /v1/messages/count_tokens (Anthropic)
    pooling_routes.py    /v1/embeddings, /pooling, /score, /rerank, /classify
    sagemaker_routes.py  /invocations
    utility_routes.py    /v1/models, /tokenize, /detokenize
    admin_routes.py      /health, /version, /metrics
    debug_routes.py      /debug and its JSON

Errors use OpenAI's body {"error": {"message", "type", "param", "code"}} (Anthropic's
{"type": "error", "error": {"type", "message"}} under /v1/messages): 400
for anything the request got wrong (types, ranges, a prompt too long), 401
without the API key (when one is set), 404 for an unknown model, 413 for a body
over the size limit, 503 when the engine core is gone, 500 only for bugs (a
generic message with an error id; the details go to the log).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import jaxserve
from jaxserve.api_server.admin_routes import admin_router
from jaxserve.api_server.debug_routes import debug_router
from jaxserve.api_server.messages_routes import messages_router
from jaxserve.api_server.middleware import DEFAULT_MAX_BODY_BYTES, ApiKeyAuth, BodySizeLimit
from jaxserve.api_server.openai_routes import openai_router
from jaxserve.api_server.pooling_routes import pooling_router
from jaxserve.api_server.responses_routes import responses_router
from jaxserve.api_server.route_utils import api_error, describe_validation_errors
from jaxserve.api_server.sagemaker_routes import sagemaker_router
from jaxserve.api_server.serving import OpenAIError, ServingContext, error_from_exception
from jaxserve.api_server.serving_chat import OpenAIServingChat
from jaxserve.api_server.serving_completion import OpenAIServingCompletion
from jaxserve.api_server.serving_embedding import OpenAIServingEmbedding
from jaxserve.api_server.serving_messages import AnthropicServingMessages
from jaxserve.api_server.serving_responses import OpenAIServingResponses
from jaxserve.api_server.serving_score import ServingScores
from jaxserve.api_server.utility_routes import utility_router
from jaxserve.engine.core_client import EngineDeadError, RequestRejectedError
from jaxserve.engine.processor import InvalidInputError
from jaxserve.metrics.prometheus import ServerMetrics


def build_app(ctx: ServingContext, metrics: ServerMetrics,
              on_shutdown: Callable[[], Awaitable[None]] | None = None, *,
              api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              cors: dict[str, Any] | None = None) -> FastAPI:
    """The app serving `ctx`'s model; `ctx.client` must be started.
    `on_shutdown` runs when uvicorn shuts down (before it re-raises a SIGTERM).
    With `api_key`, every /v1 route needs `Authorization: Bearer <api_key>`. `cors` are
    CORSMiddleware's arguments (vLLM's --allowed-origins ...; default: any origin)."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        if on_shutdown is not None:
            await on_shutdown()

    app = FastAPI(title="jaxserve", version=jaxserve.__version__, lifespan=lifespan)
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    if api_key:
        app.add_middleware(ApiKeyAuth, api_key=api_key)
    # Outermost: a CORS preflight (OPTIONS, no credentials) is answered before the key check.
    app.add_middleware(CORSMiddleware, **(cors or dict(allow_origins=["*"], allow_methods=["*"],
                                                       allow_headers=["*"])))
    add_exception_handlers(app)

    completion = OpenAIServingCompletion(ctx)
    chat = OpenAIServingChat(ctx)
    embedding = OpenAIServingEmbedding(ctx)
    scores = ServingScores(embedding)
    # The order of the routes (and of /openapi.json) is the order they are included in.
    app.include_router(openai_router(completion, chat))
    app.include_router(responses_router(OpenAIServingResponses(chat)))
    app.include_router(messages_router(AnthropicServingMessages(chat)))
    app.include_router(pooling_router(embedding, scores))
    app.include_router(sagemaker_router(ctx, completion, chat, embedding, scores))
    app.include_router(utility_router(ctx))
    app.include_router(admin_router(ctx, metrics))
    app.include_router(debug_router(ctx))
    return app


def add_exception_handlers(app: FastAPI) -> None:
    """Every error as a JSON body in the shape of the API the request called (api_error)."""

    @app.exception_handler(OpenAIError)
    async def _openai_error(raw: Request, e: OpenAIError) -> JSONResponse:
        return api_error(raw.scope, e.message, e.status, e.param)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(raw: Request, e: RequestValidationError) -> JSONResponse:
        message, param = describe_validation_errors(e.errors())
        return api_error(raw.scope, message, HTTPStatus.BAD_REQUEST, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(raw: Request, e: StarletteHTTPException) -> JSONResponse:
        return api_error(raw.scope, str(e.detail), HTTPStatus(e.status_code))

    async def _other_error(raw: Request, e: Exception) -> JSONResponse:
        err = error_from_exception(e, f"{raw.method} {raw.url.path}")
        return api_error(raw.scope, err.message, err.status, err.param)

    # The engine's refusals and its death are expected errors: handled here, not by the
    # catch-all, which Starlette re-raises into uvicorn's "Exception in ASGI application".
    for expected in (EngineDeadError, RequestRejectedError, InvalidInputError, Exception):
        app.add_exception_handler(expected, _other_error)
