"""The FastAPI application: OpenAI and Anthropic routes, vLLM's utility routes, errors.

Errors use OpenAI's body {"error": {"message", "type", "param", "code"}} (Anthropic's
{"type": "error", "error": {"type", "message"}} under /v1/messages): 400
for anything the request got wrong (types, ranges, a prompt too long), 401
without the API key (when one is set), 404 for an unknown model, 413 for a body
over the size limit, 503 when the engine core is gone, 500 only for bugs (a
generic message with an error id; the details go to the log).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

import jaxserve
from jaxserve.api_server.debug_routes import add_debug_routes
from jaxserve.engine.core_client import EngineDeadError, RequestRejectedError
from jaxserve.engine.processor import InvalidInputError
from jaxserve.metrics.prometheus import ServerMetrics
from jaxserve.api_server.protocol import ChatCompletionRequest, CompletionRequest
from jaxserve.api_server.utility_protocol import (
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
from jaxserve.api_server.messages_protocol import (
    CountTokensRequest,
    MessagesRequest,
    anthropic_error_response,
)
from jaxserve.api_server.responses_protocol import ResponsesRequest
from jaxserve.api_server.embedding_protocol import ClassificationRequest, EmbeddingRequest, PoolingRequest
from jaxserve.api_server.serving_chat import OpenAIServingChat
from jaxserve.api_server.serving_embedding import OpenAIServingEmbedding
from jaxserve.api_server.serving_messages import AnthropicServingMessages
from jaxserve.api_server.serving_score import RerankRequest, ScoreRequest, ServingScores
from jaxserve.api_server.serving_responses import OpenAIServingResponses
from jaxserve.api_server.serving_completion import OpenAIServingCompletion

logger = logging.getLogger(__name__)

# Not an HTTP status a client sees: nginx's "client closed request", for logs.
CLIENT_CLOSED_REQUEST = 499
# Request bodies above this are refused before they are parsed (parsing runs on the event
# loop): generous for the longest prompts max_model_len allows, far below what stalls it.
DEFAULT_MAX_BODY_BYTES = 16 << 20
# Routes outside /v1 that run the model: the API key guards them too.
MODEL_ROUTES = ("/pooling", "/invocations", "/score", "/rerank", "/v2/rerank", "/classify")


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
    completion = OpenAIServingCompletion(ctx)
    chat = OpenAIServingChat(ctx)
    responses = OpenAIServingResponses(chat)
    messages = AnthropicServingMessages(chat)
    embedding = OpenAIServingEmbedding(ctx)

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

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, raw: Request) -> Response:
        return await run_until_disconnected(raw, completion.create_completion(body))

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, raw: Request) -> Response:
        return await run_until_disconnected(raw, chat.create_chat_completion(body))

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, raw: Request) -> Response:
        return await run_until_disconnected(raw, responses.create_response(body))

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str) -> Response:
        return Response(json.dumps(responses.retrieve(response_id)), media_type="application/json")

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> dict[str, Any]:
        return responses.delete(response_id)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str) -> Response:
        return Response(json.dumps(await responses.cancel(response_id)),
                        media_type="application/json")

    # Anthropic's clients add ?beta=true; its query parameters and beta headers are accepted.
    @app.post("/v1/messages")
    async def create_message(body: MessagesRequest, raw: Request) -> Response:
        return await run_until_disconnected(raw, messages.create_message(body))

    @app.post("/v1/messages/count_tokens")
    async def count_message_tokens(body: CountTokensRequest) -> dict[str, int]:
        return await messages.count_tokens(body)

    @app.post("/v1/embeddings")
    async def create_embedding(body: EmbeddingRequest, raw: Request) -> Response:
        return await run_until_disconnected(raw, embedding.create_embedding(body))

    @app.post("/pooling")
    async def create_pooling(body: PoolingRequest, raw: Request) -> Response:
        return await run_until_disconnected(raw, embedding.create_embedding(body, pooling=True))

    scores = ServingScores(embedding)
    for path in ("/score", "/v1/score"):
        app.add_api_route(path, scores.score, methods=["POST"], response_model=None)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.add_api_route(path, scores.rerank, methods=["POST"], response_model=None)

    app.add_api_route("/classify", scores.classify, methods=["POST"], response_model=None)

    # SageMaker's route (vLLM serves it): the body's shape picks the endpoint.
    invocation_routes: list[tuple[str, type[Any], Callable[[Any], Awaitable[Any]]]] = [
        ("messages", ChatCompletionRequest, chat.create_chat_completion),
        ("prompt", CompletionRequest, completion.create_completion),
        ("input", ClassificationRequest, scores.classify) if ctx.processor.classifier
        else ("input", EmbeddingRequest, embedding.create_embedding),
        ("query", RerankRequest, scores.rerank),
        ("text_1", ScoreRequest, scores.score),
    ]

    @app.post("/invocations")
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

    @app.get("/v1/models")
    async def show_models() -> ModelList:
        # root is the served name, not the checkpoint's path on this machine.
        return ModelList(data=[ModelCard(id=name, root=name, max_model_len=ctx.max_model_len)
                               for name in ctx.served_model_names])

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        ctx.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise OpenAIError("give exactly one of prompt and messages", param="prompt")
        if body.messages is not None:
            tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
            text = await ctx.render_chat(body.messages, body.add_generation_prompt,
                                         body.continue_final_message, body.chat_template_kwargs,
                                         body.chat_template, tools)
            add_special = bool(body.add_special_tokens)
        else:
            text = body.prompt or ""
            add_special = body.add_special_tokens is not False
        tokens = await ctx.tokenize(text, "messages" if body.messages is not None else "prompt",
                                    add_special_tokens=add_special)
        strs = ctx.tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
        return TokenizeResponse(count=len(tokens), max_model_len=ctx.max_model_len, tokens=tokens,
                                token_strs=strs)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        ctx.check_model(body.model)
        if body.tokens and (min(body.tokens) < 0 or max(body.tokens) >= ctx.vocab_size):
            raise OpenAIError(f"tokens must be in [0, {ctx.vocab_size})", param="tokens")
        ctx.need_tokenizer("tokens")
        return DetokenizeResponse(prompt=await ctx.off_loop(ctx.tokenizer.decode, body.tokens))

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

    add_debug_routes(app, ctx)
    return app


def route_path(scope: dict[str, Any]) -> str:
    """The request's path without --root-path (uvicorn puts it in front of the path)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


def api_error(scope: dict[str, Any], message: str, status: HTTPStatus,
              param: str | None = None) -> JSONResponse:
    """The error in the shape of the API the request called: Anthropic's under /v1/messages."""
    if route_path(scope).startswith("/v1/messages"):
        return anthropic_error_response(message, status)
    return error_response(message, status, param)


def describe_validation_errors(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """pydantic's errors -> (message, param). The field path keeps field names and list
    indices and drops pydantic's union-branch tags ("list[int]", "function-after[...]");
    among a union's alternatives, our own checks (value errors) explain best, then a broken
    constraint, then a type mismatch."""
    def path(err: dict[str, Any]) -> str:
        parts = [str(p) for p in err.get("loc", ())
                 if p != "body" and (isinstance(p, int) or str(p).isidentifier())]
        return ".".join(parts)

    if not errors:
        return "invalid request", None
    if errors[0].get("type") == "json_invalid":
        loc = errors[0].get("loc", ())
        where = f" at character {loc[1]}" if len(loc) > 1 else ""
        return f"the body is not valid JSON ({errors[0].get('msg')}{where})", None
    # Our own checks first, then broken constraints (too short, out of range), then the
    # type mismatches every other union branch reports.
    best = min(errors, key=lambda e: 0 if e.get("type") == "value_error"
               else 2 if str(e.get("type", "")).endswith("_type") else 1)
    param = path(best) or None
    msg = str(best.get("msg", "invalid value")).removeprefix("Value error, ")
    fields = {path(e) for e in errors}
    more = f" (and {len(fields) - 1} more fields)" if len(fields) > 1 else ""
    return (f"{param}: {msg}{more}" if param else f"{msg}{more}"), param


class BodySizeLimit:
    """413 for a request body over `max_bytes` (by its Content-Length, or counted as a
    chunked body streams in), before anything parses it."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = api_error(scope, f"request body is larger than {self.max_bytes:,} bytes",
                              HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
        length = dict(scope.get("headers", ())).get(b"content-length")
        if length is not None:
            if not length.isdigit() or int(length) > self.max_bytes:
                return await too_large(scope, receive, send)
            return await self.app(scope, receive, send)
        # No Content-Length (chunked): buffer up to the limit, then replay to the app.
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                return await too_large(scope, receive, send)
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        body, replayed = b"".join(chunks), False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class ApiKeyAuth:
    """Every /v1 route and the other routes that run the model (MODEL_ROUTES) need
    `Authorization: Bearer <key>` (vLLM's --api-key) or `x-api-key: <key>` (Anthropic's
    clients send that): 401 otherwise."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app, self.key = app, api_key.encode()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = route_path(scope)
        if scope["type"] == "http" and (path.startswith("/v1") or path in MODEL_ROUTES):
            headers = dict(scope.get("headers", ()))
            bearer = headers.get(b"authorization", b"")
            # Both compared, always: the time taken says nothing about which one was sent.
            ok = hmac.compare_digest(bearer, b"Bearer " + self.key)
            ok = hmac.compare_digest(headers.get(b"x-api-key", b""), self.key) or ok
            if not ok:
                response = api_error(scope, "invalid or missing API key (send Authorization: "
                                     "Bearer <key>, or x-api-key: <key>)", HTTPStatus.UNAUTHORIZED)
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


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
