"""The app's ASGI middleware, outermost first after CORS: the API key check, then the body's
size limit (both answer before anything parses the body)."""

from __future__ import annotations

import hmac
from http import HTTPStatus
from typing import Any

from jaxserve.api_server.route_utils import api_error, route_path

# Request bodies above this are refused before they are parsed (parsing runs on the event
# loop): generous for the longest prompts max_model_len allows, far below what stalls it.
DEFAULT_MAX_BODY_BYTES = 16 << 20
# Routes outside /v1 that run the model: the API key guards them too.
MODEL_ROUTES = ("/pooling", "/invocations", "/score", "/rerank", "/v2/rerank", "/classify")


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
