"""The FastAPI application: OpenAI routes, vLLM's utility routes, errors.

Errors use OpenAI's body {"error": {"message", "type", "param", "code"}}: 400
for anything the request got wrong (types, ranges, a prompt too long), 404 for
an unknown model, 500 only for real faults (the engine core died, a bug).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

import jaxserve
from jaxserve.api_server.engine_client import EngineDeadError
from jaxserve.api_server.metrics import ServerMetrics
from jaxserve.api_server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from jaxserve.api_server.serving import (
    OpenAIError,
    ServingContext,
    error_from_exception,
    error_response,
)
from jaxserve.api_server.serving_chat import OpenAIServingChat
from jaxserve.api_server.serving_completion import OpenAIServingCompletion

logger = logging.getLogger(__name__)

# Not an HTTP status a client sees: nginx's "client closed request", for logs.
CLIENT_CLOSED_REQUEST = 499


def build_app(ctx: ServingContext, metrics: ServerMetrics,
              on_shutdown: Callable[[], Awaitable[None]] | None = None) -> FastAPI:
    """The app serving `ctx`'s model; `ctx.client` must be started.
    `on_shutdown` runs when uvicorn shuts down (before it re-raises a SIGTERM)."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        if on_shutdown is not None:
            await on_shutdown()

    app = FastAPI(title="jaxserve", version=jaxserve.__version__, lifespan=lifespan)
    completion = OpenAIServingCompletion(ctx)
    chat = OpenAIServingChat(ctx)

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, e: OpenAIError) -> JSONResponse:
        return error_response(e.message, e.status, e.param)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        errors = e.errors()
        first = errors[0] if errors else {}
        # loc is ("body", field, ...): name the field as a dotted path.
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        message = "; ".join(f"{'.'.join(str(p) for p in err.get('loc', ()) if p != 'body')}: "
                            f"{err.get('msg')}" for err in errors) or "invalid request"
        return error_response(message, HTTPStatus.BAD_REQUEST, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return error_response(str(e.detail), HTTPStatus(e.status_code))

    @app.exception_handler(ValueError)  # e.g. the engine core refused the request
    @app.exception_handler(EngineDeadError)
    @app.exception_handler(Exception)
    async def _internal_error(_: Request, e: Exception) -> JSONResponse:
        err = error_from_exception(e)
        if err.status == HTTPStatus.INTERNAL_SERVER_ERROR and not isinstance(e, EngineDeadError):
            logger.error("request failed: %s", err.message, exc_info=e)
        return error_response(err.message, err.status, err.param)

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, raw: Request) -> Response:
        return await run_until_disconnected(raw, completion.create_completion(body))

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, raw: Request) -> Response:
        return await run_until_disconnected(raw, chat.create_chat_completion(body))

    @app.get("/v1/models")
    async def show_models() -> ModelList:
        return ModelList(data=[ModelCard(id=name, root=ctx.model_path, max_model_len=ctx.max_model_len)
                               for name in ctx.served_model_names])

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        ctx.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise OpenAIError("give exactly one of prompt and messages", param="prompt")
        if body.messages is not None:
            text = ctx.render_chat(body.messages, body.add_generation_prompt)
            add_special = bool(body.add_special_tokens)
        else:
            text = body.prompt or ""
            add_special = body.add_special_tokens is not False
        tokens = ctx.tokenizer(text, add_special_tokens=add_special).input_ids
        strs = ctx.tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
        return TokenizeResponse(count=len(tokens), max_model_len=ctx.max_model_len, tokens=tokens,
                                token_strs=strs)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        ctx.check_model(body.model)
        if body.tokens and (min(body.tokens) < 0 or max(body.tokens) >= ctx.vocab_size):
            raise OpenAIError(f"tokens must be in [0, {ctx.vocab_size})", param="tokens")
        return DetokenizeResponse(prompt=ctx.tokenizer.decode(body.tokens))

    @app.get("/health")
    async def health() -> Response:
        if not ctx.client.is_alive:
            return error_response(ctx.client.dead_error or "engine core is dead",
                                  HTTPStatus.SERVICE_UNAVAILABLE)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": jaxserve.__version__}

    @app.get("/metrics")
    async def show_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


async def run_until_disconnected(raw: Request, handler: Awaitable[Response]) -> Response:
    """Run `handler`, cancelling it if the client disconnects first: the
    cancellation closes its generators, which abort the request in the engine.
    (A streaming response is watched by Starlette itself once it is returned.)"""
    task = asyncio.ensure_future(handler)
    listener = asyncio.ensure_future(_wait_for_disconnect(raw))
    try:
        await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the server is shutting down
        task.cancel()
        raise
    finally:
        listener.cancel()
    if task.done():
        return task.result()
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    return Response(status_code=CLIENT_CLOSED_REQUEST)


async def _wait_for_disconnect(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass
